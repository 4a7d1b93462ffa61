# SPDX-License-Identifier: Apache-2.0
"""This API server's kept rows: its store (``store.Store``), its tip holder, its share
of the budget, and a new tip claimed against it. Shared by ``prefixes.py`` (resolve,
grow), ``keeps.py`` (keep) and ``chat.py``; served to siblings by ``siblings.Owner``.
May import: the core; ``binary`` (common) and ``digests`` via ``extensions.require``.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm._shm_embeds import extensions
from vllm._shm_embeds.counters import count_reason
from vllm._shm_embeds.ext.conversations import settings, siblings, tips
from vllm._shm_embeds.ext.conversations.events import ConversationEvent
from vllm._shm_embeds.ext.conversations.store import current
from vllm._shm_embeds.files import segment as seg

_common = extensions.require("binary", "common")
_digests = extensions.require("digests", "digests")


def store():
    """This process's kept tensors (``store.Store``); its ids are served to sibling
    API servers (``siblings.Owner``, started with it)."""
    return current(_close_tip, _listen)


def _close_tip(tip: tips.Tip) -> None:
    tip.close()


def max_bytes() -> int:
    """This API server's share of ``KEEP_MAX_BYTES``: the budget is the whole
    server's, split over its API servers (vLLM's ``_api_process_count``)."""
    return settings.keep_max_bytes() // _common.api_servers()


def max_entries() -> int:
    """This API server's share of ``KEEP_MAX_ENTRIES`` (at least one)."""
    return max(1, settings.keep_max_entries() // _common.api_servers())


def block_digests(block: Any, rows: int, digests: bytes) -> Any:
    """``digests.BlockDigests`` of ``rows`` rows a sibling sent, or None unless
    ``block`` is a block size and ``digests`` one digest per block."""
    if type(block) is not int or block < 1 or len(digests) != (
            -(-rows // block) * _digests.DIGEST_BYTES):
        return None
    return _digests.BlockDigests(block, rows, digests)


def _listen() -> str | None:
    """This store's tag, served to siblings; None (random ids, nobody asked) when
    this ``vllm serve`` has one API server."""
    if _common.api_servers() < 2:
        return None
    return siblings.Owner(store, max_bytes, max_entries, settings.keep_max_s,
                          block_digests).listen()


def let_go(tip: tips.Tip) -> None:
    """A use of ``tip`` ended: of this store's, or of a sibling's lease."""
    if tip.remote is not None:
        tip.remote.let_go()
    else:
        store().let_go(tip)


def unclaim(tip: tips.Tip, start: int, rows: int) -> None:
    if tip.remote is not None:
        tip.remote.unclaim(rows)
    else:
        store().unclaim(tip, start, rows)


def holder() -> tips.Tips:
    """This process's request tensors over tips (hop 1 sends them by descriptor)."""
    return tips.holder(let_go)


def new_tip(dtype: torch.dtype, rows: int, hidden: int) -> tips.Tip | None:
    """A new tip with ``rows`` claimed for the caller, or None (no room, no memfd)."""
    try:
        tip = tips.Tip(dtype, hidden)
    except OSError as e:
        count_reason(ConversationEvent.KEEP_REFUSED, seg.fallback_reason(e))
        return None
    if store().claim(tip, 0, rows, max_bytes()) is not None:
        tip.close()
        return None
    return tip
