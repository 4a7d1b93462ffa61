# SPDX-License-Identifier: Apache-2.0
"""Kept ids served to sibling API servers (``--api-server-count`` > 1, or DP).

Each API server keeps its own conversations; its ids start with its *tag* (8
random characters, ``store.TAG_CHARS``), and it answers for them on the abstract
``AF_UNIX`` ``SOCK_SEQPACKET`` socket named by that tag (:func:`listen`; no file,
gone with the process), only to a sibling (same uid and parent, as the regions
socket checks it, ``files/sockets.py``); any other peer is closed unread. One
connection is one continuation's lease (``remote.py`` asks): ``pin`` (the memfd by
``SCM_RIGHTS``, rows, dtype, digests, a chat turn's ``rendered.Rendered``), ``claim``
(rows after them, written in place), ``trim`` (a claim cut to its size), ``unclaim``,
``commit`` (the grown rows kept under a new id of this server). Whatever the
connection held ends with it (a sibling's crash too). Messages: :func:`send` /
:func:`recv` (one JSON object, then its blob in parts). Knows sockets and the
store (``store.py``), not vLLM and not HTTP.
"""

from __future__ import annotations

import array
import errno
import json
import math
import os
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch
from vllm.logger import init_logger

from vllm._shm_embeds.counters import count
from vllm._shm_embeds.ext.conversations.events import ConversationEvent
from vllm._shm_embeds.ext.conversations.rendered import Rendered, pack, unpack
from vllm._shm_embeds.files.sockets import (ANC_BYTES, close_unasked, is_sibling, peer_cred,
                                            received_fds)

logger = init_logger(__name__)

MAX_MESSAGE = 16 << 10  # bytes of one JSON message
PART = 32 << 10  # bytes of one message of a blob (well under SO_SNDBUF)
MAX_BLOB = 64 << 20  # bytes of digests one message may carry (2M blocks)
MAX_CONNECTIONS = 1024  # sibling continuations in flight at once; beyond, a miss
READY_WAIT_S = 30.0  # a pin waits this long for a keep still copying (the asker longer)
SWEEP_EVERY_S = 1.0  # the accept thread lets expired entries go (ids a sibling made)
TAG_TRIES = 8  # tags tried past squatters of the abstract name
DTYPES = {n: getattr(torch, n) for n in ("float16", "bfloat16", "float32", "float64")}


def address(tag: str) -> str:
    """The abstract socket name of the API server whose ids start with ``tag``."""
    return f"\0vllm-shm-embeds-kept.{os.getuid()}.{tag}"


def send(sock: socket.socket, msg: dict, blob: bytes = b"", fds: tuple[int, ...] = (),
         flags: int = 0) -> None:
    """One message: ``msg`` as JSON (with ``fds``), then ``blob`` in parts. Raises OSError."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sock.sendmsg([json.dumps({**msg, "blob": len(blob)}).encode()], anc,
                 socket.MSG_NOSIGNAL | flags)
    view = memoryview(blob)
    for i in range(0, len(view), PART):
        sock.sendmsg([view[i:i + PART]], [], socket.MSG_NOSIGNAL)


def recv(sock: socket.socket, max_blob: int = MAX_BLOB) -> tuple[dict, bytes, list[int]]:
    """One message: ``(msg, blob, fds)`` (the caller owns ``fds``). Raises EOFError
    (closed), ValueError (malformed: its fds closed), OSError (timeout included)."""
    data, anc, flags, _ = sock.recvmsg(MAX_MESSAGE, ANC_BYTES, socket.MSG_CMSG_CLOEXEC)
    fds = received_fds(anc)
    try:
        if not data and not fds:
            raise EOFError("closed")
        try:
            msg = json.loads(data) if not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) else None
        except RecursionError:  # (nested too deep: malformed, as any other)
            msg = None
        n = msg.get("blob") if isinstance(msg, dict) else None
        if type(n) is not int or not 0 <= n <= max_blob:
            raise ValueError("malformed message")
        blob = bytearray()
        while len(blob) < n:
            part = sock.recv(min(PART, n - len(blob)))
            if not part:
                raise EOFError("closed")
            blob += part
    except BaseException:
        close_unasked(fds)
        raise
    return msg, bytes(blob), fds


class Owner:
    """This API server's side: the listener and one thread per sibling connection.

    Args:
        store: ``() -> store.Store`` (this process's).
        max_bytes, max_entries: ``() -> int``, this server's share of the budget.
        max_s: ``() -> float``, the longest keep.
        block_digests: ``(block_tokens, rows, digests) -> digests.BlockDigests``,
            or None when they do not fit the rows.
    """

    def __init__(self, store: Callable[[], Any], max_bytes: Callable[[], int],
                 max_entries: Callable[[], int], max_s: Callable[[], float],
                 block_digests: Callable[[int, int, bytes], Any]) -> None:
        self._store = store
        self._limits = (max_bytes, max_entries, max_s, block_digests)
        self._sock: socket.socket | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.tag = secrets.token_urlsafe(6)

    def listen(self) -> str:
        """Bind this server's abstract name (another tag past a squatter) and start
        accepting; returns the tag its ids must start with. Never raises: without a
        socket, ids still work here (siblings then miss)."""
        for _ in range(TAG_TRIES):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                sock.bind(address(self.tag))
                sock.listen(64)
            except OSError as e:
                sock.close()
                if e.errno != errno.EADDRINUSE:
                    logger.warning("shm-embeds: kept ids are not served to sibling API "
                                   "servers: %s", e)
                    return self.tag
                self.tag = secrets.token_urlsafe(6)
                continue
            self._sock = sock
            threading.Thread(target=self._accept, args=(sock,), daemon=True,
                             name="shm-embeds-kept-siblings").start()
            return self.tag
        logger.warning("shm-embeds: kept ids are not served to sibling API servers (every "
                       "name tried is taken)")
        return self.tag

    def _accept(self, listener: socket.socket) -> None:
        listener.settimeout(SWEEP_EVERY_S)
        while True:
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                self._sweep()
                continue
            except OSError as e:
                if listener.fileno() < 0:
                    return  # closed
                logger.warning("shm-embeds: accepting a sibling API server failed: %s", e)
                threading.Event().wait(0.1)
                continue
            try:
                served = is_sibling(*peer_cred(sock)) and self._slots.acquire(blocking=False)
            except OSError:
                served = False
            if not served:  # nothing it sent is read; a sibling beyond the cap misses
                sock.close()
                continue
            try:
                sock.settimeout(None)
                threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                 name="shm-embeds-kept-sibling").start()
            except RuntimeError:  # no thread: the sibling misses
                sock.close()
                self._slots.release()

    def _sweep(self) -> None:
        """Entries a sibling's commit made have no timer on this event loop."""
        try:
            store = self._store()
            if len(store):
                store.sweep()
        except Exception:
            logger.exception("shm-embeds: sweeping kept ids failed")

    def _serve(self, sock: socket.socket) -> None:
        """One sibling connection: its messages until it closes; then every pin and
        use it held ends. No exception leaves this thread."""
        lease = _Lease(self._store(), *self._limits)
        try:
            while True:
                msg, blob, fds = recv(sock)
                close_unasked(fds)  # a sibling sends none
                reply = lease.handle(msg, blob)
                if reply is not None:
                    send(sock, *reply)
        except (EOFError, ValueError, OSError, TypeError, KeyError):
            pass
        except Exception:
            logger.exception("shm-embeds: serving a sibling API server failed")
        finally:
            lease.end()
            sock.close()
            self._slots.release()


class _Lease:
    """What one sibling connection holds in the store: one pinned entry (unpinned once
    rows after it are claimed: the claim holds the tip), and the claims, each one
    use of the tip until the connection ends; a claim is given back (``unclaim``) or
    kept (``commit``) once, never both."""

    def __init__(self, store: Any, max_bytes: Callable[[], int],
                 max_entries: Callable[[], int], max_s: Callable[[], float],
                 block_digests: Callable[[int, int, bytes], Any]) -> None:
        self.store = store
        self.max_bytes, self.max_entries, self.max_s = max_bytes, max_entries, max_s
        self.block_digests = block_digests
        self.kept: Any = None
        self.pinned = False
        self.claims: dict[int, bool] = {}  # end of a claim -> committed
        self.made: list[tuple[str, Any]] = []  # ids committed here: (id, salt)

    def handle(self, msg: dict, blob: bytes) -> tuple | None:
        """The answer to one message (None: none). Raises ValueError, TypeError."""
        op = msg.get("op")
        if op == "pin" and self.kept is None:
            return self._pin(msg.get("id"), msg.get("salt"), msg.get("chat") is True)
        tip = self.kept.tip if self.kept is not None else None
        rows = msg.get("rows")
        if tip is None or type(rows) is not int:
            raise ValueError("not pinned")
        start = self.kept.shape[0]
        if op == "claim":
            got = self.store.claim(tip, start, rows, self.max_bytes()) if rows > start else "taken"
            if got is None:
                self.claims[rows] = False
                self._unpin()  # (the claim's use holds the tip; the entry may go)
            return ({"got": got or "ok"},)
        if op == "unclaim" and self.claims.get(rows) is False:
            del self.claims[rows]
            self.store.unclaim(tip, start, rows)
            self.store.let_go(tip)
            return None
        if op == "trim" and self.claims.get(rows) is False and type(to := msg.get("to")) is int \
                and start < to < rows and self.store.trim(tip, rows, to):
            del self.claims[rows]
            self.claims[to] = False
            return None
        if op == "drop" and (kid := msg.get("id"), salt := msg.get("salt")) in self.made:
            self.store.drop(kid, salt, "unanswered")  # the sibling never sent it
            return None
        ttl, salt, block = msg.get("ttl"), msg.get("salt"), msg.get("block")
        if op == "commit" and self.claims.get(rows) is False and type(ttl) in (int, float) and (
                math.isfinite(ttl) and ttl > 0 and (salt is None or isinstance(salt, str))
                and tip.file_bytes() >= rows * tip.row_bytes):  # (mapping them is safe)
            n = msg.get("digest_bytes", len(blob))
            if type(n) is not int or not 0 <= n <= len(blob):
                raise ValueError("digest_bytes")
            chat = self._rendered(rows, msg.get("parts"), blob[n:])
            if (self.kept.chat is None) != (chat is None):  # (a turn of the pinned kind)
                raise ValueError("chat")
            kid = self.store.put(tip, rows, self.block_digests(block, rows, blob[:n]), salt,
                                 min(ttl, self.max_s()), self.max_entries(), chat)
            self.claims[rows] = True
            if kid is not None:
                self.made.append((kid, salt))
                count(ConversationEvent.SIBLING_KEPT)
            return ({"id": kid},)
        raise ValueError("unknown op")

    def _rendered(self, rows: int, parts: Any, blob: bytes) -> Rendered | None:
        """A chat turn's rendered prompt a commit sent (None: not a chat turn's), over
        the pinned turn's token ids array (one for the tip: this lease claimed the
        rows after them). Raises ValueError: malformed, or not beginning with them."""
        if parts is None and not blob:
            return None
        got, base = unpack(blob, rows, parts), self.kept.chat
        start = self.kept.shape[0]
        if got is None or base is None or got.token_ids[:start] != base.token_ids[:start]:
            raise ValueError("rendered")
        shared = base.token_ids
        del shared[start:]
        shared.extend(got.token_ids[start:])
        return Rendered(shared, got.positions, rows)

    def _pin(self, kid: Any, salt: Any, chat: bool) -> tuple:
        if salt is not None and not isinstance(salt, str):
            raise ValueError("salt")
        kept = self.store.pin(kid, salt, chat)
        if kept is not None:
            try:
                kept.ready.result(READY_WAIT_S)
            except Exception:  # (TimeoutError) a miss
                pass
            if not kept.ready.done() or kept.tip is None or kept.tip.fd is None:
                self.store.unpin(kept)
                kept = None
        if kept is None:
            return ({"miss": True},)
        self.kept, self.pinned = kept, True
        count(ConversationEvent.SIBLING_SERVED)
        d = kept.digests
        digests = d.digests if d is not None else b""
        return ({"rows": kept.shape[0], "hidden": kept.shape[1],
                 "dtype": str(kept.dtype).removeprefix("torch."),
                 "block": d.block_tokens if d is not None else None,
                 "digest_bytes": len(digests),
                 "parts": len(kept.chat.positions) if kept.chat is not None else None},
                digests + (pack(kept.chat) if kept.chat is not None else b""), (kept.tip.fd,))

    def _unpin(self) -> None:
        if self.pinned:
            self.pinned = False
            self.store.unpin(self.kept)

    def end(self) -> None:
        """The connection ended: the pin and every use go; rows a claim never
        committed go back down to the file's size (rows past it were never written
        nor read: a chat turn's bound, a sibling that died before it wrote)."""
        if self.kept is None:
            return
        tip, start = self.kept.tip, self.kept.shape[0]
        self._unpin()
        self.kept = None
        for rows, committed in self.claims.items():
            if not committed:
                self.store.trim(tip, rows, max(start, min(rows, tip.file_bytes() // tip.row_bytes)))
            self.store.let_go(tip)

