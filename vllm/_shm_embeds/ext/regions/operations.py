# SPDX-License-Identifier: Apache-2.0
"""What the regions socket answers one message: the operations of its protocol.

One UTF-8 JSON object of at most 64 KiB per message, one answer each (the
protocol is pinned: ``docs/regions.md``): ``register`` (one sealed memfd attached;
run on a worker, :meth:`Operations._register`), ``unregister``, and the siblings'
internal ``lookup`` (``ext/regions/mirror.py``), one method each (:data:`OPS`).
:class:`Conn` is what the server keeps of one connection; :class:`Operations` is
the half of ``server.RegionServer`` that reads a message and changes the registry
(the connections themselves, their thread and its selector are ``server.py``'s).

Knows sockets and the registry (``ext/regions/registry.py``), not vLLM and not HTTP.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import array
import collections
import json
import selectors
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from shm_embeds_client import wire
from vllm.logger import init_logger

from vllm._shm_embeds.counters import count, count_reason
from vllm._shm_embeds.ext.regions.events import RegionEvent
from vllm._shm_embeds.ext.regions.memfd import RegionError
from vllm._shm_embeds.ext.regions.registry import Lease, RegionRegistry
from vllm._shm_embeds.files.sockets import close_unasked, discard_fd

logger = init_logger(__name__)

MAX_MESSAGE = wire.MAX_MESSAGE  # bytes of one JSON message (the client's)
MAX_LOOKUP_REPLY = 128 << 10  # SEQPACKET: a message over SO_SNDBUF fails (EMSGSIZE)


class Reply(NamedTuple):
    """What the server answers one message: ``message`` (sent as JSON), and
    for a lookup the ``lease`` whose fd goes with it (released once sent)."""

    message: dict[str, Any]
    lease: Lease | None = None


class Conn:
    """One connection; out of the selector while its registration runs.
    ``sibling``: a sibling API server (same uid and parent), which may look
    regions up and takes no slot."""

    def __init__(self, sock: socket.socket, pid: int, uid: int, allowed: bool,
                 sibling: bool) -> None:
        self.sock, self.pid, self.uid, self.allowed = sock, pid, uid, allowed
        self.regions: set[str] = set()  # ids this connection registered
        self.last_active = time.monotonic()  # its last message or answer
        self.busy = False  # a registration of it runs
        self.sibling = sibling


class Operations:
    """The answers to a connection's messages (``server.RegionServer`` is one).

    Its server provides the ``registry``, ``describe`` (extra fields of a lookup
    answer), the registration workers (``_pool``), ``_stop`` (shutting down),
    ``_done`` (registrations answered: ``(conn, sent)``, for its thread) and
    :meth:`_poke` (wakes its thread).
    """

    registry: RegionRegistry
    describe: Callable[[Any], dict] | None
    _pool: ThreadPoolExecutor | None
    _stop: bool
    _done: collections.deque[tuple[Conn, bool]]

    def _poke(self) -> None:
        raise NotImplementedError

    @staticmethod
    def _send(sock: socket.socket, reply: dict[str, Any], fds: list[int] = ()) -> bool:
        try:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
            sock.sendmsg([json.dumps(reply).encode()], anc if fds else [],
                         socket.MSG_NOSIGNAL)
            return True
        except OSError:  # EAGAIN (the peer does not read its replies), EPIPE
            return False

    def _register(self, conn: Conn, fd: int, msg: dict[str, Any]) -> None:
        """On a worker: register ``fd`` (owned), answer, hand ``conn`` back."""
        sent = False
        try:
            try:
                if self._stop:
                    discard_fd(fd)
                    count_reason(RegionEvent.REGION_REFUSED, "closed")
                    raise RegionError("the server is shutting down", "closed")
                region = self.registry.register(fd, conn.uid, msg.get("datatype"),
                                                msg.get("shape"))
                conn.regions.add(region.id)  # unregistered with the connection
                reply = {"region": region.id, "byte_size": region.nbytes}
            except RegionError as e:
                reply = {"error": str(e)}  # counted by the registry
            except Exception:
                logger.exception("shm-embeds: a registration failed")
                reply = {"error": "internal error"}
            sent = self._send(conn.sock, reply)
        finally:
            conn.last_active = time.monotonic()
            self._done.append((conn, sent))
            self._poke()

    def _handle(self, sel: selectors.BaseSelector, conn: Conn, data: bytes, fds: list[int],
                flags: int) -> Reply | None:
        """The reply to one message, or None: a registration handed to a
        worker (``conn`` is out of ``sel`` until it answered). Every fd in
        ``fds`` but one handed on goes to the closer thread (nobody asked for
        it); ``MSG_CTRUNC`` in ``flags`` (room for every fd, so: this process
        is out of fds) refuses the message. The operation is :data:`OPS`'s
        (``lookup`` for a sibling API server only)."""
        try:
            if not conn.allowed:
                raise RegionError("this user may not register regions", "uid")
            if flags & socket.MSG_TRUNC:
                raise RegionError(f"message longer than {MAX_MESSAGE} bytes", "too_long")
            if flags & socket.MSG_CTRUNC:
                raise RegionError("too many file descriptors attached", "fds")
            try:
                msg = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):  # e.g. [[[[...]]]]
                msg = None
            if not isinstance(msg, dict):
                raise RegionError("malformed message: expected one UTF-8 JSON object",
                                  "malformed")
            op = OPS.get(msg.get("op")) if isinstance(msg.get("op"), str) else None
            if op is None or (op is Operations._op_lookup and not conn.sibling):
                raise RegionError('unknown op: expected "register" or "unregister"', "op")
            return op(self, sel, conn, msg, fds)
        except RegionError as e:
            count_reason(RegionEvent.REGION_REFUSED, e.reason)
            return Reply({"error": str(e)})
        except Exception:
            logger.exception("shm-embeds: a regions message failed")
            return Reply({"error": "internal error"})
        finally:
            close_unasked(fds)

    def _op_register(self, sel: selectors.BaseSelector, conn: Conn, msg: dict,
                     fds: list[int]) -> None:
        """Hand the one fd to a worker (:meth:`_register` answers)."""
        if len(fds) > 1:
            raise RegionError("too many file descriptors: register takes exactly "
                              f"one (SCM_RIGHTS), got {len(fds)}", "fds")
        if not fds:
            raise RegionError("register takes exactly one file descriptor "
                              "(SCM_RIGHTS), got 0", "fds")
        fd = fds.pop()
        sel.unregister(conn.sock)  # its next message: once this one is answered
        try:
            conn.busy = True
            self._pool.submit(self._register, conn, fd, msg)
        except BaseException:
            conn.busy = False
            sel.register(conn.sock, selectors.EVENT_READ, conn)
            discard_fd(fd)
            raise
        return None

    def _op_unregister(self, sel: selectors.BaseSelector, conn: Conn, msg: dict,
                       fds: list[int]) -> Reply:
        if fds:
            raise RegionError("unregister takes no file descriptor", "fds")
        region_id = msg.get("region")
        try:
            self.registry.unregister(region_id, uid=conn.uid)
        except RegionError as e:
            return Reply({"error": str(e)})
        conn.regions.discard(region_id)
        return Reply({"ok": True})

    def _op_lookup(self, sel: selectors.BaseSelector, conn: Conn, msg: dict,
                   fds: list[int]) -> Reply:
        """A sibling API server's lookup: the region's description, and its fd
        sent with the reply (the lease held until then)."""
        if fds:
            raise RegionError("lookup takes no file descriptor", "fds")
        try:
            lease = self.registry.lookup(msg.get("region"))
        except RegionError as e:
            return Reply({"error": str(e)})
        region = lease.region
        reply = {"datatype": region.datatype, "shape": list(region.shape),
                 "byte_size": region.nbytes}
        try:
            extra = {**reply, **(self.describe(region.tensor) if self.describe else {})}
            if len(json.dumps(extra)) <= MAX_LOOKUP_REPLY:
                reply = extra
            else:  # the sibling does without (e.g. computes the digests)
                count(RegionEvent.REGION_LOOKUP_TRIMMED)
        except Exception:
            logger.exception("shm-embeds: describing a region failed")
        return Reply(reply, lease)


# The operations a message may name (``op``): one method each.
OPS: dict[str, Callable[..., Reply | None]] = {
    "register": Operations._op_register,
    "unregister": Operations._op_unregister,
    "lookup": Operations._op_lookup,
}
