# SPDX-License-Identifier: Apache-2.0
"""Issue 22: the budget never walks the segment directory on the event loop.

Any local user may plant names like ours in ``/dev/shm`` by the million; the
budget (``transfer.check_budget``) is asked on the API server's event loop
for every binary body and each of its grants. ``census.Census`` walks there
only once, then off the loop; other threads walk as before (exact).
"""

import asyncio
import os
import threading
import time

import torch
from helpers import wait_until

from vllm._shm_embeds import census, process, segment_dir, transfer
from vllm._shm_embeds import segment as seg
from vllm._shm_embeds.handle import SegmentName
from vllm._shm_embeds.procfs import pid_namespace


def _walks(monkeypatch) -> list:
    """Record the thread of every walk of the directory."""
    seen = []
    real = segment_dir.held_bytes

    def held_bytes(directory, *a, **k):
        seen.append(threading.current_thread())
        return real(directory, *a, **k)

    monkeypatch.setattr(segment_dir, "held_bytes", held_bytes)
    return seen


def _background_walks_end() -> None:
    wait_until(lambda: not any(t.name == "shm-embeds-census" for t in threading.enumerate()),
               10, "the census's background walk to end")


def test_event_loop_never_walks_after_the_first_count(shm_env, monkeypatch):
    """After the first count, every budget check on the loop returns at once
    (a walk runs on a thread of its own) and still counts what this process
    wrote meanwhile. Fails on a4123c0, whose every check walked the
    directory on the calling thread.

    No timing: every walk after the first is held until the loop's checks
    are done; a check that walked on the loop, or waited for a walk, would
    wait out that hold (recorded) instead of returning."""
    walks, waited_out, gate = [], [], threading.Event()
    real = segment_dir.held_bytes

    def held_bytes(directory, *a, **k):
        walks.append(threading.current_thread())
        if len(walks) > 1 and not gate.wait(30):
            waited_out.append(threading.current_thread())
        return real(directory, *a, **k)

    monkeypatch.setattr(segment_dir, "held_bytes", held_bytes)
    monkeypatch.setenv("VLLM_SHM_EMBEDS_MAX_BYTES", str(1 << 20))
    monkeypatch.setattr(census, "MIN_INTERVAL_S", 0.0)

    async def run():
        loop_thread = threading.current_thread()
        transfer.check_budget(1)  # the first count: one walk here
        assert walks == [loop_thread]
        made.append(transfer.create_segment(torch.zeros(600 << 10, dtype=torch.uint8)))
        for _ in range(20):
            transfer.check_budget(1)
        try:  # 600 KiB written by this process counts at once, walk or not
            transfer.check_budget(600 << 10)
            raise AssertionError("over the budget, yet allowed")
        except seg.BudgetExceeded:
            pass
        # a check once the next walk is due starts it, on a thread, held there
        wait_until(lambda: transfer.check_budget(1) or len(walks) >= 2, 10,
                   "a walk off the loop")
        assert all(t is not loop_thread for t in walks[1:]), walks
        assert not waited_out, "a check on the loop waited for a walk"

    made: list = []
    try:
        asyncio.run(run())
    finally:
        gate.set()
        _background_walks_end()
        for handle, fds in made:
            for fd in fds:
                os.close(fd)
            seg.unlink_segment(shm_env, handle.name, len(handle.parts()))
    assert not waited_out


def test_off_the_loop_the_count_is_exact(shm_env, monkeypatch):
    """Other threads (the EngineCore's, tests) walk each time, as before."""
    walks = _walks(monkeypatch)
    transfer.check_budget(1)
    transfer.check_budget(1)
    assert len(walks) == 2


def test_planted_names_are_neither_counted_nor_walked_on_the_loop(shm_env, monkeypatch):
    """Thousands of names like ours planted (directories, symlinks to a big
    file): the loop pays one walk at most, and none of them counts."""
    big = os.path.join(shm_env, "big")
    with open(big, "wb") as f:
        f.truncate(1 << 30)
    ns = pid_namespace()
    for i in range(2000):
        name = os.path.join(shm_env, str(SegmentName(ns, 1, 1, i)))
        if i % 2:
            os.mkdir(name)
        else:
            os.symlink(big, name)
    c = process.current().census(shm_env)
    assert c.held() == 0

    async def on_loop():
        t0 = time.monotonic()
        for _ in range(200):
            assert c.held() == 0
        return time.monotonic() - t0

    assert asyncio.run(on_loop()) < 0.5
    _background_walks_end()
    for name in os.listdir(shm_env):
        p = os.path.join(shm_env, name)
        if os.path.isdir(p) and not os.path.islink(p):
            os.rmdir(p)
        else:
            os.unlink(p)
