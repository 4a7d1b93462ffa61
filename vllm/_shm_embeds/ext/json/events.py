# SPDX-License-Identifier: Apache-2.0
"""The ``json`` extension's counted events (base64 JSON bodies).

``EXTENSION.events``; ``counters.events()`` lists them with the core's.
"""

from vllm._shm_embeds.counters import EventKind


class JsonEvent(EventKind):
    """Events of the ``json`` extension (``counters.EventKind``)."""

    JSON_BODIES = ("json_bodies", None, "base64 JSON bodies the JSON path decoded")
    JSON_TENSORS = ("json_tensors", "json_tensors", "their tensors (how: loader)")
    JSON_DIRECT_TENSORS = ("json_direct_tensors", "json_tensors",
                           "those of them decoded straight into shared memory (how: direct)")
    JSON_BYTES = ("json_bytes", None, "their bytes")
    JSON_FALLBACK = ("json_fallback", "json_fallbacks",
                     "large JSON bodies left to vLLM's decode", ("reason",))
    JSON_DIRECT_DECLINED = ("json_direct_declined", "json_direct_declined",
                            "JSON payloads left to vLLM's loader", ("reason",))
