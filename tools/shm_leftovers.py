# SPDX-License-Identifier: Apache-2.0
"""List what shm-embeds left in a shared-memory mount (``/dev/shm``): segment
files at its top and private segment directories (``vllm-shm-embeds-*``).

A leftover counts as ours unless it carries the pid of a live process that is
not one of ``--ours`` (another server on the same machine, still running):
segment files by the pid in their name, private directories by the pid in
their owner file (an unreadable owner file counts as ours). Names are parsed by
the mechanism's own functions (``handle.SegmentName.parse``,
``private_dir.read_owner``), never by a pattern of this file.

    .venv/bin/python tools/shm_leftovers.py [--dir /dev/shm] [--ours "4242 4243"]

Prints each leftover's path. Exit status: 0 nothing of ours left, 3 something
is left; anything else (an import that moved, an unreadable mount) means the
check itself failed, and ``scripts/main_job.sh`` fails the job on it.
"""

from __future__ import annotations

import argparse
import os
import sys

from vllm._shm_embeds import private_dir
from vllm._shm_embeds.handle import SegmentName

LEFT = 3  # the exit status for "something of ours is left"


def leftovers(mount: str, ours: set[int]) -> list[str]:
    """Paths in ``mount`` left by shm-embeds, those of live strangers excepted.

    Raises:
        OSError: ``mount`` cannot be listed.
    """
    left = []
    for name in sorted(os.listdir(mount)):
        path = os.path.join(mount, name)
        parsed = SegmentName.parse(name)
        if parsed is not None:
            pid = parsed.pid
        elif name.startswith(private_dir.PREFIX):
            owner = private_dir.read_owner(path)
            pid = owner[1] if owner else -1
        else:
            continue
        if pid not in ours and pid > 0 and os.path.exists(f"/proc/{pid}"):
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
