# SPDX-License-Identifier: Apache-2.0
"""A keep one request asks for (``Shm-Embeds-Keep``): :class:`KeepRequest`, an id
reserved at once, the tensor kept as it is when it lies in a tip, else copied into a
new tip on a thread while vLLM serves the request; the id in a 200's headers; and the
one timer that sweeps expired ids. ``docs/conversations.md``.
May import: the core; ``digests`` via ``extensions.require``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from typing import Any

import torch
from shm_embeds_client import wire
from vllm.logger import init_logger

from vllm._shm_embeds import extensions
from vllm._shm_embeds.counters import count_many, count_reason
from vllm._shm_embeds.ext.conversations import remote
from vllm._shm_embeds.ext.conversations.events import ConversationEvent
from vllm._shm_embeds.ext.conversations.local import holder, max_entries, new_tip, store
from vllm._shm_embeds.ext.conversations.store import Kept
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.pools import LazyPool

logger = init_logger(__name__)

_digests = extensions.require("digests", "digests")

KEPT_HEADER = wire.KEPT_HEADER.lower().encode()


_COPIER = LazyPool(1, "shm-embeds-keep")
_timer: asyncio.TimerHandle | None = None  # the one sweep timer: at the next expiry


def _schedule_sweep(loop: asyncio.AbstractEventLoop) -> None:
    """Have the store swept just after its next expiry (the loop's clock is monotonic)."""
    global _timer
    when = store().next_expiry()
    if when is None or (_timer is not None and _timer.when() <= when + 0.5):
        return
    if _timer is not None:
        _timer.cancel()
    _timer = loop.call_at(when + 0.5, _swept, loop)


def _swept(loop: asyncio.AbstractEventLoop) -> None:
    global _timer
    _timer = None
    store().sweep()
    _schedule_sweep(loop)


def _after_fork_in_child() -> None:
    global _timer
    _timer = None


os.register_at_fork(after_in_child=_after_fork_in_child)


class KeepRequest:
    """A keep asked for by one request: an id reserved at once, the copy made on a
    thread while vLLM serves the request; the id goes in the response headers of a
    200 without waiting for the copy (a continuation naming it waits for it, and
    misses if it failed), any other status forgets it."""

    def __init__(self, ttl_s: float, salt: str | None) -> None:
        self.ttl_s, self.salt = ttl_s, salt
        self.chat: Any = None  # a chat turn's rendered prompt (``rendered.Rendered``), kept with it
        self.future: concurrent.futures.Future | None = None
        self.kid: str | None = None
        self.answered = False
        self._sibling: tuple[remote.Remote, int, Any] | None = None  # kept there at the answer

    def start(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (the request's, digests attached): a tensor over a tip is
        kept as it is; any other is copied into a new tip on a thread. No room:
        answered without an id."""
        found = holder().lookup(tensor)
        if found is not None and found[0].remote is not None:  # a sibling's tip, grown here
            found[0].remote.hold()
            self._sibling = (found[0].remote, found[1], _digests.attached(tensor))
            return
        if found is not None:  # written into its tip as it arrived: nothing to copy
            self.kid = store().put(found[0], found[1], _digests.attached(tensor), self.salt,
                                   self.ttl_s, max_entries(), self.chat)
            if self.kid is not None:
                count_many({ConversationEvent.KEPT_TENSORS: 1,
                            ConversationEvent.KEPT_BYTES: tensor.nbytes})
            return
        if tensor.dim() != 2 or tensor.numel() == 0:
            return
        reserved = store().reserve(tuple(tensor.shape), tensor.dtype, self.salt, self.ttl_s,
                                   max_entries(), self.chat)
        if reserved is None:
            return
        kid, kept = reserved
        try:
            self.future = _COPIER.get().submit(self._copy, tensor, _digests.attached(tensor), kept)
        except RuntimeError:  # the pool is shut down (exit): no id
            store().fill(kept, None)
            return
        self.kid = kid

    @staticmethod
    def _copy(tensor: torch.Tensor, digests: Any, kept: Kept) -> None:
        # Whatever happens, the entry is filled (its waiters wake): by the copy or None;
        # a tip whose bytes were not all written is never kept.
        tip, written = None, False
        try:
            if kept.gone:  # evicted or dropped while waiting for this thread
                return
            rows, hidden = tensor.shape
            tip = new_tip(tensor.dtype, rows, hidden)
            if tip is None:
                return
            # (a JSON payload's tensor may be a view: its values, in order)
            src = tensor.resolve_neg().resolve_conj().contiguous()
            tip.ensure(rows)
            tip.write(memoryview(src.reshape(-1).view(torch.uint8).numpy()), 0)
            written = True
        except OSError as e:  # no memory: the id misses
            count_reason(ConversationEvent.KEEP_REFUSED, seg.fallback_reason(e))
        finally:
            if tip is not None and not written:  # (any error, e.g. torch's allocator)
                store().let_go(tip)
                tip = None
            if store().fill(kept, tip, digests) and tip is not None:
                count_many({ConversationEvent.KEPT_TENSORS: 1,
                            ConversationEvent.KEPT_BYTES: tensor.nbytes,
                            ConversationEvent.KEPT_COPIED_BYTES: tensor.nbytes})
            if tip is not None:
                store().let_go(tip)  # (the entry uses it now, if it was kept)

    async def settled(self) -> None:
        """Wait, on the event loop, until the copy is done (an error included)."""
        if self.future is not None:
            await asyncio.wait([asyncio.wrap_future(self.future)])

    def wait(self) -> None:
        """Block until the copy is done (before the source's pages go)."""
        if self.future is not None:
            concurrent.futures.wait([self.future])

    async def response_headers(self, status: int) -> list[tuple[bytes, bytes]]:
        """At the response's start: the id header of a 200 (the entry expires at its
        TTL; its copy may still run); any other status forgets the kept tensor. A
        sibling's tip grown here is kept there now (a round trip, on a thread)."""
        if self._sibling is not None and not self.answered:
            self.answered = True
            (lease, rows, d), self._sibling = self._sibling, None
            if status != 200:
                lease.let_go()
                return []
            salt = self.salt
            fut = asyncio.get_running_loop().run_in_executor(
                remote.round_trips(), lease.commit, rows, d, salt, self.ttl_s, self.chat)

            def orphaned(f: asyncio.Future) -> None:  # cancelled: the id is never sent
                if not f.cancelled() and f.exception() is None and f.result() is not None:
                    lease.drop(f.result(), salt)
                lease.let_go()

            try:
                self.kid = await asyncio.shield(fut)
            except asyncio.CancelledError:
                fut.add_done_callback(orphaned)
                raise
            lease.let_go()
            if self.kid is None:
                return []
            count_many({ConversationEvent.KEPT_TENSORS: 1,
                        ConversationEvent.KEPT_BYTES: rows * lease.tip.row_bytes})
            return [(KEPT_HEADER, self.kid.encode())]
        if self.kid is None or self.answered or self._sibling is not None:
            return []
        self.answered = True
        if status != 200:
            store().drop(self.kid, self.salt, "failed")
            return []
        _schedule_sweep(asyncio.get_running_loop())
        return [(KEPT_HEADER, self.kid.encode())]

    def close(self) -> None:
        """The request has ended: a kept tensor whose id was never sent is forgotten;
        waits for the copy (the source's pages go next)."""
        sibling, self._sibling = self._sibling, None
        if sibling is not None:  # never answered: nothing was kept there
            sibling[0].let_go()
        if self.kid is None:
            return
        self.wait()
        if not self.answered:
            self.answered = True
            store().drop(self.kid, self.salt, "unanswered")
        if self.future is not None and (e := self.future.exception()) is not None:
            logger.warning("shm-embeds: keeping a request's prompt_embeds failed: %r", e)
