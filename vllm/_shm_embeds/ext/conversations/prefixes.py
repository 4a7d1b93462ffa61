# SPDX-License-Identifier: Apache-2.0
"""Conversations on binary bodies: the ``binary_prefixes`` hook (:data:`HOOK`).

A request with ``Shm-Embeds-Keep: <seconds>`` has its one ``prompt_embeds`` tensor
copied into a kept segment while vLLM serves it (:class:`KeepRequest`); a 200
answer then carries ``Shm-Embeds-Kept: <id>``. A later request names the id
(a binary descriptor's ``shm_embeds_prefix``, or a JSON continuation object)
and sends only the rows after those kept: the body format writes the kept rows,
then the new ones, into the request's segment (:meth:`Hook.resolve`,
:meth:`Hook.assemble`), with the kept rows' block digests reused. An id
the store does not hold under the request's ``cache_salt`` is a 404
``PrefixNotFound``, never the new rows alone. Wire: ``shm_embeds_client.wire``.
May import: the core; ``binary`` (gate, common) and ``digests`` via ``extensions.require``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
from typing import Any

import torch
from shm_embeds_client import wire
from vllm.logger import init_logger

from vllm._shm_embeds import extensions
from vllm._shm_embeds.counters import count, count_many, count_reason
from vllm._shm_embeds.ext.conversations import settings
from vllm._shm_embeds.ext.conversations.events import ConversationEvent
from vllm._shm_embeds.ext.conversations.store import Kept, current
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.lifetime.streamed import StreamedSegment, release_streamed

logger = init_logger(__name__)

_gate = extensions.require("binary", "gate")
_common = extensions.require("binary", "common")
_digests = extensions.require("digests", "digests")

MISS = ("the prompt_embeds prefix this request names is not held by this server (unknown, "
        "expired or evicted, kept under another cache_salt, or by another server process); "
        "send the whole tensor")
KEEP_HEADER = wire.KEEP_HEADER.lower()
KEPT_HEADER = wire.KEPT_HEADER.lower().encode()


class PrefixNotFound(_gate.Refused):
    """404 ``PrefixNotFound``: the same answer for every reference not held."""

    def __init__(self) -> None:
        super().__init__(404, "prefix_not_found", MISS)

    @property
    def err_type(self) -> str:
        return wire.PREFIX_NOT_FOUND


def _bad(reason: str, message: str) -> Exception:
    return _gate.Refused(400, reason, message)


def store():
    """This process's kept tensors (``store.Store``)."""
    return current(release_streamed)


def salt_of(body: dict) -> str | None:
    """The request's ``cache_salt`` (None: none). Raises Refused (400) if not a string."""
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _bad("cache_salt", "cache_salt must be a string")
    return salt


class Prefix:
    """Kept rows a continuation starts with, pinned until :meth:`release`: ``rows``,
    ``row_bytes``; ``tensor`` and ``digests`` once :meth:`ready` (or :meth:`wait`)."""

    def __init__(self, kept: Kept) -> None:
        self._kept = kept
        self.rows = kept.shape[0]
        self.row_bytes = kept.nbytes // max(1, self.rows)
        self.tensor: torch.Tensor | None = None
        self.digests: Any = None

    async def ready(self) -> None:
        """Wait, on the event loop, for the kept rows' copy (a keep still copying when
        its id was answered). Raises PrefixNotFound if the copy failed."""
        # (asyncio.wait: a cancelled waiter leaves the shared future alone)
        await asyncio.wait([asyncio.wrap_future(self._kept.ready)])
        self._take()

    def wait(self) -> None:
        """:meth:`ready` on this thread (blocks)."""
        self._kept.ready.result()
        self._take()

    def _take(self) -> None:
        if self._kept.tensor is None:
            count(ConversationEvent.PREFIX_MISSES)
            raise PrefixNotFound()
        self.tensor, self.digests = self._kept.tensor, self._kept.digests

    def release(self) -> None:
        kept, self._kept = self._kept, None
        if kept is not None:
            store().unpin(kept)


_pool: concurrent.futures.ThreadPoolExecutor | None = None
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


def _copier() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shm-embeds-keep")
    return _pool


def _after_fork_in_child() -> None:
    global _pool, _timer
    _pool = _timer = None


os.register_at_fork(after_in_child=_after_fork_in_child)


class KeepRequest:
    """A keep asked for by one request: an id reserved at once, the copy made on a
    thread while vLLM serves the request; the id goes in the response headers of a
    200 without waiting for the copy (a continuation naming it waits for it, and
    misses if it failed), any other status forgets it."""

    def __init__(self, ttl_s: float, salt: str | None) -> None:
        self.ttl_s, self.salt = ttl_s, salt
        self.future: concurrent.futures.Future | None = None
        self.kid: str | None = None
        self.answered = False

    def start(self, tensor: torch.Tensor) -> None:
        """Reserve an id and copy ``tensor`` (the request's, digests attached) into a
        kept segment. None fits: answered without an id."""
        reserved = store().reserve(tensor, self.salt, self.ttl_s, settings.keep_max_bytes(),
                                   settings.keep_max_entries())
        if reserved is None:
            return
        try:
            self.future = _copier().submit(self._copy, tensor, _digests.attached(tensor),
                                           reserved[1])
        except RuntimeError:  # the pool is shut down (exit): no id
            store().fill(reserved[1], None)
            return
        self.kid = reserved[0]

    @staticmethod
    def _copy(tensor: torch.Tensor, digests: Any, kept: Kept) -> None:
        # Written by pwrite (ENOSPC is an OSError, never a SIGBUS), mapped read-only.
        # Whatever happens, the entry is filled (its waiters wake): by the copy or None.
        done = None
        try:
            if kept.gone:  # evicted or dropped while waiting for this thread
                return
            segment = StreamedSegment(tensor.dtype, tuple(tensor.shape))
            try:  # (a JSON payload's tensor may be a view: its values, in order)
                src = tensor.resolve_neg().resolve_conj().contiguous()
                segment.write(memoryview(src.reshape(-1).view(torch.uint8).numpy()))
                done = segment.finish(writable=False)
            except BaseException:
                segment.abort()
                raise
        except OSError as e:  # budget, ENOSPC, segments: the id misses
            count_reason(ConversationEvent.KEEP_REFUSED, seg.fallback_reason(e))
        finally:
            if store().fill(kept, done, digests) and done is not None:
                count_many({ConversationEvent.KEPT_TENSORS: 1,
                            ConversationEvent.KEPT_BYTES: done.nbytes})

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
        TTL; its copy may still run); any other status forgets the kept tensor."""
        if self.kid is None or self.answered:
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
        if self.future is None:
            return
        self.wait()
        if not self.answered:
            self.answered = True
            store().drop(self.kid, self.salt, "unanswered")
        if (e := self.future.exception()) is not None:
            logger.warning("shm-embeds: keeping a request's prompt_embeds failed: %r", e)


class Hook:
    """The binary extension's ``binary_prefixes`` hook (see the module docstring)."""

    parameter = wire.PREFIX

    def resolve(self, value: Any, body: dict, dtype: torch.dtype, hidden: int) -> Prefix:
        """The kept rows ``value`` names under the body's ``cache_salt``, pinned (their
        bytes after ``Prefix.ready``/``wait``). Raises Refused: 404 ``PrefixNotFound``
        (not held), 400 (another datatype or hidden size than the kept rows')."""
        kept = store().pin(value, salt_of(body))
        if kept is None:
            count(ConversationEvent.PREFIX_MISSES)
            raise PrefixNotFound()
        prefix = Prefix(kept)
        if kept.dtype != dtype or kept.shape[1] != hidden:
            prefix.release()
            raise _bad("prefix_dtype", "a continuation must have the datatype and hidden "
                       "size of the prompt_embeds it continues")
        count_many({ConversationEvent.PREFIX_HITS: 1, ConversationEvent.PREFIX_ROWS: prefix.rows})
        return prefix

    def assemble(self, prefix: Prefix, new: torch.Tensor,
                 block_tokens: int | None) -> torch.Tensor:
        """The kept rows then ``new`` (``(N, H)``, their dtype and H) as one tensor in a
        new read-only segment, on this thread: the kept rows' whole blocks keep their
        digests, the rest is hashed here (``block_tokens`` None: not hashed). Raises
        OSError (no segment: nothing left)."""
        rows = prefix.rows + new.shape[0]
        d = prefix.digests
        reused = (prefix.rows // block_tokens if block_tokens and d is not None
                  and d.block_tokens == block_tokens else 0)

        def write(segment: StreamedSegment) -> Any:
            segment.write(memoryview(prefix.tensor.reshape(-1).view(torch.uint8).numpy()))
            segment.write(memoryview(new.reshape(-1).view(torch.uint8).numpy()))
            if not block_tokens:
                return None
            tail = torch.cat([prefix.tensor[reused * block_tokens:], new])
            found = _digests.hash_tensor_here(tail, block_tokens)
            if not reused:
                return found
            return _digests.BlockDigests(block_tokens, rows, d.digests[
                :reused * _digests.DIGEST_BYTES] + found.digests)

        return _digests.fill_segment(new.dtype, (rows, new.shape[1]), write)

    def keep_request(self, headers: Any, path: str, body: dict,
                     ntensors: int) -> KeepRequest | None:
        """The keep ``headers`` ask for, or None. Raises Refused (400): a bad
        ``Shm-Embeds-Keep``, or not one completions tensor."""
        raw = headers.get(KEEP_HEADER)
        if raw is None:
            return None
        try:
            ttl = float(raw)
        except ValueError:
            ttl = math.nan
        if not math.isfinite(ttl) or ttl <= 0:
            raise _bad("keep", f"{wire.KEEP_HEADER} must be a number of seconds above 0")
        if path != _common.COMPLETIONS or ntensors != 1:
            raise _bad("keep", f"{wire.KEEP_HEADER} needs a /v1/completions request "
                       "with one prompt_embeds tensor")
        return KeepRequest(min(ttl, settings.keep_max_s()), salt_of(body))


HOOK = Hook()
