# SPDX-License-Identifier: Apache-2.0
"""The Unix socket over which same-host producers register memfd regions.

The protocol is pinned (``docs/regions.md`` spells it out): an ``AF_UNIX``,
``SOCK_SEQPACKET`` socket, one UTF-8 JSON object of at most 64 KiB per message, one
answer each: ``register`` (one sealed memfd attached), ``unregister``, and the
siblings' internal ``lookup`` (``ext/regions/mirror.py``). A connection's regions are
unregistered when it closes; the peer's uid must be in ``allowed_uids``. One daemon
thread serves every connection (``selectors``) and runs the registry's idle expiry;
registrations run on two workers. No ``close`` of a peer's fd happens on that
thread (``ext/regions/sockets.py``'s closer thread does it).

Knows sockets and the registry (``ext/regions/registry.py``), not vLLM and not HTTP.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import array
import collections
import json
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from shm_embeds_client import wire
from vllm.logger import init_logger

from vllm._shm_embeds.counters import count, count_reason
from vllm._shm_embeds.ext.regions.events import RegionEvent
from vllm._shm_embeds.ext.regions.memfd import NOT_MEMFD, RegionError
from vllm._shm_embeds.ext.regions import settings
from vllm._shm_embeds.ext.regions.registry import Lease, RegionRegistry
from vllm._shm_embeds.ext.regions.sockets import (  # peer_is_sibling: public here too
    ANC_BYTES,
    carries_fds,
    close_if_drained,
    close_later,
    close_unasked,
    closer_busy,
    discard_fd,
    group_id,
    is_memfd,
    is_sibling,
    listen_at,
    owner_lock,
    peer_cred,
    peer_is_sibling,  # noqa: F401
    received_fds,
    remove_if_ours,
)

logger = init_logger(__name__)

MAX_MESSAGE = wire.MAX_MESSAGE  # bytes of one JSON message (the client's)
MAX_LOOKUP_REPLY = 128 << 10  # SEQPACKET: a message over SO_SNDBUF fails (EMSGSIZE)
MAX_CONNECTIONS = 64  # producers' (siblings' do not count)
# One producer process's share of them: no single producer holds the pool.
MAX_CONNECTIONS_PER_PRODUCER = 8
REGISTER_WORKERS = 2
EXPIRE_EVERY_S = 1.0
MAX_UNREAD_CLOSES = 64  # connections with unread messages waiting for the closer thread


class Reply(NamedTuple):
    """What the server answers one message: ``message`` (sent as JSON), and
    for a lookup the ``lease`` whose fd goes with it (released once sent)."""

    message: dict[str, Any]
    lease: Lease | None = None


class _Conn:
    """One connection; out of the selector while its registration runs."""

    def __init__(self, sock: socket.socket, pid: int, uid: int, allowed: bool) -> None:
        self.sock, self.pid, self.uid, self.allowed = sock, pid, uid, allowed
        self.regions: set[str] = set()  # ids this connection registered
        self.last_active = time.monotonic()  # its last message or answer
        self.busy = False  # a registration of it runs
        # a sibling API server (same uid and parent): may look regions up, takes no slot
        self.sibling = is_sibling(pid, uid)


class RegionServer:
    """Serves the region protocol on ``path`` from one daemon thread.

    Args:
        path: the socket file to create.
        registry: where regions go.
        group: name (or number) of a group: the socket file gets that group
            and mode 0660; None: mode 0600.
        max_connections: producer connections at once (siblings' do not
            count); further ones are answered with an error and closed.
        describe: extra fields of a ``lookup`` answer for a region's tensor
            (the integration sends its prefix-cache digests along); left out
            if the answer would be over ``MAX_LOOKUP_REPLY`` bytes.
        idle_timeout_s: seconds a producer connection holding no registered
            region may send nothing before it is closed; None:
            ``settings.REGIONS_IDLE_S``.
    """

    def __init__(self, path: str, registry: RegionRegistry, group: str | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 describe: Callable[[Any], dict] | None = None,
                 idle_timeout_s: float | None = None) -> None:
        self.path = path
        self.idle_timeout_s = (settings.regions_idle_s() if idle_timeout_s is None
                               else idle_timeout_s)
        self.describe = describe
        self._lock_sock: socket.socket | None = None
        self.registry = registry
        self.group = group
        self.max_connections = max_connections
        self._listener: socket.socket | None = None
        self._inode: int | None = None
        self._wake: tuple[int, int] | None = None  # closed by the thread, at its end
        self._wake_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None  # registrations
        self._done: collections.deque[tuple[_Conn, bool]] = collections.deque()
        self._stop = False
        self._conns: set[_Conn] = set()
        # shut down, with messages unread: closed on the closer thread once it is not behind
        self._unread: list[socket.socket] = []

    def start(self) -> None:
        """Create the socket file, listen, start the thread.

        Raises:
            FileExistsError: ``path`` exists and is not a socket.
            sockets.LockHeld: a process of this uid serves ``path``
                (EADDRINUSE; ``sibling``: another API server of this ``vllm serve``).
            OSError: another server listens on ``path`` (EADDRINUSE), or
                binding failed.
            ValueError: no such group.
        """
        if self._listener is not None:
            raise RuntimeError("RegionServer already started")
        gid = group_id(self.group) if self.group else None
        mode = 0o660 if gid is not None else 0o600
        lock = owner_lock(self.path)
        try:
            self._listener, self._inode = listen_at(self.path, mode, gid)
        except BaseException:
            lock.close()
            raise
        self._lock_sock = lock
        self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pool = ThreadPoolExecutor(REGISTER_WORKERS, "shm-embeds-register")
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="shm-embeds-regions",
                                        daemon=True)
        self._thread.start()
        logger.info("shm-embeds: regions socket %s (mode %o%s)", self.path, mode,
                    f", group {self.group}" if gid is not None else "")

    def close(self) -> None:
        """Stop the thread (after the registrations running; those not started
        are refused), close every connection (their regions are
        unregistered) and remove the socket file. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop = True
            self._poke()
            thread.join(10)
            if thread.is_alive():  # it cleans up when the registration ends
                logger.warning("shm-embeds: the regions thread did not stop in 10 s "
                               "(a registration is still running)")
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            remove_if_ours(self.path, self._inode)
        if self._lock_sock is not None:
            self._lock_sock.close()
            self._lock_sock = None

    def _poke(self) -> None:
        """Wake the thread (from any thread)."""
        with self._wake_lock:
            if self._wake is not None:
                try:
                    os.write(self._wake[1], b"x")
                except BlockingIOError:  # full: it wakes anyway
                    pass

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        sel.register(self._wake[0], selectors.EVENT_READ, "wake")
        next_expire = time.monotonic() + EXPIRE_EVERY_S
        accepting = True
        try:
            while not self._stop:
                for key, _ in sel.select(max(0.0, next_expire - time.monotonic())):
                    if key.data is None:
                        accepting = self._accept(sel)
                    elif isinstance(key.data, _Conn):
                        self._serve(sel, key.data)
                    else:
                        self._drain_wake()
                while self._done:  # registrations answered: read those connections again
                    conn, sent = self._done.popleft()
                    if not sent:
                        self._close_conn(sel, conn, "disconnect")
                    elif conn in self._conns:
                        conn.busy = False
                        sel.register(conn.sock, selectors.EVENT_READ, conn)
                if self._unread and not closer_busy():
                    self._close_unread()
                if time.monotonic() >= next_expire:
                    # paused after an accept error (EMFILE), or while too many wait to close
                    if not accepting and len(self._unread) < MAX_UNREAD_CLOSES:
                        sel.register(self._listener, selectors.EVENT_READ, None)
                        accepting = True
                    try:
                        self.registry.expire()
                        self._close_idle(sel)
                    except Exception:
                        logger.exception("shm-embeds: region expiry failed")
                    next_expire = time.monotonic() + EXPIRE_EVERY_S
        except Exception:
            logger.exception("shm-embeds: the regions socket thread failed; regions are off")
        finally:
            self._stop = True  # registrations not started yet are refused
            self._pool.shutdown(wait=True)
            for conn in list(self._conns):
                self._close_conn(sel, conn, "close")
            self._close_unread()  # even while the closer is behind: nobody waits on it now
            self._done.clear()
            sel.close()
            with self._wake_lock:
                for fd in self._wake:
                    os.close(fd)
                self._wake = None

    def _close_idle(self, sel: selectors.BaseSelector) -> None:
        """Close producer connections that hold no registered region and sent
        nothing for ``idle_timeout_s`` (their slots are for producers)."""
        now = time.monotonic()
        for conn in list(self._conns):
            if conn.sibling or conn.busy or now - conn.last_active <= self.idle_timeout_s:
                continue
            conn.regions = self.registry.registered(conn.regions)  # expired ones go
            if not conn.regions:
                count_reason(RegionEvent.REGION_REFUSED, "idle_connection")
                self._close_conn(sel, conn, "disconnect")

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake[0], 4096):
                pass
        except BlockingIOError:
            pass

    def _retire(self, sock: socket.socket) -> None:
        """Close the connection socket ``sock`` (shut down here): at once if no
        message is queued on it, else on the closer thread (closing it releases
        the fds of its unread messages), or, while that is behind, later
        (``_unread``). Never raises."""
        try:
            if close_if_drained(sock):
                return
            if closer_busy():
                self._unread.append(sock)
            else:
                close_later(sock)
        except Exception:
            logger.exception("shm-embeds: closing a regions connection failed")

    def _close_unread(self) -> None:
        """Hand every connection of ``_unread`` to the closer thread."""
        unread, self._unread = self._unread, []
        for sock in unread:
            try:
                close_later(sock)
            except Exception:
                logger.exception("shm-embeds: closing a regions connection failed")

    def _accept(self, sel: selectors.BaseSelector) -> bool:
        """Accept one connection; False if accepting is paused (an error, or
        ``MAX_UNREAD_CLOSES`` connections wait for the closer thread)."""
        if len(self._unread) >= MAX_UNREAD_CLOSES:  # each accepted one may add one more
            sel.unregister(self._listener)
            return False
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as e:  # EMFILE/ENFILE: the listener stays readable; pause
            logger.warning("shm-embeds: accepting a regions connection failed: %s", e)
            sel.unregister(self._listener)
            return False
        try:
            pid, uid = peer_cred(sock)
            sock.setblocking(False)
            conn = _Conn(sock, pid, uid, uid in self.registry.limits.allowed_uids)
            if not conn.allowed and not conn.sibling:  # nothing it sent is read
                logger.warning("shm-embeds: regions connection from uid %d (pid %d), which "
                               "is not allowed (VLLM_SHM_EMBEDS_REGIONS_UIDS), closed", uid,
                               pid)
                count_reason(RegionEvent.REGION_REFUSED, "uid")
                self._send(sock, {"error": "this user may not register regions"})
                self._retire(sock)  # what it queued is released off this thread
                return True
            if not conn.sibling and sum(
                    not c.sibling for c in self._conns) >= self.max_connections:
                count_reason(RegionEvent.REGION_REFUSED, "connections")
                self._send(sock, {"error": "too many connections"})
                self._retire(sock)
                return True
            if not conn.sibling and sum(not c.sibling and c.pid == pid for c in self._conns
                                        ) >= MAX_CONNECTIONS_PER_PRODUCER:
                count_reason(RegionEvent.REGION_REFUSED, "producer_connections")
                self._send(sock, {"error": "too many connections from this process"})
                self._retire(sock)
                return True
            sel.register(sock, selectors.EVENT_READ, conn)
        except OSError as e:
            logger.warning("shm-embeds: a regions connection failed: %s", e)
            self._retire(sock)
            return True
        self._conns.add(conn)
        return True

    @staticmethod
    def _send(sock: socket.socket, reply: dict[str, Any], fds: list[int] = ()) -> bool:
        try:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
            sock.sendmsg([json.dumps(reply).encode()], anc if fds else [],
                         socket.MSG_NOSIGNAL)
            return True
        except OSError:  # EAGAIN (the peer does not read its replies), EPIPE
            return False

    def _close_conn(self, sel: selectors.BaseSelector, conn: _Conn, reason: str) -> None:
        self._conns.discard(conn)
        try:
            sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self._retire(conn.sock)
        if conn.regions:
            self.registry.unregister_ids(conn.regions, reason)

    def _serve(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        """Read and answer one message of ``conn``. Every fd it carries is
        installed (room for ``SCM_MAX_FD``: none is released by the kernel
        here), but while the closer thread is behind (a FUSE close may never
        return): then a message with fds is answered unread (peeked) and its
        connection closed, its fds still queued (released on the closer thread)."""
        try:
            if closer_busy() and carries_fds(conn.sock):
                count_reason(RegionEvent.REGION_REFUSED, "closer_busy")
                self._send(conn.sock, {"error": "the server takes no file descriptors now; "
                                                "retry later"})
                self._close_conn(sel, conn, "disconnect")
                return
            data, ancdata, flags, _ = conn.sock.recvmsg(MAX_MESSAGE, ANC_BYTES,
                                                        socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_conn(sel, conn, "disconnect")
            return
        fds = received_fds(ancdata)
        if not data and not fds and not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            self._close_conn(sel, conn, "disconnect")  # EOF
            return
        conn.last_active = time.monotonic()
        # A peer that sends anything but a memfd (or any fd while none is taken) is
        # answered and closed: each such fd costs the closer thread a close.
        hostile = True
        if not all(map(is_memfd, fds)):
            count_reason(RegionEvent.REGION_REFUSED, "not_memfd")
            reply = Reply({"error": NOT_MEMFD})
        else:
            hostile = False
            reply = self._handle(sel, conn, data, fds, flags)
        if hostile:
            close_unasked(fds)
        if reply is None:  # a registration: its worker answers
            return
        lease = reply.lease
        try:
            sent = self._send(conn.sock, reply.message, [lease.region.fd] if lease else [])
        finally:
            if lease is not None:  # the peer has its own reference to the memfd now
                lease.release()
        if not sent or hostile:
            self._close_conn(sel, conn, "disconnect")

    def _register(self, conn: _Conn, fd: int, msg: dict[str, Any]) -> None:
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

    def _handle(self, sel: selectors.BaseSelector, conn: _Conn, data: bytes, fds: list[int],
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
            if op is None or (op is RegionServer._op_lookup and not conn.sibling):
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

    def _op_register(self, sel: selectors.BaseSelector, conn: _Conn, msg: dict,
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

    def _op_unregister(self, sel: selectors.BaseSelector, conn: _Conn, msg: dict,
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

    def _op_lookup(self, sel: selectors.BaseSelector, conn: _Conn, msg: dict,
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
    "register": RegionServer._op_register,
    "unregister": RegionServer._op_unregister,
    "lookup": RegionServer._op_lookup,
}
