# SPDX-License-Identifier: Apache-2.0
"""The ``binary`` extension's counted events (binary request bodies).

``EXTENSION.events``; ``counters.events()`` lists them with the core's.
"""

from vllm._shm_embeds.counters import EventKind


class BinaryEvent(EventKind):
    """Events of the ``binary`` extension (``counters.EventKind``)."""

    BINARY_BODIES = ("binary_bodies", "binary_bodies", "binary request bodies accepted")
    BINARY_TENSORS = ("binary_tensors", None, "their tensors")
    BINARY_BYTES = ("binary_bytes", "binary_bytes", "their tensor bytes (as they arrived)")
    BINARY_CONVERTED_BYTES = ("binary_converted_bytes", None,
                              "bytes of binary tensors cast to the model's dtype")
    BINARY_REJECTED = ("binary_rejected", "binary_rejected", "binary bodies rejected", ("reason",))
    BINARY_FALLBACK = ("binary_fallback", "binary_fallbacks",
                       "binary tensors received into private memory", ("reason",))
