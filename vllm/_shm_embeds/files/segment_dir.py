# SPDX-License-Identifier: Apache-2.0
"""What is in the segment directory. A name like ours proves nothing: only regular files
of this user count (:func:`our_file`)."""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable

from vllm._shm_embeds.files.segment import unlink_quietly
from vllm._shm_embeds.handle import SegmentName
from vllm._shm_embeds.procfs import owner_is_dead


def our_file(st: os.stat_result) -> bool:
    """True if ``st`` (``os.lstat``) is a regular file of this user."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def list_segments(directory: str) -> list[tuple[str, SegmentName]]:
    """Every name like ours in ``directory``, parsed (parts included; owner unchecked)."""
    out = []
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if (parsed := SegmentName.parse(entry.name)) is not None:
                    out.append((entry.name, parsed))
    except OSError:
        pass
    return out


def unlink_ours(directory: str, whose: Callable[[SegmentName], bool]) -> int:
    """Unlink our files (:func:`our_file`) whose name ``whose`` accepts; how many segments
    (by their file 0). Never raises."""
    removed = 0
    for name, parsed in list_segments(directory):
        path = os.path.join(directory, name)
        try:
            if our_file(os.lstat(path)) and whose(parsed) and unlink_quietly(path):
                removed += parsed.part == 0
        except (OSError, ValueError, OverflowError):
            continue  # gone meanwhile, or cannot tell: keep it
    return removed


def sweep(directory: str, pidns: int) -> int:
    """Unlink our files whose owner (in ``pidns``) is certainly dead; how many. Never raises."""
    dead = functools.cache(owner_is_dead)  # one verdict per owner
    return unlink_ours(directory, lambda p: p.pidns == pidns and dead(p.pid, p.start))


def held_bytes(directory: str, owners: set[int] | None = None, pidns: int | None = None) -> int:
    """Bytes (allocated blocks) our segment files in ``directory`` hold; with ``owners``,
    only those pids' in PID namespace ``pidns``."""
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
