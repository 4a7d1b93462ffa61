# SPDX-License-Identifier: Apache-2.0
"""The server's private segment directory: made once, found by its processes, gone at exit.

Knows directories and ``/proc`` only: no segment format, not vLLM, not HTTP.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import threading

from vllm._shm_embeds.procfs import owner_is_dead, pid_namespace, proc_start_time

PREFIX = "vllm-shm-embeds-"  # the one name of ours at the top of a shared mount
INNER = "segments"
OWNER_FILE = "owner"
ENV = "VLLM_SHM_EMBEDS_PRIVATE_DIR"  # internal: the path, inherited by the server's processes
_TRIES = 16

_lock = threading.Lock()
_resolved: dict[str, str] = {}  # mount -> segment directory (this process)
_made: dict[str, int] = {}  # outer directory -> pid that made it
_state = {"closed": False}  # True once this process removed what it made (exit)


class UnsafeDirectory(OSError):
    """The mount, or a directory at our path, is not safe for segments."""


def _is_private(st: os.stat_result) -> bool:
    """A directory of this uid with no access for group or others (``lstat``)."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0


def _parent_is_safe(path: str) -> bool:
    """True if no other uid can rename or replace ``path``: its parent is sticky, or
    writable only by its owner, this uid or root."""
    try:
        st = os.stat(os.path.dirname(os.path.abspath(path)) or "/")
    except OSError:
        return False
    if st.st_mode & stat.S_ISVTX:
        return True
    return st.st_mode & 0o022 == 0 and st.st_uid in (0, os.geteuid())


def _check_dir(path: str) -> None:
    """Raise :class:`UnsafeDirectory` unless ``path`` is our private directory: ``lstat``
    (no symlink), then an ``O_NOFOLLOW`` open whose ``fstat`` is the same inode."""
    st = os.lstat(path)
    if not _is_private(st):
        raise UnsafeDirectory(errno.EPERM, "not a private directory of this user")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fst = os.fstat(fd)
    finally:
        os.close(fd)
    if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or not _is_private(fst):
        raise UnsafeDirectory(errno.EPERM, "the directory changed while it was checked")


def _mkdir_private(path: str) -> None:
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700, follow_symlinks=False)  # a umask may only take bits away
    _check_dir(path)


def _make(mount: str) -> str:
    """Make ``<mount>/<PREFIX><random>/segments``; the outer directory. Raises OSError."""
    if not _parent_is_safe(os.path.join(mount, "x")):
        raise UnsafeDirectory(errno.EPERM, "other users may rename entries of the directory "
                              "(writable by them and not sticky)")
    for _ in range(_TRIES):
        outer = os.path.join(mount, PREFIX + secrets.token_hex(8))
        try:
            _mkdir_private(outer)
        except FileExistsError:
            continue  # squatted or a collision: another random name
        try:
            _mkdir_private(os.path.join(outer, INNER))
            fd = os.open(os.path.join(outer, OWNER_FILE),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"{pid_namespace()} {os.getpid()} {proc_start_time(os.getpid()) or 0}\n")
        except BaseException:
            shutil.rmtree(outer, ignore_errors=True)
            raise
        _made[outer] = os.getpid()
        return outer
    raise FileExistsError(errno.EEXIST, "no free name for a private segment directory")


def resolve(mount: str) -> str:
    """The segment directory to use under ``mount`` (made on first use). Raises OSError
    if the mount is shared and no private directory can be made or checked in it."""
    with _lock:
        found = _resolved.get(mount)
        if found is not None and (_state["closed"] or os.path.isdir(found) or not (
                found == mount or _made.get(os.path.dirname(found)) == os.getpid())):
            # Never remade once removed at exit, nor by a process that did not make it
            # (vLLM may SIGKILL an EngineCore: it would be left behind). Stock path.
            return found
        if _is_private(os.lstat(mount)) and _parent_is_safe(mount):
            _resolved[mount] = mount
            return mount
        inherited = os.environ.get(ENV, "")
        if inherited and os.path.dirname(inherited) == os.path.abspath(mount):
            try:
                _check_dir(inherited)
                _check_dir(os.path.join(inherited, INNER))
                found = os.path.join(inherited, INNER)
            except OSError:
                found = None  # not ours (or gone): make our own
        if found is None:
            outer = _make(mount)
            os.environ[ENV] = outer  # the EngineCore and workers vLLM starts inherit it
            found = os.path.join(outer, INNER)
        _resolved[mount] = found
        return found


def made_here() -> bool:
    """True if this process made a private directory (it is process 0 of its server)."""
    return os.getpid() in _made.values()


def remove_made() -> int:
    """Remove the private directories this process made (at exit); how many. Never raises."""
    removed = 0
    with _lock:
        for outer, pid in list(_made.items()):
            if pid != os.getpid():
                continue  # a forked child: the maker removes it
            shutil.rmtree(outer, ignore_errors=True)
            removed += not os.path.lexists(outer)
            _made.pop(outer, None)
            _state["closed"] = True
        if os.environ.get(ENV) and not os.path.lexists(os.environ[ENV]):
            os.environ.pop(ENV, None)
    return removed


def read_owner(outer: str) -> tuple[int, int, int] | None:
    """The maker recorded in ``outer``'s owner file, or None. Never blocks (on a FIFO)."""
    try:
        fd = os.open(os.path.join(outer, OWNER_FILE),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            pidns, pid, start = (int(x) for x in f.read(64).split())
    except (OSError, ValueError):
        return None
    return pidns, pid, start


def sweep_dead(mount: str) -> int:
    """Remove this uid's private directories in ``mount`` whose maker (in this PID
    namespace) is certainly dead; how many. Never raises."""
    removed = 0
    ns = pid_namespace()
    try:
        with os.scandir(mount) as it:
            names = [e.name for e in it if e.name.startswith(PREFIX)]
    except OSError:
        return 0
    for name in names:
        outer = os.path.join(mount, name)
        try:
            _check_dir(outer)
        except OSError:
            continue
        owner = read_owner(outer)
        if owner is None or owner[0] != ns or not owner_is_dead(owner[1], owner[2]):
            continue
        shutil.rmtree(outer, ignore_errors=True)
        removed += not os.path.lexists(outer)
    return removed


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)
