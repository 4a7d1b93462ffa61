# SPDX-License-Identifier: Apache-2.0
"""Extension ``conversations``: a request's prompt_embeds kept by the API server, then
named as the prefix of later requests that send only their new rows.

``store.py`` (kept tensors by opaque id, bound to ``cache_salt``; TTL, LRU, caps),
``tips.py`` (memfds of kept rows that grow in place; hop 1 sends them by descriptor),
``prefixes.py`` (the binary format's ``binary_prefixes`` hook: keep, resolve),
``settings.py`` (its limits). ``docs/conversations.md``.
May import: the core; ``binary`` and ``digests`` through ``extensions.require``.
"""

from vllm._shm_embeds.extensions import Extension
from vllm._shm_embeds.ext.conversations import settings
from vllm._shm_embeds.ext.conversations.events import ConversationEvent

EXTENSION = Extension(
    what="conversations: kept prompt_embeds named as a later request's prefix",
    events=ConversationEvent,
    needs=("digests", "binary"),
    api=("store",),
    provides={"binary_prefixes": ({"target": "prefixes:HOOK"},)},
    limits=settings.LIMITS,
)
