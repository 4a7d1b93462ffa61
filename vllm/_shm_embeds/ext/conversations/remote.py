# SPDX-License-Identifier: Apache-2.0
"""A continuation of an id a sibling API server kept (``siblings.py`` serves it).

:func:`pin` connects to the sibling the id's tag names (only a sibling: same uid
and parent), pins the kept rows there and receives their memfd (``SCM_RIGHTS``):
a :class:`tips.Tip` of this process over the sibling's file, whose books (rows
claimed, bytes charged) stay the sibling's. Rows after them are claimed there
(:meth:`Remote.claim`) and written here into the same file (nothing copied), and
a keep of the grown tensor is made there (:meth:`Remote.commit`: an id of the
sibling, so every turn of a conversation stays with the server that kept it and
its rows are in memory once). The connection is the lease: closing it (the last
:meth:`Remote.let_go`, or this process's end) ends every pin and claim it held.
Round trips block (at most ``TIMEOUT_S`` each): callers run them on
:func:`round_trips`' threads, never on the event loop.
Knows sockets and tips, not vLLM and not HTTP.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from vllm.logger import init_logger

from vllm._shm_embeds.ext.conversations import siblings
from vllm._shm_embeds.ext.conversations.rendered import Rendered, pack, unpack
from vllm._shm_embeds.ext.conversations.tips import Tip
from vllm._shm_embeds.files.sockets import close_unasked, is_memfd, peer_is_sibling
from vllm._shm_embeds.pools import LazyPool

logger = init_logger(__name__)

TIMEOUT_S = 5.0  # a round trip (a pin: the owner's wait for a keep's copy too)
ROUND_TRIP_THREADS = 8  # this API server's sibling round trips at once; more queue

_ROUND_TRIPS = LazyPool(ROUND_TRIP_THREADS, "shm-embeds-sibling")


def round_trips() -> concurrent.futures.ThreadPoolExecutor:
    """The threads sibling round trips (pins, commits) run on: not the event loop's
    default executor, which vLLM and the body paths share, since a pin may wait for
    an owner's copy (``siblings.READY_WAIT_S``): a busy owner then delays sibling
    continuations only, never another request's body."""
    return _ROUND_TRIPS.get()


class Remote:
    """One continuation's connection to the sibling that holds its prefix; counted
    uses (:meth:`hold`, :meth:`let_go`), closed with the last."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock
        self._lock = threading.Lock()  # the socket's: held for a whole round trip
        self._uses_lock = threading.Lock()  # the uses': never held while waiting
        self._uses = 1
        self._ended = False
        self.tip: Tip | None = None

    def _ask(self, msg: dict, blob: bytes = b"") -> dict | None:
        """One round trip; None if the sibling is gone or answers nonsense (then the
        connection is closed: a late answer is never taken for the next one's, and
        the sibling ends what this lease held; this process's descriptor stays)."""
        with self._lock:
            if self._sock is None:
                return None
            try:
                siblings.send(self._sock, msg, blob)
                answer, _, fds = siblings.recv(self._sock, 0)
                close_unasked(fds)
                return answer
            except (OSError, EOFError, ValueError):
                self._close()
                return None
            finally:
                if self._ended:  # (the last use went while this round trip ran)
                    self._close()

    def _close(self) -> None:
        """Close the socket (``_lock`` held)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _tell(self, msg: dict) -> None:
        """A message no answer is waited for; never blocks (the event loop's): with
        a round trip in flight, or the socket full, it is dropped (what it would
        give back then goes with the lease, ``siblings._Lease.end``)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._sock is not None:
                siblings.send(self._sock, msg, flags=socket.MSG_DONTWAIT)
        except OSError:
            pass
        finally:
            if self._ended:
                self._close()
            self._lock.release()

    def claim(self, rows: int) -> str:
        """Claim rows up to ``rows`` after the pinned ones: ``"ok"`` (one more use
        of this lease, ended by :meth:`let_go`), ``"taken"`` (another request grew
        it first) or ``"full"`` (no room there, or the sibling is gone)."""
        got = (self._ask({"op": "claim", "rows": rows}) or {}).get("got")
        if got == "ok":
            self.hold()
            return got
        return "taken" if got == "taken" else "full"

    def unclaim(self, rows: int) -> None:
        """Give back a claim whose rows nobody read (and its use there)."""
        self._tell({"op": "unclaim", "rows": rows})

    def drop(self, kid: str, salt: str | None) -> None:
        """Forget ``kid``, which :meth:`commit` made and nobody was told."""
        self._tell({"op": "drop", "id": kid, "salt": salt})

    def trim(self, rows: int, to: int) -> None:
        """Cut this lease's claim up to ``rows`` to end at ``to`` (its rows after are
        given back there); never blocks."""
        self._tell({"op": "trim", "rows": rows, "to": to})

    def commit(self, rows: int, digests: Any, salt: str | None, ttl_s: float,
               chat: Rendered | None = None) -> str | None:
        """Keep the first ``rows`` rows (claimed by this lease) there, with
        ``digests`` (``BlockDigests`` or None) and a chat turn's rendered prompt
        (``chat``, beginning with the pinned turn's): the sibling's new id, or None."""
        d = digests.digests if digests is not None else b""
        msg = {"op": "commit", "rows": rows, "salt": salt, "ttl": ttl_s,
               "block": digests.block_tokens if digests is not None else None,
               "digest_bytes": len(d), "parts": len(chat.positions) if chat else None}
        kid = (self._ask(msg, d + (pack(chat) if chat else b"")) or {}).get("id")
        return kid if isinstance(kid, str) else None

    def hold(self) -> None:
        with self._uses_lock:
            self._uses += 1

    def let_go(self, _: Any = None) -> None:
        """One use ended; the last closes the connection (the sibling ends the pin
        and claims) and this process's descriptor of the file (mappings stay).
        Never waits: a round trip in flight is cut short (it closes the socket)."""
        with self._uses_lock:
            self._uses -= 1
            if self._uses:
                return
            self._ended = True
        if self._lock.acquire(blocking=False):
            try:
                self._close()
            finally:
                self._lock.release()
        elif (sock := self._sock) is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # (its recv ends: EOF)
            except OSError:
                pass
        if self.tip is not None:
            self.tip.close()


class Pinned(NamedTuple):
    """A pinned kept tensor of a sibling: ``remote.tip`` is its file here."""

    remote: Remote
    rows: int
    digests: tuple[int, int, bytes] | None  # (block_tokens, rows, digests bytes)
    chat: Rendered | None  # a chat turn's rendered prompt


def pin(kid: str, salt: str | None, tag_of: Callable[[str], str],
        chat: bool = False) -> Pinned | None:
    """Pin ``kid`` under ``salt`` (a chat turn's for ``chat``) at the sibling API
    server its tag names, or None: no such sibling (or not one), not held there,
    or any failure (the same miss for all)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    remote = Remote(sock)
    fds: list[int] = []
    try:
        sock.settimeout(TIMEOUT_S)
        sock.connect(siblings.address(tag_of(kid)))
        if not peer_is_sibling(sock):  # never tell another process an id
            raise ConnectionRefusedError("not a sibling")
        siblings.send(sock, {"op": "pin", "id": kid, "salt": salt, "chat": chat})
        sock.settimeout(siblings.READY_WAIT_S + TIMEOUT_S)  # its keep may still copy
        answer, blob, fds = siblings.recv(sock)
        sock.settimeout(TIMEOUT_S)
        rows, hidden = answer.get("rows"), answer.get("hidden")
        dtype = siblings.DTYPES.get(answer.get("dtype"))
        if (answer.get("miss") or len(fds) != 1 or type(rows) is not int or rows < 1
                or type(hidden) is not int or hidden < 1 or dtype is None
                or not is_memfd(fds[0]) or os.fstat(fds[0]).st_size < rows * hidden
                * dtype.itemsize):
            return None
        n, parts = answer.get("digest_bytes"), answer.get("parts")
        if type(n) is not int or not 0 <= n <= len(blob):
            return None
        rendered = unpack(blob[n:], rows, parts) if chat else None
        if chat and rendered is None:
            return None
        remote.tip = Tip(dtype, hidden, fds.pop())
        remote.tip.remote = remote
        block = answer.get("block")
        return Pinned(remote, rows, (block, rows, blob[:n]) if block is not None else None,
                      rendered)
    except (OSError, EOFError, ValueError, AttributeError):
        return None
    finally:
        close_unasked(fds)
        if remote.tip is None:
            remote.let_go()
