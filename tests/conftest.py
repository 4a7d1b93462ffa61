# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: an isolated segment directory and stats directory per test."""

import contextlib
import glob
import os
import shutil
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def shm_env(monkeypatch):
    """Point the mechanism at a fresh directory in /dev/shm; yield its path.

    Fails the test if anything is left in it afterwards.
    """
    seg_dir = tempfile.mkdtemp(prefix="shm-embeds-test-", dir="/dev/shm")
    stats_dir = tempfile.mkdtemp(prefix="shm-embeds-stats-")
    monkeypatch.setenv("VLLM_SHM_EMBEDS", "1")
    monkeypatch.setenv("VLLM_SHM_EMBEDS_DIR", seg_dir)
    monkeypatch.setenv("VLLM_SHM_EMBEDS_STATS_DIR", stats_dir)
    monkeypatch.setenv("VLLM_SHM_EMBEDS_MIN_BYTES", "0")
    from vllm import _shm_embeds as shm

    # Fresh process state per test (as a forked child gets): counters and
    # owned segments of one test never leak into the next.
    monkeypatch.setattr(shm, "_state", shm._Process())
    try:
        yield seg_dir
        left = os.listdir(seg_dir)
        assert not left, f"segments leaked: {left}"
    finally:
        shutil.rmtree(seg_dir, ignore_errors=True)
        shutil.rmtree(stats_dir, ignore_errors=True)


def ours_in_dev_shm() -> list[str]:
    """Files of ours directly in /dev/shm (segments use this prefix)."""
    return ours_in("/dev/shm")


def ours_in(seg_dir: str) -> list[str]:
    """Our segment names in ``seg_dir``."""
    return sorted(n for n in os.listdir(seg_dir) if n.startswith("vllm-shm-embeds"))


def new_seg_dir() -> str:
    """A private segment directory on the /dev/shm tmpfs for one engine run.

    Tests point ``VLLM_SHM_EMBEDS_DIR`` at it so concurrent jobs on the same
    machine cannot make a leak check pass or fail.
    """
    return tempfile.mkdtemp(prefix="shm-embeds-it-", dir="/dev/shm")


def engine_env(shm_on: bool, seg_dir: str, stats_dir) -> dict:
    """Environment for one engine run: the plugin on or off, its segment and
    stats dirs, a 1 KiB threshold (the tiny model's prompts are small), and
    the CPU backend's settings for TP on 2 cores."""
    return dict(
        os.environ,
        VLLM_SHM_EMBEDS="1" if shm_on else "0",
        VLLM_SHM_EMBEDS_DIR=seg_dir,
        VLLM_SHM_EMBEDS_MIN_BYTES="1024",
        VLLM_SHM_EMBEDS_STATS_DIR=str(stats_dir),
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"),
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    )


_SESSION_START = time.time()


def pytest_sessionfinish(session, exitstatus):
    """Remove what stock vLLM's CPU backend leaves in /dev/shm after the engines
    these tests stopped (``vllm_dist_*``, not ours): only files created during
    this session that no live process still maps."""
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith("vllm_dist_")]
    except OSError:
        return
    fresh = []
    for n in names:
        try:
            if os.stat(os.path.join("/dev/shm", n)).st_mtime >= _SESSION_START:
                fresh.append(n)
        except OSError:
            pass
    if not fresh:
        return
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.rsplit("/", 1)[-1].strip() for line in f if "vllm_dist_" in line)
        except OSError:
            pass
    for n in fresh:
        if n not in mapped:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", n))
