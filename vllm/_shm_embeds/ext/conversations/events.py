# SPDX-License-Identifier: Apache-2.0
"""The ``conversations`` extension's counted events (kept prompt_embeds, prefixes).

``EXTENSION.events``; ``counters.events()`` lists them with the core's.
"""

from vllm._shm_embeds.counters import EventKind


class ConversationEvent(EventKind):
    """Events of the ``conversations`` extension (``counters.EventKind``)."""

    KEPT_TENSORS = ("kept_tensors", None, "prompt_embeds kept for later requests")
    KEPT_BYTES = ("kept_bytes", None, "their bytes (one copy each, into a kept segment)")
    KEEP_REFUSED = ("keep_refused", None, "keeps asked for and not made", ("reason",))
    KEPT_DROPPED = ("kept_dropped", None, "kept tensors let go", ("reason",))
    PREFIX_HITS = ("prefix_hits", None, "tensors whose prefix was a kept tensor")
    PREFIX_ROWS = ("prefix_rows", None, "rows of theirs the client did not send")
    PREFIX_MISSES = ("prefix_misses", None, "prefix references that matched no kept tensor")
