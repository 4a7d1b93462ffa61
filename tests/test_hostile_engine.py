# SPDX-License-Identifier: Apache-2.0
"""Hostile names in a world-writable segment directory, and errors on the
EngineCore's side: nothing of ours escapes into vLLM's threads,
adoption is never steered by a planted name, only our own files count or go,
per-process caps.

Unit level: ``hop1.HandleOOBProvider`` (vLLM's input-socket thread calls it
for every out-of-band tensor), ``transfer.adopt_tensor``, ``segment_dir.sweep``
and ``segment_dir.held_bytes``. Counters are read with ``counters.stats()``.
"""

import itertools
import os
import shutil
import subprocess

import pytest
import torch
from helpers import set_limits

from vllm._shm_embeds import counters
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.files import segment_dir
from vllm._shm_embeds.handle import SegmentName, part_name
from vllm._shm_embeds.hops import hop1
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.ext.digests import streamed
from vllm._shm_embeds.procfs import pid_namespace

NOBODY = 65534


def _stat(name: str) -> int:
    return counters.stats().get(name, 0)


class _Inner:
    """vLLM's own provider (multimodal tensors): records what it was given."""

    def __init__(self):
        self.calls = 0

    def __call__(self, dtype, shape, meta):
        self.calls += 1
        return torch.zeros(shape)


def _deterministic_names(monkeypatch):
    """Make the names this process draws next predictable (0, 1, 2, ...), as
    an attacker who guessed them would have them: returns the function that
    gives the name of sequence number ``i``."""
    it = itertools.count()
    if hasattr(process, "secrets"):  # names from a counter: as predictable as can be
        monkeypatch.setattr(process.secrets, "randbits", lambda bits: next(it))
    state = process.current()
    first = SegmentName.parse(state.new_name())  # sets the tag
    return lambda i: str(SegmentName(first.pidns, first.pid, first.start, i))


def _send(tensor):
    """Hop 1 sender: a segment holding ``tensor`` and its metadata."""
    consumer = hop1.HandleOOBConsumer()
    consumer.arm(tensor)
    meta = consumer(tensor)
    assert meta is not None and hop1.META_KEY in meta
    return meta


def _plant_dirs(shm_env, names):
    for n in names:
        os.mkdir(os.path.join(shm_env, n))


def _remove(shm_env, names):
    for n in names:
        path = os.path.join(shm_env, n)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)


def test_planted_directories_at_next_names_never_stop_the_input_thread(shm_env, monkeypatch):
    name_of = _deterministic_names(monkeypatch)
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    meta = _send(t)  # takes sequence number 1
    planted = [name_of(i) for i in range(2, 6)]  # the EngineCore's next names
    _plant_dirs(shm_env, planted)
    provider = hop1.HandleOOBProvider(_Inner())
    got = provider("float32", (8, 8), meta)  # must not raise (old code: IsADirectoryError)
    assert provider.is_failed(got) is None and torch.equal(got, t)
    assert _stat("adopt_names_taken") == 4 and _stat("fallback.hop1.adopt_failed") == 0
    assert all(os.path.isdir(os.path.join(shm_env, n)) for n in planted)  # left alone
    # the next call into the provider works: a text request's tensors, another embeds one
    assert provider.inner.calls == 0
    provider("float32", (2,), {"other": 1})
    assert provider.inner.calls == 1
    got2 = provider("float32", (8, 8), _send(t * 2))
    assert torch.equal(got2, t * 2)
    del got, got2
    process.collect()
    process.current().owned.unlink_all()
    _remove(shm_env, planted)


def test_every_name_taken_fails_the_request_cleanly(shm_env, monkeypatch):
    name_of = _deterministic_names(monkeypatch)
    t = torch.ones(4, 4)
    meta = _send(t)  # sequence number 1
    planted = [name_of(i) for i in range(2, 2 + transfer.ADOPT_NAME_TRIES)]
    _plant_dirs(shm_env, planted)
    provider = hop1.HandleOOBProvider()
    got = provider("float32", (4, 4), meta)
    assert provider.is_failed(got) == hop1.ADOPT_FAILED_MESSAGE
    assert _stat("fallback.hop1.adopt_failed") == 1
    assert not os.path.exists(os.path.join(shm_env, meta[hop1.META_KEY]["name"]))  # no leak
    _remove(shm_env, planted)
    # afterwards (the planted names gone or not) the next request is adopted
    got = provider("float32", (4, 4), _send(t))
    assert provider.is_failed(got) is None and torch.equal(got, t)
    del got
    process.collect()


@pytest.mark.parametrize("kind", ["foreign_file", "symlink"])
def test_planted_file_at_next_name_is_never_replaced(shm_env, monkeypatch, kind, tmp_path):
    name_of = _deterministic_names(monkeypatch)
    t = torch.full((4, 4), 3.0)
    meta = _send(t)
    target = name_of(2)
    path = os.path.join(shm_env, target)
    if kind == "foreign_file":
        with open(path, "wb") as f:
            f.write(b"not yours")
        if os.geteuid() == 0:
            os.chown(path, NOBODY, NOBODY)
    else:
        victim = tmp_path / "victim"
        victim.write_bytes(b"precious")
        os.symlink(victim, path)
    provider = hop1.HandleOOBProvider()
    got = provider("float32", (4, 4), meta)
    assert provider.is_failed(got) is None and torch.equal(got, t)
    st = os.lstat(path)  # still the planted thing, untouched
    if kind == "foreign_file":
        with open(path, "rb") as f:
            assert f.read() == b"not yours"
    else:
        assert os.path.islink(path) and (tmp_path / "victim").read_bytes() == b"precious"
    assert st is not None
    del got
    process.collect()
    process.current().owned.unlink_all()
    os.unlink(path)


def test_adoption_oserror_becomes_a_failed_request(shm_env, monkeypatch):
    """EMFILE, ENOMEM or any other error of adoption: a failed tensor, counted;
    the peer's files are removed; the next call works."""
    t = torch.ones(8, 8)
    provider = hop1.HandleOOBProvider()
    for err in (OSError(24, "Too many open files"), ValueError("odd"), MemoryError()):
        meta = _send(t)

        def boom(*a, err=err, **k):
            raise err

        with monkeypatch.context() as m:
            m.setattr(seg, "rename_noreplace", boom, raising=False)
            m.setattr(transfer.os, "rename", boom)
            got = provider("float32", (8, 8), meta)
        assert provider.is_failed(got) == hop1.ADOPT_FAILED_MESSAGE
        assert not os.path.exists(os.path.join(shm_env, meta[hop1.META_KEY]["name"]))
    assert _stat("fallback.hop1.adopt_failed") == 3
    got = provider("float32", (8, 8), _send(t))
    assert torch.equal(got, t)
    del got
    process.collect()


def test_mapping_failure_reads_into_memory(shm_env, monkeypatch):
    """ENOMEM from mmap (vm.max_map_count): the bytes are read into private
    memory (what stock holds) instead of failing the request."""
    t = torch.randn(16, 8)
    meta = _send(t)

    def enomem(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(seg, "map_files", enomem)
    provider = hop1.HandleOOBProvider()
    got = provider("float32", (16, 8), meta)
    assert provider.is_failed(got) is None and torch.equal(got, t)
    assert _stat("fallback.hop1.map_failed") == 1
    assert [n for n in os.listdir(shm_env)] == []  # the files went


def test_malformed_metadata_never_raises(shm_env):
    provider = hop1.HandleOOBProvider()
    bad = [None, [], "x", {"name": 1}, {"name": "vllm-shm-embeds.1.1.1.1", "dtype": "float32",
                                          "shape": [-1, -4]},
           {"name": "vllm-shm-embeds.1.1.1.1", "dtype": "float32", "shape": "12"},
           {"name": "vllm-shm-embeds.1.1.1.1", "dtype": "float32", "shape": [1e309]},
           {"name": "vllm-shm-embeds.1.1.1.1", "dtype": "float32", "shape": [2],
            "digests": {"block": 1, "rows": 2, "digests": 10**12}}]
    for m in bad:
        got = provider("float32", (2,), {hop1.META_KEY: m})
        assert provider.is_failed(got) == hop1.ADOPT_FAILED_MESSAGE
    # metadata without our key and no inner provider: a failed tensor, not a raise
    got = provider("float32", (2,), {"x": 1})
    assert provider.is_failed(got) == hop1.ADOPT_FAILED_MESSAGE


def test_segment_cap_takes_the_stock_path(shm_env, monkeypatch):
    set_limits(monkeypatch, MAX_SEGMENTS=2)
    kept = [streamed.streamed_tensor_like(torch.float32, (4, 4)) for _ in range(2)]
    # sender: a third segment is over the cap: the stock path, counted
    consumer = hop1.HandleOOBConsumer()
    t = torch.ones(4, 4)
    consumer.arm(t)
    assert consumer(t) is None
    assert _stat("fallback.hop1.segments") == 1
    # receiver: adopts by reading into memory beyond the cap; the files go
    set_limits(monkeypatch, MAX_SEGMENTS=100)
    meta = _send(t)
    set_limits(monkeypatch, MAX_SEGMENTS=2)
    provider = hop1.HandleOOBProvider()
    got = provider("float32", (4, 4), meta)
    assert provider.is_failed(got) is None and torch.equal(got, t)
    assert _stat("fallback.hop1.segments") == 2
    assert not os.path.exists(os.path.join(shm_env, meta[hop1.META_KEY]["name"]))
    for k in kept:
        transfer.release_streamed(k)
    del kept
    process.collect()


def _foreign_pid() -> int:
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True)
    return int(dead.stdout)


def test_held_bytes_counts_only_our_regular_files(shm_env, tmp_path):
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.write(os.urandom(1 << 20))  # 1 MiB of real blocks
    ns = pid_namespace()
    pid = _foreign_pid()
    planted = {
        "link": str(SegmentName(ns, pid, 1, 1)),
        "dir": str(SegmentName(ns, pid, 1, 2)),
        "foreign": str(SegmentName(ns, pid, 1, 3)),
    }
    os.symlink(big, os.path.join(shm_env, planted["link"]))
    os.mkdir(os.path.join(shm_env, planted["dir"]))
    with open(os.path.join(shm_env, planted["foreign"]), "wb") as f:
        f.write(b"x" * (1 << 20))
    if os.geteuid() == 0:
        os.chown(os.path.join(shm_env, planted["foreign"]), NOBODY, NOBODY)
    else:
        _remove(shm_env, [planted.pop("foreign")])
    try:
        assert segment_dir.held_bytes(shm_env) == 0
        assert segment_dir.held_bytes(shm_env, {pid}, ns) == 0
        transfer.check_budget(1)  # nothing of ours is held
    finally:
        _remove(shm_env, planted.values())


def test_sweep_never_raises_and_touches_only_our_files(shm_env, tmp_path):
    ns = pid_namespace()
    pid = _foreign_pid()  # dead
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    junk = {
        "dir": str(SegmentName(ns, pid, 1, 1)),
        "link": str(SegmentName(ns, pid, 1, 2)),
        "foreign": str(SegmentName(ns, pid, 1, 3)),
        "huge_pid": str(SegmentName(ns, 10**19, 1, 4)),
        "ours": str(SegmentName(ns, pid, 1, 5)),
    }
    os.mkdir(os.path.join(shm_env, junk["dir"]))
    os.mkdir(os.path.join(shm_env, junk["dir"], "x"))  # rmdir would fail too
    os.symlink(victim, os.path.join(shm_env, junk["link"]))
    for k in ("foreign", "huge_pid", "ours"):
        with open(os.path.join(shm_env, junk[k]), "wb") as f:
            f.write(b"y")
    if os.geteuid() == 0:
        os.chown(os.path.join(shm_env, junk["foreign"]), NOBODY, NOBODY)
    removed = process.sweep_stale_segments()  # must not raise
    assert removed == 1
    left = set(os.listdir(shm_env))
    assert junk["ours"] not in left
    assert {junk["dir"], junk["link"], junk["huge_pid"]} <= left
    if os.geteuid() == 0:
        assert junk["foreign"] in left
    assert victim.read_bytes() == b"precious"
    _remove(shm_env, left)


def test_plugin_start_up_survives_planted_junk(shm_env, monkeypatch, caplog):
    """The start-up sweep (after the patches are installed) never makes the
    plugin log "not enabled"."""
    from vllm._shm_embeds import plugin, sites
    from vllm._shm_embeds.sites import site

    ns = pid_namespace()
    junk = str(SegmentName(ns, _foreign_pid(), 1, 1))
    os.mkdir(os.path.join(shm_env, junk))
    os.mkdir(os.path.join(shm_env, junk, "x"))
    monkeypatch.setattr(site, "STATUS", {})
    monkeypatch.setattr(plugin, "STATUS", site.STATUS)
    monkeypatch.setattr(sites, "apply", lambda **kw: site.STATUS.update(hop1=[], hop2=[]))
    called = []
    monkeypatch.setattr(plugin.logger, "exception", lambda *a, **k: called.append(a))
    plugin.register()
    assert not called
    _remove(shm_env, [junk])


def test_unlink_all_leaves_planted_names_with_our_tag(shm_env):
    state = process.current()
    tag = SegmentName.parse(state.new_name())
    name = str(SegmentName(tag.pidns, tag.pid, tag.start, 7))
    os.mkdir(os.path.join(shm_env, name))
    os.mkdir(os.path.join(shm_env, name, "x"))
    state.owned.unlink_all()  # must not raise
    assert os.path.isdir(os.path.join(shm_env, name))
    _remove(shm_env, [name])


def test_adopt_never_follows_a_planted_source(shm_env, tmp_path):
    """A handle naming something that is not a regular file of ours (a
    symlink at the sender's name) is refused; the target is not read."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * (4096 + 64))
    ns = pid_namespace()
    name = str(SegmentName(ns, os.getpid(), 1, 12345))
    os.symlink(victim, os.path.join(shm_env, name))
    provider = hop1.HandleOOBProvider()
    got = provider("float32", (16,), {hop1.META_KEY: {"name": name, "dtype": "float32",
                                                          "shape": [16]}})
    assert provider.is_failed(got) == hop1.ADOPT_FAILED_MESSAGE
    assert victim.exists()
    _remove(shm_env, [name, part_name(name, 0)])
