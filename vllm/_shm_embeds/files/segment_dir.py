# SPDX-License-Identifier: Apache-2.0
"""What is in the segment directory: names like ours, whose files they are,
the bytes they hold, the dead owners' segments swept, the file system's room.

A name like ours proves nothing (the directory is usually ``/dev/shm``, mode
1777): only regular files of this user count (:func:`our_file`). The budget
counts :func:`held_bytes` through ``census.Census``; ``files/segment.py`` makes and
maps the files themselves.

Knows segment names and files, not vLLM and not HTTP.
"""

from __future__ import annotations

import os
import stat

from vllm._shm_embeds.files.segment import unlink_quietly
from vllm._shm_embeds.handle import SegmentName
from vllm._shm_embeds.procfs import owner_is_dead


def our_file(st: os.stat_result) -> bool:
    """True if ``st`` (from ``os.lstat``) is a regular file of this process's
    user: the only kind of file a segment of ours can be. Directories,
    symlinks, FIFOs and other users' files at names like ours are someone
    else's and are neither counted nor removed."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def list_segments(directory: str) -> list[tuple[str, SegmentName]]:
    """Every name like ours in ``directory`` with its parsed name (parts
    included); whose file it is is not checked (:func:`our_file`)."""
    out = []
    try:
        with os.scandir(directory) as it:
            for entry in it:
                parsed = SegmentName.parse(entry.name)
                if parsed is not None:
                    out.append((entry.name, parsed))
    except OSError:
        pass
    return out


def sweep(directory: str, pidns: int) -> int:
    """Unlink the files of segments in ``directory`` whose owner is certainly dead.

    Only names in PID namespace ``pidns`` are judged (another container's
    pids mean nothing here); see ``procfs.owner_is_dead``. Only regular files
    of this user (``lstat``, :func:`our_file`) are removed: anything else
    at such a name (a directory, a symlink, another user's file) is left
    alone. Never raises. Returns the number of segments (file 0s) removed.
    """
    removed = 0
    verdict: dict[tuple[int, int], bool] = {}
    for n, parsed in list_segments(directory):
        if parsed.pidns != pidns:
            continue
        path = os.path.join(directory, n)
        try:
            if not our_file(os.lstat(path)):
                continue
            key = (parsed.pid, parsed.start)
            if key not in verdict:
                verdict[key] = owner_is_dead(parsed.pid, parsed.start)
            if verdict[key] and unlink_quietly(path):
                removed += parsed.part == 0
        except (OSError, ValueError, OverflowError):
            continue  # gone meanwhile, or cannot tell: keep it
    return removed


def held_bytes(directory: str, owners: set[int] | None = None,
               pidns: int | None = None) -> int:
    """Bytes our segment files in ``directory`` hold now (allocated blocks: a
    body still arriving counts by what it has written); with ``owners``, only
    the files of those pids in PID namespace ``pidns``. Only regular files
    of this user count (``lstat``: a symlink or another user's file at a
    name like ours is not ours)."""
    held = 0
    for name, parsed in list_segments(directory):
        if owners is not None and (parsed.pid not in owners or parsed.pidns != pidns):
            continue
        try:
            st = os.lstat(os.path.join(directory, name))
        except OSError:  # unlinked meanwhile
            continue
        if our_file(st):
            held += st.st_blocks * 512
    return held


def used_bytes(directory: str) -> int:
    """Bytes in use on ``directory``'s file system (``statvfs``; 0 if unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def free_bytes(directory: str) -> int:
    """Free bytes of ``directory``'s file system (-1 if unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize
