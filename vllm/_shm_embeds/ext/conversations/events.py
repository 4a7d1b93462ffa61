# SPDX-License-Identifier: Apache-2.0
"""The ``conversations`` extension's counted events (kept prompt_embeds, prefixes).

``EXTENSION.events``; ``counters.events()`` lists them with the core's.
"""

from vllm._shm_embeds.counters import EventKind


class ConversationEvent(EventKind):
    """Events of the ``conversations`` extension (``counters.EventKind``)."""

    KEPT_TENSORS = ("kept_tensors", None, "prompt_embeds kept for later requests")
    KEPT_BYTES = ("kept_bytes", None, "their bytes")
    KEPT_COPIED_BYTES = ("kept_copied_bytes", None,
                         "bytes copied to keep or continue a tensor (a JSON keep, a branch, "
                         "no room to grow in place); a conversation's tip copies none")
    TIP_GROWN = ("tip_grown", None, "continuations written after their kept rows, in place")
    KEEP_REFUSED = ("keep_refused", None, "keeps asked for and not made", ("reason",))
    KEPT_DROPPED = ("kept_dropped", None, "kept tensors let go", ("reason",))
    PREFIX_HITS = ("prefix_hits", None, "tensors whose prefix was a kept tensor")
    PREFIX_ROWS = ("prefix_rows", None, "rows of theirs the client did not send")
    PREFIX_MISSES = ("prefix_misses", None, "prefix references that matched no kept tensor")
    SIBLING_HITS = ("sibling_hits", None,
                    "prefixes kept by a sibling API server, served here from its memory")
    SIBLING_SERVED = ("sibling_served", None, "kept tensors of this API server a sibling pinned")
    SIBLING_KEPT = ("sibling_kept", None,
                    "ids this API server made for a sibling's continuation of its rows")
    CHAT_PARTS = ("chat_parts", None, "chat prompt_embeds parts served from kept memory")
    CHAT_GROWN = ("chat_grown", None, "chat prompts written after the kept turn's, in place")
    CHAT_REBUILT = ("chat_rebuilt", None, "chat prompts naming kept parts that did not begin "
                    "with their kept turn's prompt: built whole", ("reason",))
