# SPDX-License-Identifier: Apache-2.0
"""The regions socket's plumbing: its file, its peers, the descriptors they send.

* :func:`owner_lock`, :func:`clear_path`, :func:`group_id`: one process per
  host serves a path (an abstract-namespace name decides); a stale socket
  file is replaced, anything else never.
* :func:`peer_is_sibling`: the peer is another API server of this ``vllm
  serve`` (same uid, another process, the same parent).
* :func:`received_fds` and :func:`discard_fd`: a descriptor a peer sent may
  be anything, a FUSE file's too, whose ``fstat`` (GETATTR) and ``close``
  (FLUSH) wait for its file system's server, maybe forever. So nothing but
  ``readlink`` of ``/proc/self/fd`` and ``F_GET_SEALS`` (no I/O) touches one
  before it is known to be a memfd, and one that is not is closed on a
  daemon thread of its own, never on a thread that serves anyone.

Knows sockets and descriptors, not regions.
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

from vllm._shm_embeds.handle import proc_stat

logger = init_logger(__name__)

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_closer: tuple[int, queue.SimpleQueue] | None = None  # (pid, fds to close)
_closer_lock = threading.Lock()


def owner_lock(path: str) -> socket.socket:
    """Bind the abstract-namespace name that makes this process the one serving
    ``path`` on this host. Raises OSError(EADDRINUSE): another live process does."""
    key = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:32]
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        lock.bind(f"\0vllm-shm-embeds-regions.{key}")
    except OSError as e:
        lock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(errno.EADDRINUSE, "another process serves this regions socket",
                          path) from None
        raise
    return lock


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


def _close_forever(fds: queue.SimpleQueue) -> None:
    while True:
        fd = fds.get()
        try:
            os.close(fd)
        except OSError:
            pass


def discard_fd(fd: int) -> None:
    """Close ``fd``, received from a peer (the caller owns it): here if it is a
    memfd, else on the daemon closer thread (a FUSE ``close`` may never return)."""
    if is_memfd(fd):
        os.close(fd)
        return
    global _closer
    with _closer_lock:
        if _closer is None or _closer[0] != os.getpid():  # none yet, or a forked child
            _closer = (os.getpid(), queue.SimpleQueue())
            threading.Thread(target=_close_forever, args=(_closer[1],), daemon=True,
                             name="shm-embeds-fd-closer").start()
        _closer[1].put(fd)


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
