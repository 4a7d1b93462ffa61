# SPDX-License-Identifier: Apache-2.0
"""Sibling sockets' plumbing (``ext/regions``, ``ext/conversations/siblings.py``).

* :func:`owner_lock`, :func:`listen_at` (:func:`clear_path`, :func:`set_mode`),
  :func:`remove_if_ours`, :func:`group_id`: one process per host serves a path; a
  stale socket file is replaced, anything else never.
* :func:`peer_is_sibling`: the peer is another API server of this ``vllm serve``.
* :func:`received_fds`, :func:`discard_fd`, :func:`close_unasked` (and the closer
  thread's :func:`close_if_drained`, :func:`close_later`, :func:`closer_busy`,
  :func:`carries_fds`): a descriptor a peer sent may be anything, so nothing but
  ``readlink`` and ``F_GET_SEALS`` touches one before it is known to be a memfd, and
  one that is not (or unasked for) is closed on a daemon thread of its own.

Knows sockets and descriptors, not regions nor conversations.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import array
import errno
import fcntl
import grp
import hashlib
import os
import queue
import socket
import stat
import struct
import threading

from vllm.logger import init_logger

from vllm._shm_embeds.procfs import proc_stat

logger = init_logger(__name__)

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
CLOSER_BACKLOG = 64  # fds waiting for the closer thread, above which none is received
SCM_MAX_FD = 253  # the most fds one message carries (the kernel's, include/net/scm.h)
# Room for every fd a message carries: with less, the kernel releases the rest on the
# receiving thread (its last close of a lingering socket blocks), flagging MSG_CTRUNC.
ANC_BYTES = socket.CMSG_SPACE(SCM_MAX_FD * array.array("i").itemsize)
_CRED_SPACE = socket.CMSG_SPACE(_CRED.size)
LOCK_NAMES = 8  # abstract lock names tried past squatters before going without one
_LOCK_PROBE_S = 0.2


class LockHeld(OSError):
    """EADDRINUSE: another process of this uid holds the start-up lock of a
    path; ``sibling``: it is a sibling (:func:`is_sibling`) of this process."""

    def __init__(self, path: str, sibling: bool) -> None:
        super().__init__(errno.EADDRINUSE, "another process serves this regions socket", path)
        self.sibling = sibling


def _lock_holder(name: str) -> tuple[int, int] | None:
    """``(pid, uid)`` of the process listening on the abstract ``name``, or
    None: nobody listens (bound only: a squatter), or not within 0.2 s."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.settimeout(_LOCK_PROBE_S)
        probe.connect(name)  # SO_PEERCRED: the listener's, even before an accept
        return peer_cred(probe)
    except OSError:
        return None
    finally:
        probe.close()


def owner_lock(path: str) -> socket.socket:
    """Bind (and listen on) the abstract-namespace name that makes this
    process the one serving ``path`` on this host; returns that socket.

    Any local user can bind an abstract name, so a name held by another uid
    or by a socket that does not listen is a squatter's: the next of
    :data:`LOCK_NAMES` names is tried (siblings walk the same ones). Past
    them all, an unbound socket is returned: the path is then served without
    a lock (``clear_path`` and ``bind`` still refuse a live socket). Never
    waits more than 0.2 s per name.

    Raises:
        LockHeld: a process of this uid holds it (``sibling``: one of this
            process's siblings).
        OSError: the lock socket could not be made.
    """
    key = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:32]
    for i in range(LOCK_NAMES):
        name = f"\0vllm-shm-embeds-regions.{os.getuid()}.{key}.{i}"
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            lock.bind(name)
            lock.listen(64)  # never accepted: only for SO_PEERCRED of probes
            return lock
        except OSError as e:
            lock.close()
            if e.errno != errno.EADDRINUSE:
                raise
        holder = _lock_holder(name)
        if holder is not None and holder[1] == os.getuid():
            raise LockHeld(path, is_sibling(*holder))
        logger.warning("shm-embeds: the start-up lock of the regions socket is held by "
                       "another user's process (uid %s); trying another",
                       holder[1] if holder else "unknown")
    logger.warning("shm-embeds: every start-up lock name of the regions socket is squatted; "
                   "serving it without one")
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def group_id(group: str) -> int:
    """The gid of ``group`` (a name, or a number)."""
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise ValueError(f"shm-embeds: regions socket group {group!r} does not exist") from None


def clear_path(path: str) -> None:
    """Remove a stale socket at ``path``; raise if something else is there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "exists and is not a socket; not replacing it",
                              path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except ConnectionRefusedError:  # stale: nobody listens
        os.unlink(path)
        logger.info("shm-embeds: removed the stale regions socket %s", path)
        return
    except OSError as e:  # EPROTOTYPE: someone listens with another socket type
        raise OSError(errno.EADDRINUSE, f"a live socket is there ({e.strerror})", path) from e
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, "another server listens there", path)


def is_memfd(fd: int) -> bool:
    """``fd`` (open) is a memfd: its link is ``/memfd:...`` and ``F_GET_SEALS``,
    which only shmem and hugetlbfs files answer, works. No I/O."""
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
            return False
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        return True
    except OSError:
        return False


def set_mode(path: str, mode: int, gid: int | None) -> int:
    """Give the socket file at ``path`` (just bound by this process) ``mode``
    and group ``gid`` (None: unchanged); returns its inode. Opened with
    ``O_PATH|O_NOFOLLOW`` and changed through ``/proc/self/fd``, so a link put
    at ``path`` (a writable socket directory) is never followed.

    Raises:
        OSError: not a socket of this uid there now (ELOOP for a link), or
            the change failed.
    """
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EEXIST, "not this server's socket", path)
        if gid is not None:
            os.chown(f"/proc/self/fd/{fd}", -1, gid)
        os.chmod(f"/proc/self/fd/{fd}", mode)
        return st.st_ino
    finally:
        os.close(fd)


def listen_at(path: str, mode: int, gid: int | None) -> tuple[socket.socket, int]:
    """A non-blocking ``SOCK_SEQPACKET`` socket listening at ``path`` (a stale
    socket file replaced: :func:`clear_path`) with ``mode`` and group ``gid``
    (:func:`set_mode`), and the socket file's inode. Raises what
    :func:`clear_path`, ``bind`` and :func:`set_mode` raise; leaves nothing
    behind then."""
    clear_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        os.fchmod(sock.fileno(), 0o600)  # bind() creates the file with this mode
        sock.bind(path)
        try:
            inode = set_mode(path, mode, gid)  # never through a link
            sock.listen(16)
            sock.setblocking(False)
        except BaseException:
            os.unlink(path)
            raise
    except BaseException:
        sock.close()
        raise
    return sock, inode


def remove_if_ours(path: str, inode: int | None) -> None:
    """Unlink the socket file at ``path`` if it is still the one of ``inode``."""
    try:
        if os.lstat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


_closer: queue.Queue | None = None  # this process's closer thread's fds
_closer_lock = threading.Lock()


def _reset_closer() -> None:
    global _closer, _closer_lock
    _closer, _closer_lock = None, threading.Lock()  # a forked child has no closer thread


os.register_at_fork(after_in_child=_reset_closer)


def close_fd_later(fd: int) -> None:
    """Close ``fd`` on the daemon closer thread (a ``close`` may never return: FUSE)."""
    global _closer
    with _closer_lock:
        if _closer is None:
            _closer = queue.Queue()
            threading.Thread(target=_close_forever, args=(_closer,), daemon=True,
                             name="shm-embeds-fd-closer").start()
        _closer.put(fd)


def _close_forever(fds: queue.Queue) -> None:
    while True:
        fd = fds.get()
        try:
            os.close(fd)
        except OSError:
            pass
        finally:
            fds.task_done()


def closer_busy() -> bool:
    """The closer thread's backlog is full (it may be stuck on a FUSE
    ``close``): receive no descriptors until it is not."""
    closer = _closer
    return closer is not None and closer.qsize() >= CLOSER_BACKLOG


def discard_fd(fd: int) -> None:
    """Close ``fd``, received from a peer (the caller owns it): here if it is a
    memfd, else on the daemon closer thread (a FUSE ``close`` may never return).
    Callers install no fd while :func:`closer_busy`, so the backlog stays
    within :data:`CLOSER_BACKLOG` plus one message's fds (:data:`SCM_MAX_FD`)
    plus the fds and sockets in their hands."""
    if is_memfd(fd):
        os.close(fd)
        return
    close_fd_later(fd)


def close_unasked(fds: list[int]) -> None:
    """Close ``fds`` (received, owned by the caller, nobody asked for them) on
    the closer thread, memfds too: whatever they are, no ``close`` here (a
    memfd's last one frees its pages). They count in its backlog."""
    for fd in fds:
        close_fd_later(fd)


def close_later(sock: socket.socket) -> None:
    """Close ``sock`` on the closer thread (``sock`` is detached: unusable here)."""
    close_fd_later(sock.detach())


def carries_fds(sock: socket.socket) -> bool:
    """The next message queued on ``sock`` (an ``AF_UNIX`` socket without
    ``SO_PASSCRED``) carries fds. Peeked without room for any: the kernel
    installs none and drops only its own extra references (the message keeps
    them), so no fd is released here. False at EOF.

    Raises:
        BlockingIOError: no message queued.
        OSError: the socket failed.
    """
    _, _, flags, _ = sock.recvmsg(1, 0, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    return bool(flags & socket.MSG_CTRUNC)


def close_if_drained(sock: socket.socket) -> bool:
    """Shut ``sock`` (a connected ``AF_UNIX`` socket) down and close it if no
    message is queued on it; returns whether it was closed. Otherwise it stays
    open (shut down: no message can arrive any more) for the caller to close
    elsewhere (:func:`close_later`): closing it releases the fds of its unread
    messages, each maybe a blocking ``close``.

    ``SO_PASSCRED`` then a peek: every queued message, a zero-length one
    too, brings ``SCM_CREDENTIALS``; an empty queue returns nothing. Never
    raises; where it cannot tell, the socket is left open (False).
    """
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # the peer has closed: nothing can arrive either
        pass
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        data, anc, flags, _ = sock.recvmsg(1, _CRED_SPACE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return False
    if data or anc or flags:
        return False
    sock.close()
    return True


def received_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """Every fd in ``SCM_RIGHTS`` ancillary data (the caller discards them)."""
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def peer_cred(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of a connected ``AF_UNIX`` socket's peer (``SO_PEERCRED``:
    the kernel's, as of its ``connect``/``listen``). Raises OSError."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                               _CRED.size))
    return pid, uid


def _ppid(pid: int) -> int | None:
    """The parent pid of ``pid`` (``/proc/<pid>/stat`` field 4), or None (gone,
    a zombie, or unreadable)."""
    try:
        fields = proc_stat(pid)
        return int(fields[1]) if fields is not None else None
    except ValueError:
        return None


def is_sibling(pid: int, uid: int) -> bool:
    """Process ``pid`` of ``uid`` is a sibling of this one: this uid, another
    pid, this parent (API servers of one ``vllm serve`` are its children)."""
    return uid == os.getuid() and pid != os.getpid() and _ppid(pid) == os.getppid()


def peer_is_sibling(sock: socket.socket) -> bool:
    """The peer of the connected ``AF_UNIX`` socket ``sock`` is a sibling
    (:func:`is_sibling`); False too if its credentials cannot be read."""
    try:
        return is_sibling(*peer_cred(sock))
    except OSError:
        return False
