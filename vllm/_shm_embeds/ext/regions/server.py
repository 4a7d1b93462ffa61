# SPDX-License-Identifier: Apache-2.0
"""The Unix socket over which same-host producers register memfd regions.

An ``AF_UNIX``, ``SOCK_SEQPACKET`` socket (the protocol is pinned: ``docs/regions.md``;
what each message does: ``ext/regions/operations.py``). :class:`RegionServer`
listens, accepts and reads the connections: the peer's uid must be in
``allowed_uids``, producers' connections are capped, and a connection's regions are
unregistered when it closes. One daemon thread serves every connection
(``selectors``) and runs the registry's idle expiry; registrations run on two
workers. No ``close`` of a peer's fd happens on that thread
(``files/sockets.py``'s closer thread does it).

Knows sockets and the registry (``ext/regions/registry.py``), not vLLM and not HTTP.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import collections
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm.logger import init_logger

from vllm._shm_embeds.counters import count_reason
from vllm._shm_embeds.ext.regions.events import RegionEvent
from vllm._shm_embeds.ext.regions.memfd import NOT_MEMFD
from vllm._shm_embeds.ext.regions import settings
from vllm._shm_embeds.ext.regions.operations import MAX_MESSAGE, Conn, Operations, Reply
from vllm._shm_embeds.ext.regions.registry import RegionRegistry
from vllm._shm_embeds.files.sockets import (  # peer_is_sibling: public here too
    ANC_BYTES,
    carries_fds,
    close_if_drained,
    close_later,
    close_unasked,
    closer_busy,
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

MAX_CONNECTIONS = 64  # producers' (siblings' do not count)
# One producer process's share of them: no single producer holds the pool.
MAX_CONNECTIONS_PER_PRODUCER = 8
REGISTER_WORKERS = 2
EXPIRE_EVERY_S = 1.0
MAX_UNREAD_CLOSES = 64  # connections with unread messages waiting for the closer thread


class RegionServer(Operations):
    """Serves the region protocol on ``path`` from one daemon thread (each
    message answered by :class:`operations.Operations`).

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
        self._done: collections.deque[tuple[Conn, bool]] = collections.deque()
        self._stop = False
        self._conns: set[Conn] = set()
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
                    elif isinstance(key.data, Conn):
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
            conn = Conn(sock, pid, uid, uid in self.registry.limits.allowed_uids,
                        is_sibling(pid, uid))
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

    def _close_conn(self, sel: selectors.BaseSelector, conn: Conn, reason: str) -> None:
        self._conns.discard(conn)
        try:
            sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self._retire(conn.sock)
        if conn.regions:
            self.registry.unregister_ids(conn.regions, reason)

    def _serve(self, sel: selectors.BaseSelector, conn: Conn) -> None:
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
