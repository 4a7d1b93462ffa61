# SPDX-License-Identifier: Apache-2.0
"""The main job's last step (``scripts/main_job.sh --leftovers-only``, through
``tools/shm_leftovers.py``) fails the job on what we left in ``/dev/shm`` and
fails it too when the check itself cannot run; a live stranger's segment is
not ours."""

import os
import subprocess

import pytest
from helpers import REPO as ROOT

from vllm._shm_embeds import private_dir
from vllm._shm_embeds.procfs import pid_namespace, proc_start_time
from vllm._shm_embeds.handle import SegmentName

DEAD_PID = 1 << 22  # PID_MAX_LIMIT: pids stay below it, so never a live process


def _main_job(mount, out):
    env = {**os.environ, "SHM_LEFTOVERS_DIR": str(mount), "MAIN_JOB_OUT": str(out)}
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "main_job.sh"), "--leftovers-only"],
                       capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    return r.returncode, r.stdout + r.stderr


@pytest.fixture
def mount(tmp_path):
    if not os.path.exists(os.path.join(ROOT, ".venv", "bin", "python")):
        pytest.skip("no .venv (scripts/setup.sh makes it)")
    (tmp_path / "shm").mkdir()
    (tmp_path / "out").mkdir()
    return tmp_path


def _own_segment(shm, seq: int, start_delta: int = 0):
    """A segment file named for this live process (pytest's own), its start
    time off by ``start_delta`` ticks (not 0: another process that had the pid)."""
    start = proc_start_time(os.getpid()) + start_delta
    path = shm / str(SegmentName(pid_namespace(), os.getpid(), start, seq))
    path.write_bytes(b"x")
    return path


def test_nothing_left_passes_and_a_live_strangers_segment_is_not_ours(mount):
    (mount / "shm" / "vllm_dist_1234-0").write_bytes(b"")  # not ours at all
    _own_segment(mount / "shm", 1)
    (mount / "shm" / str(SegmentName(0, os.getpid(), 0, 2))).write_bytes(b"x")  # start unknown
    rc, out = _main_job(mount / "shm", mount / "out")
    assert rc == 0, out
    assert "no segment or segment directory of ours left" in out


def test_a_live_segment_of_one_of_our_servers_fails_the_job(mount):
    """The job's servers log their pids (``pid=N``): what they left counts even
    while the pid lives."""
    segment = _own_segment(mount / "shm", 3)
    (mount / "out" / "server_wide_shm.log").write_text(f"... hooks installed (pid={os.getpid()})\n")
    rc, out = _main_job(mount / "shm", mount / "out")
    assert rc == 1, out
    assert (mount / "out" / "leftovers.txt").read_text().splitlines() == [str(segment)], out


def test_what_we_left_fails_the_job(mount):
    """A dead owner's segment file, one whose pid is live but another process
    (its start time differs: the pid was reused), a private directory of a
    dead owner and one whose owner file cannot be read: each is listed, and
    the job fails."""
    shm = mount / "shm"
    segment = shm / str(SegmentName(0, DEAD_PID, 0, 7, 1))
    segment.write_bytes(b"x")
    reused = _own_segment(shm, 8, start_delta=1)
    dead, unreadable = shm / f"{private_dir.PREFIX}abc", shm / f"{private_dir.PREFIX}def"
    dead.mkdir()
    (dead / private_dir.OWNER_FILE).write_text(f"0 {DEAD_PID} 0")
    unreadable.mkdir()
    rc, out = _main_job(shm, mount / "out")
    assert rc == 1, out
    assert "still holds our segments" in out
    listed = (mount / "out" / "leftovers.txt").read_text().splitlines()
    assert sorted(listed) == sorted(map(str, (segment, reused, dead, unreadable))), out


def test_a_check_that_cannot_run_fails_the_job(mount):
    rc, out = _main_job(mount / "no-such-mount", mount / "out")
    assert rc == 1, out
    assert "the /dev/shm leftover check could not run" in out
    assert "no segment or segment directory of ours left" not in out


def test_a_planted_fifo_owner_file_never_hangs_the_check(tmp_path):
    """An ``owner`` FIFO in a ``vllm-shm-embeds-*`` directory (anyone may plant
    one on a shared mount): read as unreadable (counted ours), at once."""
    import threading

    from vllm._shm_embeds import private_dir

    outer = tmp_path / f"{private_dir.PREFIX}planted"
    outer.mkdir()
    os.mkfifo(outer / private_dir.OWNER_FILE)
    done = []
    t = threading.Thread(target=lambda: done.append(private_dir.read_owner(str(outer))),
                         daemon=True)
    t.start()
    t.join(10)
    assert done == [None]
