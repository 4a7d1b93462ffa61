# SPDX-License-Identifier: Apache-2.0
"""The budget never walks the segment directory on its caller's thread.

The budget (``transfer.check_budget``) is asked on the API server's event
loop for every binary body and each of its grants, and on the EngineCore's
busy loop for every hop-2 copy. ``census.Census`` counts what this process
wrote at once and reconciles the rest by walks on a thread of its own.
"""

import asyncio
import os
import threading
import time

import torch
from helpers import wait_until

from vllm._shm_embeds.files import census, segment_dir
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.handle import SegmentName
from vllm._shm_embeds.lifetime import process, transfer
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


def test_no_check_walks_on_its_callers_thread(shm_env, monkeypatch):
    """On the event loop and off it, every budget check returns without a
    walk on the calling thread (walks run on a thread of their own) and
    still counts what this process wrote meanwhile.

    No timing: every walk after the first is held until the checks are done;
    a check that walked on its thread, or waited for a walk, would wait out
    that hold (recorded) instead of returning."""
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
    made: list = []

    def checks(caller):
        # the census's first walk (started when it is made) must not overlap the
        # write below: a walk that does may count it twice until the next
        # (on the safe side; files/census.py), which would make this test's count wrong
        process.current().census(shm_env)
        _background_walks_end()
        made.append(transfer.create_segment(torch.zeros(600 << 10, dtype=torch.uint8)))
        for _ in range(20):
            transfer.check_budget(1)
        try:  # 600 KiB written by this process counts at once, walk or not
            transfer.check_budget(600 << 10)
            raise AssertionError("over the budget, yet allowed")
        except seg.BudgetExceeded:
            pass
        wait_until(lambda: transfer.check_budget(1) or len(walks) >= 2, 10,
                   "a walk off the caller's thread")
        assert all(t is not caller for t in walks), walks

    async def on_loop():
        checks(threading.current_thread())

    def release_all():
        gate.set()
        _background_walks_end()
        for handle, fds in made:
            for fd in fds:
                os.close(fd)
            seg.unlink_segment(shm_env, handle.name, len(handle.parts()))
        made.clear()

    try:
        checks(threading.current_thread())  # off the loop (the EngineCore's case)
        release_all()
        gate.clear()
        walks.clear()
        process.current().censuses.clear()
        asyncio.run(on_loop())
    finally:
        release_all()
    assert not waited_out


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
