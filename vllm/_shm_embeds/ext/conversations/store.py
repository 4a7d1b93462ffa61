# SPDX-License-Identifier: Apache-2.0
"""The kept ``prompt_embeds`` of one API server process, by opaque id.

A kept tensor is the first rows of a tip (``tips.Tip``: a memfd of this process,
only appended to, charged to the store's budget row by row, closed when nothing
uses it; gone with the process). Its id is a capability: 256 random bits, looked
up together with the ``cache_salt`` it was kept under, so an id with another salt
(or none) is exactly an unknown id. An entry may be reserved before its rows are
written and filled after (``Kept.ready``). Entries go at their TTL, or least
recently used first when the store is over its entries or bytes; never while
pinned (a request reading its rows). An id starts with its store's tag, which
names the API server to ask for it (``siblings.py``). Knows ids and tips, not files.
May import: the core.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm._shm_embeds.counters import count_reason
from vllm._shm_embeds.ext.conversations.events import ConversationEvent

ID_BYTES = 32
_ID = re.compile(r"[A-Za-z0-9_-]{43}\Z")  # secrets.token_urlsafe(32)'s length
TAG_CHARS = 8  # an id's first characters: the API server that keeps it (``siblings.py``)


def tag_of(kid: str) -> str:
    """The tag of the API server that made ``kid`` (a well-formed id)."""
    return kid[:TAG_CHARS]


def well_formed(kid: Any) -> bool:
    return isinstance(kid, str) and bool(_ID.match(kid))


@dataclasses.dataclass(eq=False)
class Kept:
    """One kept tensor: the first ``shape[0]`` rows of ``tip`` (``tips.Tip``), of
    ``dtype``, ``nbytes`` bytes, and ``digests`` (its prefix-cache block digests,
    ``digests.BlockDigests``, or None) once ``ready`` is done (``tip`` None then:
    the copy failed or the entry went first); ``expires`` (monotonic s); ``chat``: a
    chat turn's rendered prompt (``rendered.Rendered``), None for a completions tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    expires: float
    tip: Any = None
    digests: Any = None
    ready: concurrent.futures.Future = dataclasses.field(
        default_factory=concurrent.futures.Future)
    pins: int = 0
    chat: Any = None
    gone: str = ""  # left the store: let go "now", or "at_unpin" (the last one)

    def __post_init__(self) -> None:
        self.ready.set_running_or_notify_cancel()  # no waiter can cancel it for the others


def _key(kid: str, salt: str | None) -> bytes:
    """The store's key of ``kid`` under ``salt`` (the id alone never finds it)."""
    h = hashlib.sha256(b"shm-embeds-kept\0")
    h.update(kid.encode())
    h.update(b"\0\1" + salt.encode("utf-8", "surrogatepass") if salt is not None else b"\0\0")
    return h.digest()


class Store:
    """Kept tensors by key, over tips (files of rows, ``tips.Tip``) that the store
    counts: a tip is charged for every row claimed in it and closed
    (``close(tip)``) when no entry, pin or request uses it any more."""

    def __init__(self, close: Callable[[Any], Any],
                 clock: Callable[[], float] = time.monotonic, tag: str | None = None) -> None:
        """``tag``: the first :data:`TAG_CHARS` characters of every id (None: random ids)."""
        self._close, self._clock = close, clock
        self.tag = tag
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[bytes, Kept] = collections.OrderedDict()
        self._tips: set = set()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes charged to the tips in use."""
        return self._bytes

    def claim(self, tip: Any, start: int, rows: int, max_bytes: int) -> str | None:
        """Claim rows ``start`` up to ``rows`` of ``tip`` for the caller, who holds
        one use of it until :meth:`let_go`: None if claimed; ``"taken"`` if
        another request claimed past ``start`` first (branch: a new tip), or
        ``"full"`` if the bytes cannot fit even with every unused entry gone
        (then nothing is evicted). Expired, then least recently used, entries go."""
        with self._lock:
            nbytes = max(0, rows * tip.row_bytes - tip.charged)  # beyond its high-water mark
            if tip.rows != start:
                return "taken"
            victims = [(k, "ttl") for k in self._expired()]
            fits = self._bytes - self._freeable() + nbytes <= max_bytes
            if fits:
                victims += self._room(nbytes, max_bytes, None)
                tip.rows, tip.charged = rows, tip.charged + nbytes
                self._bytes += nbytes
                tip.refs += 1
                self._tips.add(tip)
        self._let_go(victims)
        if not fits:
            count_reason(ConversationEvent.KEEP_REFUSED, "full")
            return "full"
        return None

    def unclaim(self, tip: Any, start: int, rows: int) -> None:
        """Give back the rows a :meth:`claim` took that no one has read (its body was
        cut short): the next continuation of ``start`` rows grows the tip in place
        again. Bytes the file holds stay charged (it keeps its size; claims charge
        only past it)."""
        self.trim(tip, rows, start)

    def trim(self, tip: Any, rows: int, to: int) -> bool:
        """Cut a claim up to ``rows`` to end at ``to`` (:meth:`unclaim`, or a claim
        made before its size was known: a sibling's chat turn): the rows after are
        given back, and their charge down to the file's size. False if ``tip`` is
        not claimed to ``rows``."""
        with self._lock:
            if tip.rows != rows or not 0 <= to <= rows or tip not in self._tips:
                return False
            tip.rows = to
            keep = max(to * tip.row_bytes, tip.file_bytes())
            if keep < tip.charged:
                self._bytes -= tip.charged - keep
                tip.charged = keep
        return True

    def let_go(self, tip: Any) -> None:
        """A use of ``tip`` (a claim, :meth:`use`) ended."""
        with self._lock:
            close = self._unref(tip)
        if close:
            self._close(tip)

    def reserve(self, shape: tuple[int, ...], dtype: torch.dtype, salt: str | None,
                ttl_s: float, max_entries: int, chat: Any = None) -> tuple[str, Kept] | None:
        """An id for a tensor of ``shape`` and ``dtype`` to be kept ``ttl_s`` seconds,
        filled by :meth:`fill`; the least recently used unpinned entry goes if the
        store holds ``max_entries`` (an id costs no bytes: rows are charged by
        :meth:`claim`); None if every entry is pinned."""
        kid = (secrets.token_urlsafe(ID_BYTES) if self.tag is None else  # 210 random bits
               self.tag + secrets.token_urlsafe(ID_BYTES)[:43 - TAG_CHARS])
        kept = Kept(tuple(shape), dtype, math.prod(shape) * dtype.itemsize,
                    self._clock() + ttl_s, chat=chat)
        with self._lock:
            victims = self._room(0, None, max_entries)
            fits = len(self._entries) < max_entries
            if fits:
                self._entries[_key(kid, salt)] = kept
        self._let_go(victims)
        if not fits:  # every entry pinned
            count_reason(ConversationEvent.KEEP_REFUSED, "full")
            return None
        return kid, kept

    def fill(self, kept: Kept, tip: Any, digests: Any = None) -> bool:
        """A reserved entry is ready: its rows are the first ``kept.shape[0]`` of
        ``tip``, which the entry now uses too (None: the copy failed, the entry
        goes). False if the entry went meanwhile. Wakes those waiting on ``kept.ready``."""
        with self._lock:
            kept_now = not kept.gone and tip is not None
            if kept_now:
                kept.tip, kept.digests = tip, digests
                tip.refs += 1
            elif not kept.gone:
                key = next(k for k, v in self._entries.items() if v is kept)
                self._pop(key)
        kept.ready.set_result(None)
        return kept_now

    def put(self, tip: Any, rows: int, digests: Any, salt: str | None, ttl_s: float,
            max_entries: int, chat: Any = None) -> str | None:
        """:meth:`reserve` then :meth:`fill` with the first ``rows`` of ``tip``."""
        reserved = self.reserve((rows, tip.hidden), tip.dtype, salt, ttl_s, max_entries, chat)
        return reserved[0] if reserved and self.fill(reserved[1], tip, digests) else None

    def pin(self, kid: Any, salt: str | None, chat: bool = False) -> Kept | None:
        """The live entry ``kid`` names under ``salt``, pinned (not evicted until
        :meth:`unpin`), and now the most recently used; else None, the same way
        for a malformed id, an unknown one, another salt, an expired entry, or one
        of the other kind (a chat turn's for ``chat`` False, a completions one's
        for True)."""
        if not well_formed(kid):
            return None
        key = _key(kid, salt)
        with self._lock:
            kept = self._entries.get(key)
            if kept is not None and (kept.expires <= self._clock()
                                     or (kept.chat is not None) != chat):
                kept = None
            if kept is not None:
                kept.pins += 1
                self._entries.move_to_end(key)
        return kept

    def unpin(self, kept: Kept) -> None:
        """Done reading ``kept``; lets it go if it left the store meanwhile."""
        with self._lock:
            kept.pins -= 1
            close = (kept.pins == 0 and kept.gone == "at_unpin" and kept.tip is not None
                     and self._unref(kept.tip))
        if close:
            self._close(kept.tip)

    def drop(self, kid: str, salt: str | None, reason: str) -> None:
        """Forget ``kid`` (e.g. its request failed after it was kept)."""
        with self._lock:
            key = _key(kid, salt)
            victims = [(self._pop(key), reason)] if key in self._entries else []
        self._let_go(victims)

    def next_expiry(self) -> float | None:
        """When the next entry expires (the clock's seconds), None if none is kept."""
        with self._lock:
            return min((k.expires for k in self._entries.values()), default=None)

    def sweep(self) -> int:
        """Let expired entries go; how many went."""
        with self._lock:
            victims = [(k, "ttl") for k in self._expired()]
        self._let_go(victims)
        return len(victims)

    def clear(self) -> None:
        """Let every entry go (shutdown)."""
        with self._lock:
            victims = [(self._pop(key), "shutdown") for key in list(self._entries)]
        self._let_go(victims)

    # -- lock held

    def _pop(self, key: bytes) -> Kept:
        kept = self._entries.pop(key)
        if kept.pins:  # decided under the lock
            kept.gone = "at_unpin"
        else:
            kept.gone = "closed" if kept.tip is not None and self._unref(kept.tip) else "now"
        return kept

    def _unref(self, tip: Any) -> bool:
        """Drop one use of ``tip``; True if it is the last (uncharged here, closed
        by the caller without the lock)."""
        tip.refs -= 1
        if tip.refs or tip not in self._tips:
            return False
        self._tips.discard(tip)
        self._bytes -= tip.charged
        return True

    def _freeable(self) -> int:
        """Bytes freed if every unpinned entry went (tips used by nothing else; the
        same test as :meth:`_room`'s)."""
        unpinned: dict = collections.Counter(
            k.tip for k in self._entries.values() if k.tip is not None and not k.pins)
        return sum(t.charged for t, n in unpinned.items() if t.refs == n)

    def _room(self, nbytes: int, max_bytes: int | None,
              max_entries: int | None) -> list[tuple[Kept, str]]:
        """Expired entries, then unpinned ones least recently used first until
        ``nbytes`` more fit: for bytes only those whose tip nothing else uses (an
        entry of a tip a request or pin still uses would free nothing)."""
        victims = [(k, "ttl") for k in self._expired()]

        def over_bytes() -> bool:
            return max_bytes is not None and self._bytes + nbytes > max_bytes

        def over_entries() -> bool:
            return max_entries is not None and len(self._entries) >= max_entries

        unpinned: dict = collections.Counter(
            k.tip for k in self._entries.values() if k.tip is not None and not k.pins)
        for key, k in list(self._entries.items()):
            if not (over_bytes() or over_entries()):
                break
            frees = k.tip is not None and k.tip.refs == unpinned[k.tip]
            if k.pins == 0 and (over_entries() or frees):
                if k.tip is not None:
                    unpinned[k.tip] -= 1
                victims.append((self._pop(key), "lru"))
        return victims

    def _expired(self) -> list[Kept]:
        now = self._clock()
        return [self._pop(key) for key, k in list(self._entries.items()) if k.expires <= now]

    # -- lock not held

    def _let_go(self, victims: list[tuple[Kept, str]]) -> None:
        for kept, reason in victims:
            count_reason(ConversationEvent.KEPT_DROPPED, reason)
            if kept.gone == "closed":  # its tip's last use (pinned: at the last unpin)
                self._close(kept.tip)


_store: Store | None = None
_store_lock = threading.Lock()


def current(close: Callable[[Any], Any], tag: Callable[[], str] | None = None) -> Store:
    """This process's store (a forked child starts an empty one); ``tag``, called
    once when it is made, gives its ids' tag."""
    global _store
    with _store_lock:
        if _store is None:
            _store = Store(close, tag=tag() if tag is not None else None)
        return _store


def _after_fork_in_child() -> None:
    global _store, _store_lock
    _store, _store_lock = None, threading.Lock()  # the parent's tips are the parent's


os.register_at_fork(after_in_child=_after_fork_in_child)
