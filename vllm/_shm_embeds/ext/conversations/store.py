# SPDX-License-Identifier: Apache-2.0
"""The kept ``prompt_embeds`` of one API server process, by opaque id.

A kept tensor is a segment of this process (``lifetime.streamed``: in the
server's private directory, counted in the segment budget, unlinked at exit and
swept if the process dies). Its id is a capability: 256 random bits, looked up
together with the ``cache_salt`` it was kept under, so an id with another salt
(or none) is exactly an unknown id. An entry is reserved (id, size, room) before
its copy is made and filled when the copy is done (``Kept.ready``). Entries go at
their TTL, or least recently used first when the store is over its entries or
bytes; never while pinned (a request copying its rows). Knows tensors and ids.
May import: the core.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
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
_ID = re.compile(r"[A-Za-z0-9_-]{43}\Z")  # secrets.token_urlsafe(32)


@dataclasses.dataclass(eq=False)
class Kept:
    """One kept tensor of ``shape`` ``(rows, hidden)`` and ``dtype``, ``nbytes``
    bytes: ``tensor`` and ``digests`` (its prefix-cache block digests,
    ``digests.BlockDigests``, or None) once ``ready`` is done (``tensor`` None
    then: the copy failed or the entry went first); ``expires`` (monotonic s)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    expires: float
    tensor: torch.Tensor | None = None
    digests: Any = None
    ready: concurrent.futures.Future = dataclasses.field(
        default_factory=concurrent.futures.Future)
    pins: int = 0
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
    """Kept tensors by key; ``release(tensor)`` lets one go (unlinks its segment)."""

    def __init__(self, release: Callable[[torch.Tensor], Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._release, self._clock = release, clock
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[bytes, Kept] = collections.OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of the kept tensors in the store."""
        return self._bytes

    def reserve(self, like: torch.Tensor, salt: str | None, ttl_s: float,
                max_bytes: int, max_entries: int) -> tuple[str, Kept] | None:
        """An id for a tensor like ``like`` (shape, dtype, bytes) to be kept ``ttl_s``
        seconds, its entry counted from now and filled by :meth:`fill`; None if it
        cannot fit even with every unpinned entry gone (expired ones go first, then
        the least recently used)."""
        kid = secrets.token_urlsafe(ID_BYTES)
        kept = Kept(tuple(like.shape), like.dtype, like.nbytes, self._clock() + ttl_s)
        with self._lock:
            # Nothing is evicted for an entry that would not fit with all unpinned ones gone.
            victims = [(k, "ttl") for k in self._expired()]
            pinned = sum(k.nbytes for k in self._entries.values() if k.pins)
            if pinned + kept.nbytes <= max_bytes:
                victims += self._room(kept.nbytes, max_bytes, max_entries)
            fits = self._bytes + kept.nbytes <= max_bytes and len(self._entries) < max_entries
            if fits:
                self._entries[_key(kid, salt)] = kept
                self._bytes += kept.nbytes
        self._let_go(victims)
        if not fits:
            count_reason(ConversationEvent.KEEP_REFUSED, "full")
            return None
        return kid, kept

    def fill(self, kept: Kept, tensor: torch.Tensor | None, digests: Any = None) -> bool:
        """The copy of a reserved entry is done: ``tensor`` (the store owns it from
        here; None: the copy failed, the entry goes). False (``tensor`` let go) if
        the entry went meanwhile. Wakes those waiting on ``kept.ready``."""
        with self._lock:
            kept_now = not kept.gone and tensor is not None
            if kept_now:
                kept.tensor, kept.digests = tensor, digests
            elif not kept.gone:
                key = next(k for k, v in self._entries.items() if v is kept)
                self._pop(key)
        if tensor is not None and not kept_now:
            self._release(tensor)
        kept.ready.set_result(None)
        return kept_now

    def put(self, tensor: torch.Tensor, digests: Any, salt: str | None, ttl_s: float,
            max_bytes: int, max_entries: int) -> str | None:
        """:meth:`reserve` then :meth:`fill` with ``tensor``, let go if no room."""
        reserved = self.reserve(tensor, salt, ttl_s, max_bytes, max_entries)
        if reserved is None:
            self._release(tensor)
            return None
        return reserved[0] if self.fill(reserved[1], tensor, digests) else None

    def make_room(self, nbytes: int, max_bytes: int, max_entries: int) -> None:
        """Let expired, then least recently used unpinned entries go until ``nbytes``
        more would fit (before a new kept tensor is made: the segment budget too)."""
        with self._lock:
            victims = self._room(nbytes, max_bytes, max_entries)
        self._let_go(victims)

    def pin(self, kid: Any, salt: str | None) -> Kept | None:
        """The live entry ``kid`` names under ``salt``, pinned (not evicted until
        :meth:`unpin`), and now the most recently used; else None, the same way
        for a malformed id, an unknown one, another salt or an expired entry."""
        if not isinstance(kid, str) or not _ID.match(kid):
            return None
        key = _key(kid, salt)
        with self._lock:
            kept = self._entries.get(key)
            if kept is not None and kept.expires <= self._clock():
                kept = None
            if kept is not None:
                kept.pins += 1
                self._entries.move_to_end(key)
        return kept

    def unpin(self, kept: Kept) -> None:
        """Done reading ``kept``; lets it go if it left the store meanwhile."""
        with self._lock:
            kept.pins -= 1
            last = kept.pins == 0 and kept.gone == "at_unpin"
        if last and kept.tensor is not None:
            self._release(kept.tensor)

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
        self._bytes -= kept.nbytes
        kept.gone = "now" if kept.pins == 0 else "at_unpin"  # decided under the lock
        return kept

    def _room(self, nbytes: int, max_bytes: int, max_entries: int) -> list[tuple[Kept, str]]:
        victims = [(k, "ttl") for k in self._expired()]
        for key, k in list(self._entries.items()):  # least recently used first
            if self._bytes + nbytes <= max_bytes and len(self._entries) < max_entries:
                break
            if k.pins == 0:
                victims.append((self._pop(key), "lru"))
        return victims

    def _expired(self) -> list[Kept]:
        now = self._clock()
        return [self._pop(key) for key, k in list(self._entries.items()) if k.expires <= now]

    # -- lock not held

    def _let_go(self, victims: list[tuple[Kept, str]]) -> None:
        for kept, reason in victims:
            count_reason(ConversationEvent.KEPT_DROPPED, reason)
            if kept.gone == "now" and kept.tensor is not None:  # (pinned: at the last unpin;
                self._release(kept.tensor)                     # not filled: by fill)


_store: Store | None = None


def current(release: Callable[[torch.Tensor], Any]) -> Store:
    """This process's store (a forked child starts an empty one)."""
    global _store
    if _store is None:
        _store = Store(release)
    return _store


def _after_fork_in_child() -> None:
    global _store
    _store = None  # the parent's segments are the parent's


os.register_at_fork(after_in_child=_after_fork_in_child)
