# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: an isolated segment directory, stats directory and process
state per test; the session's clean-up of stock vLLM's /dev/shm leftovers.
Helpers that tests import live in ``helpers.py``."""

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time

import pytest


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
    from vllm._shm_embeds import counters, process

    # Fresh process state per test (as a forked child gets): counters and
    # owned segments of one test never leak into the next.
    monkeypatch.setattr(process, "_state", process.Process())
    monkeypatch.setattr(counters, "_state", counters._Counters())
    try:
        yield seg_dir
        left = os.listdir(seg_dir)
        assert not left, f"segments leaked: {left}"
    finally:
        shutil.rmtree(seg_dir, ignore_errors=True)
        shutil.rmtree(stats_dir, ignore_errors=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs to stand for a nearly full /dev/shm (needs root)."""
    mnt = tmp_path / "small-shm"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


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
