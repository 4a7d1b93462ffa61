# SPDX-License-Identifier: Apache-2.0
"""Conversations on binary bodies: the ``binary_prefixes`` hook (:data:`HOOK`).

A request with ``Shm-Embeds-Keep: <seconds>`` has its ``prompt_embeds`` kept: written
into a tip (``tips.py``) as its body arrives, or copied into one while vLLM serves it
(``keeps.KeepRequest``); a 200 answer carries ``Shm-Embeds-Kept: <id>``. A later
request names the id and sends only the rows after those kept: they are written
after the kept rows in the same tip (:meth:`Hook.open_sink`; a second branch or no
room: a copy), the kept rows' block digests reused, and hop 1 sends the tip by
descriptor. An id the store does not hold under the request's ``cache_salt`` is a
404 ``PrefixNotFound``, never the new rows alone. Wire: ``shm_embeds_client.wire``.
May import: the core; ``binary`` (gate, common) and ``digests`` via ``extensions.require``.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch
from shm_embeds_client import wire
from vllm.logger import init_logger

from vllm._shm_embeds import extensions
from vllm._shm_embeds.counters import Event, count, count_many
from vllm._shm_embeds.ext.conversations import remote, settings, tips
from vllm._shm_embeds.ext.conversations.events import ConversationEvent
from vllm._shm_embeds.ext.conversations.keeps import KeepRequest
from vllm._shm_embeds.ext.conversations.local import (block_digests, holder, let_go, max_bytes,
                                                      new_tip, store, unclaim)
from vllm._shm_embeds.ext.conversations.store import Kept, tag_of, well_formed
from vllm._shm_embeds.handle import ShmEmbedsError

logger = init_logger(__name__)

_gate = extensions.require("binary", "gate")
_common = extensions.require("binary", "common")
_digests = extensions.require("digests", "digests")

MISS = ("the prompt_embeds prefix this request names is not held by this server (unknown, "
        "expired or evicted, kept under another cache_salt, or by another server process); "
        "send the whole tensor")
KEEP_HEADER = wire.KEEP_HEADER.lower()


class PrefixNotFound(_gate.Refused):
    """404 ``PrefixNotFound``: the same answer for every reference not held."""

    def __init__(self) -> None:
        super().__init__(404, "prefix_not_found", MISS)

    @property
    def err_type(self) -> str:
        return wire.PREFIX_NOT_FOUND


def _bad(reason: str, message: str) -> Exception:
    return _gate.Refused(400, reason, message)


def salt_of(body: dict) -> str | None:
    """The request's ``cache_salt`` (None: none). Raises Refused (400) if not a string."""
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _bad("cache_salt", "cache_salt must be a string")
    return salt


def keep_ttl(raw: str) -> float:
    """Seconds a ``Shm-Embeds-Keep`` value asks for, cut to ``KEEP_MAX_S``. Raises
    Refused (400): not a number of seconds above 0."""
    try:
        ttl = float(raw)
    except ValueError:
        ttl = math.nan
    if not math.isfinite(ttl) or ttl <= 0:
        raise _bad("keep", f"{wire.KEEP_HEADER} must be a number of seconds above 0")
    return min(ttl, settings.keep_max_s())


class Prefix:
    """Kept rows a continuation starts with, pinned until :meth:`release`: ``rows``,
    ``row_bytes``; ``tip``, ``digests`` and ``tensor`` (the rows, mapped read-only)
    once :meth:`ready` (or :meth:`wait`)."""

    def __init__(self, kept: Kept) -> None:
        self._kept = kept
        self.chat = kept.chat  # a chat turn's ``rendered.Rendered``, else None
        self.rows = kept.shape[0]
        self.row_bytes = kept.nbytes // max(1, self.rows)
        self.tip: tips.Tip | None = None
        self.digests: Any = None
        self._tensor: torch.Tensor | None = None

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
        if self._kept.tip is None:
            count(ConversationEvent.PREFIX_MISSES)
            raise PrefixNotFound()
        self.tip, self.digests = self._kept.tip, self._kept.digests

    @property
    def tensor(self) -> torch.Tensor:
        """The kept rows ``(rows, hidden)``, read-only (mapped on first use). Raises OSError."""
        if self._tensor is None:
            self._tensor = self.tip.view(self.rows)[0]
        return self._tensor

    def release(self) -> None:
        kept, self._kept = self._kept, None
        self._tensor = None
        if kept is not None:
            store().unpin(kept)


class SiblingPrefix(Prefix):
    """Kept rows a sibling API server holds (``remote.pin``), pinned there until
    :meth:`release`; ready at once."""

    def __init__(self, lease: remote.Remote, rows: int, digests: Any,
                 chat: Any = None) -> None:
        self._lease = lease
        self.chat = chat
        self.rows, self.tip = rows, lease.tip
        self.row_bytes = lease.tip.row_bytes
        self.digests = digests
        self._tensor = None

    async def ready(self) -> None:
        return None

    def wait(self) -> None:
        return None

    def release(self) -> None:
        lease, self._lease = self._lease, None
        self._tensor = None
        if lease is not None:
            lease.let_go()


class TipSink:
    """A continuation's or a kept request's whole tensor written into ``tip`` from
    row ``start`` (the rows before are the kept ones: ``has_prefix``); the sink
    interface of the binary format (``streamed.StreamedSegment``'s). Holds a use of
    ``tip`` (claimed by the caller) until :meth:`abort` or the request's end."""

    def __init__(self, tip: tips.Tip, start: int, rows: int) -> None:
        self.tip, self.rows, self.start = tip, rows, start
        self.nbytes = rows * tip.row_bytes
        self.filled = start * tip.row_bytes
        self.has_prefix = start > 0
        self._done = False
        try:
            tip.ensure(rows)
        except BaseException:
            self.abort()
            raise

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data``. Raises ShmEmbedsError (finished), ValueError (too many
        bytes), OSError."""
        if self._done:
            raise ShmEmbedsError("the kept tensor is already finished or aborted")
        if self.filled + len(data) > self.nbytes:
            raise ValueError("more bytes than the tensor holds")
        self.tip.write(memoryview(data), self.filled)
        self.filled += len(data)  # counted once at the end: a count per chunk cost ~8 ms/32 MiB

    def _count_copied(self) -> None:
        count(Event.COPIED_BYTES, self.filled - self.start * self.tip.row_bytes)

    def read_back(self, out: memoryview) -> None:
        """The bytes written so far (the kept rows' included) into ``out``."""
        self.tip.read(out[:self.filled])

    def finish(self, writable: bool = False) -> torch.Tensor:
        """The request's read-only tensor (always: the rows are kept). Raises
        ShmEmbedsError if not every byte was written (the use ends), OSError."""
        if self._done or self.filled != self.nbytes:
            self.abort()
            raise ShmEmbedsError(f"the kept tensor holds {self.filled} of {self.nbytes} bytes")
        try:
            tensor = holder().register(self.tip, self.rows)
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._count_copied()
        return tensor

    def abort(self) -> None:
        """End the use of the tip before its tensor was made (idempotent): the rows
        it claimed are given back (no one has read them)."""
        if not self._done:
            self._done = True
            self._count_copied()
            unclaim(self.tip, self.start, self.rows)
            let_go(self.tip)


class Hook:
    """The binary extension's ``binary_prefixes`` hook (see the module docstring)."""

    parameter = wire.PREFIX

    def resolve(self, value: Any, body: dict, dtype: torch.dtype, hidden: int) -> Prefix:
        """The kept rows ``value`` names under the body's ``cache_salt``, pinned (their
        bytes after ``Prefix.ready``/``wait``). Raises Refused: 404 ``PrefixNotFound``
        (not held), 400 (another datatype or hidden size than the kept rows')."""
        salt = salt_of(body)
        kept = store().pin(value, salt)
        if kept is None and self.is_remote(value):
            return self._resolve_sibling(value, salt, dtype, hidden)
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

    def round_trips(self) -> Any:
        """The executor a caller runs a remote :meth:`resolve` on (``remote.round_trips``)."""
        return remote.round_trips()

    def is_remote(self, value: Any) -> bool:
        """``value`` names an id another API server of this ``vllm serve`` made:
        resolving it is a round trip (callers keep it off the event loop)."""
        return (_common.api_servers() > 1 and well_formed(value)
                and tag_of(value) != store().tag)

    def pin_sibling(self, value: str, salt: str | None, chat: bool = False) -> SiblingPrefix:
        """The kept rows (a chat turn's for ``chat``) a sibling API server holds under
        ``salt``, pinned there (a round trip: off the event loop). Raises
        PrefixNotFound (counted)."""
        pinned = remote.pin(value, salt, tag_of, chat)
        if pinned is None:
            count(ConversationEvent.PREFIX_MISSES)
            raise PrefixNotFound()
        d = pinned.digests
        return SiblingPrefix(pinned.remote, pinned.rows, block_digests(*d) if d else None,
                             pinned.chat)

    def _resolve_sibling(self, value: str, salt: str | None, dtype: torch.dtype,
                         hidden: int) -> SiblingPrefix:
        prefix = self.pin_sibling(value, salt)
        if prefix.tip.dtype != dtype or prefix.tip.hidden != hidden:
            prefix.release()
            raise _bad("prefix_dtype", "a continuation must have the datatype and hidden "
                       "size of the prompt_embeds it continues")
        count_many({ConversationEvent.PREFIX_HITS: 1, ConversationEvent.SIBLING_HITS: 1,
                    ConversationEvent.PREFIX_ROWS: prefix.rows})
        return prefix

    def open_sink(self, prefix: Prefix | None, dtype: torch.dtype, shape: tuple[int, ...],
                  keeping: bool) -> TipSink | None:
        """Where the binary format writes a tensor of ``shape`` (the whole one): after
        ``prefix``'s rows in their tip if no other request grew it first (nothing
        copied; ``has_prefix``), else a new tip (kept rows then copied by the caller),
        or None (not a continuation nor kept, or no room: a segment)."""
        rows, hidden = shape
        if (prefix is None and not keeping) or rows == 0:
            return None
        if prefix is not None and prefix.tip is not None and prefix.tip.dtype == dtype:
            lease = prefix.tip.remote  # a sibling's tip: claimed there
            if lease is None:
                got = store().claim(prefix.tip, prefix.rows, rows, max_bytes())
            else:
                got = lease.claim(rows)
                got = None if got == "ok" else got
            if got == "full":
                return None
            if got is None:
                count(ConversationEvent.TIP_GROWN)
                return TipSink(prefix.tip, prefix.rows, rows)
        tip = new_tip(dtype, rows, hidden)
        if tip is None:
            return None
        if prefix is not None:
            count(ConversationEvent.KEPT_COPIED_BYTES, prefix.rows * prefix.row_bytes)
        return TipSink(tip, 0, rows)

    def assemble(self, prefix: Prefix, new: torch.Tensor,
                 block_tokens: int | None) -> torch.Tensor:
        """The kept rows then ``new`` (``(N, H)``, their dtype and H) as one read-only
        tensor, on this thread: written after the kept rows in their tip when it can
        grow in place, else in a new tip or segment (one copy of the kept rows); the
        kept rows' whole blocks keep their digests, the rest is hashed here
        (``block_tokens`` None: not hashed). Raises OSError (nothing left)."""
        rows = prefix.rows + new.shape[0]
        d = prefix.digests
        reused = (prefix.rows // block_tokens if block_tokens and d is not None
                  and d.block_tokens == block_tokens else 0)

        def digests_of() -> Any:
            if not block_tokens:
                return None
            tail = torch.cat([prefix.tensor[reused * block_tokens:], new])
            found = _digests.hash_tensor_here(tail, block_tokens)
            if not reused:
                return found
            return _digests.BlockDigests(block_tokens, rows, d.digests[
                :reused * _digests.DIGEST_BYTES] + found.digests)

        def write(sink: Any) -> Any:
            if not getattr(sink, "has_prefix", False):
                sink.write(memoryview(prefix.tensor.reshape(-1).view(torch.uint8).numpy()))
            sink.write(memoryview(new.reshape(-1).view(torch.uint8).numpy()))
            return digests_of()

        sink = self.open_sink(prefix, new.dtype, (rows, new.shape[1]), keeping=False)
        if sink is None:
            count(ConversationEvent.KEPT_COPIED_BYTES, prefix.rows * prefix.row_bytes)
            return _digests.fill_segment(new.dtype, (rows, new.shape[1]), write)
        try:
            found = write(sink)
            out = sink.finish()
        except BaseException:
            sink.abort()
            raise
        _digests.attach(out, found)
        return out

    def keep_request(self, headers: Any, path: str, body: dict,
                     ntensors: int) -> KeepRequest | None:
        """The keep ``headers`` ask for, or None. Raises Refused (400): a bad
        ``Shm-Embeds-Keep``, or not one completions tensor."""
        raw = headers.get(KEEP_HEADER)
        if raw is None or path == _common.CHAT:
            return None  # (a chat turn's keep: chat.py)
        ttl = keep_ttl(raw)
        if path != _common.COMPLETIONS or ntensors != 1:
            raise _bad("keep", f"{wire.KEEP_HEADER} needs a /v1/completions request "
                       "with one prompt_embeds tensor")
        return KeepRequest(ttl, salt_of(body))


HOOK = Hook()
