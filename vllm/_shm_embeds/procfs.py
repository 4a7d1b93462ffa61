# SPDX-License-Identifier: Apache-2.0
"""Processes seen through ``/proc``; every reader here answers "cannot tell" on the safe
side. Knows ``/proc`` only: no segment file, not vLLM, not HTTP.
"""

from __future__ import annotations

import os


def pid_namespace() -> int:
    """This process's PID namespace id (inode of ``/proc/self/ns/pid``), or 0."""
    try:
        return int("".join(c for c in os.readlink("/proc/self/ns/pid") if c.isdigit()) or 0)
    except OSError:
        return 0


def proc_stat(pid: int) -> list[bytes] | None:
    """Fields 3 onwards of ``/proc/<pid>/stat`` (``proc(5)``: [0] state, [1] parent pid,
    [19] start time in clock ticks since boot); None if gone, unreadable or a zombie.
    Raises ValueError: the file does not read as ``proc(5)`` says."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 2 (comm) may contain spaces and parentheses: split after the last ')'.
    head, paren, tail = stat.rpartition(b")")
    fields = tail.split()
    if not paren or len(fields) < 20:
        raise ValueError(f"unexpected /proc/{pid}/stat")
    if fields[0] in (b"Z", b"X"):
        return None
    return fields


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None and ValueError as :func:`proc_stat`."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields is not None else None


def owner_is_dead(pid: int, start: int) -> bool:
    """True only when process ``pid``, started at ``start`` (clock ticks since boot, 0 if
    unknown), is certainly gone; when in doubt (``/proc`` unreadable, ``start`` 0) False."""
    if not 0 < pid < 1 << 22:  # PID_MAX_LIMIT: no such process can exist
        return False  # not a name of ours: keep it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb"):
            pass
        now = proc_start_time(pid)
    except (OSError, ValueError):
        return False  # /proc unreadable here, or unexpected: cannot tell, keep it
    if now is None:
        return True  # zombie, or exited between the two reads
    return start != 0 and now != start
