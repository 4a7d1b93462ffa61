# SPDX-License-Identifier: Apache-2.0
"""Names planted in the shared mount (``/dev/shm``) cost our request path nothing
(issue 55).

Anyone who can read ``/proc`` can plant names that look like ours (segment names
carry the owner's PID namespace, pid and start time) in a mount every user may
write. A tmpfs directory of 200,000 entries makes a walk, a name search, an
``O_TMPFILE`` or a sweep that lists it slow; a lookup by name stays O(1). The
request path (hop 1's send and adopt, the EngineCore's copy for hop 2, the
workers' maps, the census and the release) works only inside the server's private
directory. Measured by what it touches (Python audit events, which also see the
``renameat2`` call through ctypes), not by time: the same number of file events
with and without planted names, and none in the mount itself.
"""

import os
import sys
import threading

import pytest
import torch
from helpers import delta

from vllm._shm_embeds import counters, private_dir
from vllm._shm_embeds.handle import SegmentName, part_name
from vllm._shm_embeds.hops import hop2
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.procfs import pid_namespace, proc_start_time

# Audit events that name a path (first argument) or, for ctypes, pass it.
_PATH_EVENTS = {"open", "os.listdir", "os.scandir", "os.rename", "os.replace", "os.remove",
                "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod", "os.truncate",
                "shutil.rmtree", "glob.glob", "os.walk"}
_recording: list | None = None


def _hook(event: str, args: tuple) -> None:
    if _recording is None:
        return
    if event in _PATH_EVENTS and args:
        path = args[0]
    elif event == "ctypes.call_function" and len(args) > 1:
        path = next((a for a in args[1] if isinstance(a, (bytes, str))), None)
    else:
        return
    if isinstance(path, (bytes, str)):
        _recording.append((event, os.fsdecode(path), threading.get_ident()))


sys.addaudithook(_hook)


@pytest.fixture
def shared_mount(mount, monkeypatch, tmp_path):
    """The mechanism on ``mount`` (a 1777 directory like ``/dev/shm``), its private
    directory made (start-up), fresh process state."""
    monkeypatch.setenv("VLLM_SHM_EMBEDS", "1")
    monkeypatch.setenv("VLLM_SHM_EMBEDS_DIR", mount)
    monkeypatch.setenv("VLLM_SHM_EMBEDS_STATS_DIR", str(tmp_path / "stats"))
    monkeypatch.setenv("VLLM_SHM_EMBEDS_MIN_BYTES", "0")
    (tmp_path / "stats").mkdir()
    monkeypatch.setattr(process, "_state", process.Process())
    monkeypatch.setattr(counters, "_state", counters._Counters())
    seg_dir = private_dir.resolve(mount)
    yield mount, seg_dir
    assert os.listdir(seg_dir) == [], "segments leaked"


def _plant(mount: str, n: int) -> list[str]:
    """``n`` symlinks named as this process's segments (and their parts) would be."""
    ns, pid, start = pid_namespace(), os.getpid(), proc_start_time(os.getpid()) or 0
    names = [part_name(str(SegmentName(ns, pid, start, i)), i % 3) for i in range(n)]
    names += [private_dir.PREFIX + f"{i:016x}" for i in range(n // 10)]
    for name in names:
        os.symlink("/nonexistent", os.path.join(mount, name))
    return names


def _request_path() -> list[tuple[str, str, int]]:
    """One request's files, end to end, on this process (the roles are functions):
    hop 1 (share, adopt by rename), the EngineCore's copy of a decoded,
    non-contiguous tensor for hop 2 (two readers), the readers' maps, the census,
    the release and the sweep of dead owners. The file events meanwhile (event, path,
    thread)."""
    global _recording
    _recording = []
    try:
        before = counters.stats()
        sent = transfer.share_tensor(torch.randn(64, 48))
        adopted = transfer.adopt_tensor(sent)
        decoded = torch.randn(48, 256).t()  # transposed: vLLM's loader keeps it so
        handles = [hop2.externalize(t, readers=2) for t in (adopted, decoded)]
        views = [hop2.internalize(h, r) for h in handles for r in (0, 1)]
        assert torch.equal(views[0], adopted) and torch.equal(views[3], decoded)
        d = delta(before, counters.stats())
        assert d.get("copied_bytes", 0) == adopted.nbytes + decoded.nbytes, d  # shm carried
        del views
        process.collect()
        for t in (adopted, decoded):
            transfer.release_adopted(t)
        process.collect()
        process.sweep_stale_segments()
        return _recording
    finally:
        _recording = None


def _in_mount(events, mount: str) -> list[tuple[str, str]]:
    """The events that name the mount or an entry of it."""
    top = os.path.abspath(mount)
    return [(e, p) for e, p, _ in events
            if os.path.abspath(p) == top or os.path.dirname(os.path.abspath(p)) == top]


def test_planted_names_cost_the_request_path_nothing(shared_mount):
    mount, _ = shared_mount
    _request_path()  # first use: imports, the stats files, libc's symbols
    clean = _request_path()
    planted = _plant(mount, 2000)
    attacked = _request_path()
    assert clean and not _in_mount(clean, mount) and not _in_mount(attacked, mount), \
        _in_mount(attacked, mount)[:5]
    # O(1) in what others plant: the same events on the request's thread, whatever
    # the mount holds (the census walks the private directory on a thread of its own,
    # when its timer says).
    me = threading.get_ident()
    assert sorted(e for e, _, t in attacked if t == me) == sorted(e for e, _, t in clean if t == me)
    assert sorted(os.listdir(mount)) == sorted(
        planted + [os.path.basename(os.path.dirname(private_dir.resolve(mount)))])


def test_the_check_sees_a_path_that_works_in_the_mount(shared_mount, monkeypatch):
    """The check can fail: with segments placed in the mount itself (as if the
    private directory were not used), the request path is found touching it."""
    mount, _ = shared_mount
    monkeypatch.setattr(private_dir, "_resolved", {mount: mount})
    _plant(mount, 10)
    assert _in_mount(_request_path(), mount)
