# SPDX-License-Identifier: Apache-2.0
"""Extension ``conversations``: a request's prompt_embeds kept by the API server, then
named as the prefix of later requests that send only their new rows.

``store.py`` (kept tensors by opaque id, bound to ``cache_salt``; TTL, LRU, caps),
``tips.py`` (memfds of kept rows that grow in place; hop 1 sends them by descriptor),
``local.py`` (this API server's store, tip holder and budget share), ``keeps.py`` (a
request's keep), ``prefixes.py`` (the ``binary_prefixes`` hook: keep, resolve, grow),
``siblings.py``/``remote.py`` (ids kept by another API server), ``chat.py`` (chat
turns: kept parts named by id, the rendered prompt grown in place),
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
    provides={"binary_prefixes": ({"target": "prefixes:HOOK"},),
              "chat_turns": ({"target": "chat:HOOK"},)},
    limits=settings.LIMITS,
)
