# SPDX-License-Identifier: Apache-2.0
"""List what shm-embeds left in a shared-memory mount (``/dev/shm``): segment
files at its top and private segment directories (``vllm-shm-embeds-*``).

A leftover counts as ours unless its maker is certainly a live process that is
not one of ``--ours`` (another server on the same machine, still running): the
maker a segment file's name records, or a private directory's owner file (an
unreadable owner file counts as ours). Live means: of this pid namespace (or
one not recorded), and ``procfs.owner_is_dead`` says it is not gone (a pid
reused by another process, seen by its start time, is gone). Names, owner
files and liveness come from the mechanism's own functions
(``handle.SegmentName.parse``, ``private_dir.read_owner``, ``procfs``), never
from a pattern of this file.

    .venv/bin/python tools/shm_leftovers.py [--dir /dev/shm] [--ours "4242 4243"]

Prints each leftover's path. Exit status: 0 nothing of ours left, 3 something
is left; anything else (an import that moved, an unreadable mount) means the
check itself failed, and ``scripts/main_job.sh`` fails the job on it.
"""

from __future__ import annotations

import argparse
import os
import sys

from vllm._shm_embeds import private_dir, procfs
from vllm._shm_embeds.handle import SegmentName

LEFT = 3  # the exit status for "something of ours is left"


def _live(pidns: int, pid: int, start: int, here: int) -> bool:
    """Whether the maker ``(pidns, pid, start)`` is certainly a live process."""
    if pidns not in (0, here) or not 0 < pid < 1 << 22:  # another namespace, or no pid
        return False
    return not procfs.owner_is_dead(pid, start)


def leftovers(mount: str, ours: set[int]) -> list[str]:
    """Paths in ``mount`` left by shm-embeds, those of live strangers excepted.

    Raises:
        OSError: ``mount`` cannot be listed.
    """
    left = []
    here = procfs.pid_namespace()
    for name in sorted(os.listdir(mount)):
        path = os.path.join(mount, name)
        parsed = SegmentName.parse(name)
        if parsed is not None:
            maker = (parsed.pidns, parsed.pid, parsed.start)
        elif name.startswith(private_dir.PREFIX):
            maker = private_dir.read_owner(path) or (0, -1, 0)
        else:
            continue
        pidns, pid, start = maker
        if pid not in ours and _live(pidns, pid, start, here):
            print(f"{path} belongs to live pid {pid} (not one of ours); ignored",
                  file=sys.stderr)
        else:
            left.append(path)
    return left


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/dev/shm", help="the mount to look in (default /dev/shm)")
    ap.add_argument("--ours", default="", help="pids of our own servers, space-separated: "
                    "what they left counts even while they live")
    args = ap.parse_args(argv)
    left = leftovers(args.dir, {int(p) for p in args.ours.split()})
    for path in left:
        print(path)
    return LEFT if left else 0


if __name__ == "__main__":
    sys.exit(main())
