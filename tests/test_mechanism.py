# SPDX-License-Identifier: Apache-2.0
"""Unit tests of the mechanism (``vllm/_shm_embeds/``): handles, segments, lifetime."""

import errno
import multiprocessing as mp
import os
import pickle
import subprocess
import sys

import pytest
import torch
from helpers import delta, forked_cases, mine, run_child, set_limits

from vllm._shm_embeds import counters, handle
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.handle import SegmentName
from vllm._shm_embeds.hops import hop1, hop2
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.procfs import pid_namespace, proc_start_time


class _Req:
    """Stands for vLLM's NewRequestData (only ``prompt_embeds`` matters)."""

    def __init__(self, prompt_embeds):
        self.prompt_embeds = prompt_embeds


def _reader(handles, index, q):
    try:
        out = []
        for h in handles:
            t = transfer.open_tensor(h, index)
            out.append((t.dtype, tuple(t.shape), t.float().tolist()))
        q.put(out)
    except Exception as e:  # surface to the parent
        q.put(e)


def _read_in_spawned_readers(handles, readers):
    """Open ``handles`` in ``readers`` spawned processes (reader index i each).

    Returns one ``[(dtype, shape, values)]`` list per reader.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(handles, i, q)) for i in range(readers)]
    for p in procs:
        p.start()
    results = [q.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(60)
    for r in results:
        assert not isinstance(r, Exception), r
    return results


def test_round_trip_across_spawned_readers(shm_env):
    """fp32/fp16/bf16 with 0, 1 and 37 rows, mapped by two spawned readers."""
    srcs = [
        torch.randn(rows, 48).to(dtype)
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
        for rows in (0, 1, 37)
    ]
    before = counters.stats()
    handles = [hop2.externalize(src, readers=2) for src in srcs]
    assert all(len(pickle.dumps(h)) < 300 for h in handles)
    assert [h.nbytes for h in handles] == [s.nbytes for s in srcs]
    assert delta(before, counters.stats()).get("copied_bytes", 0) == sum(s.nbytes for s in srcs)
    for r in _read_in_spawned_readers(handles, 2):
        for src, (dtype, shape, values) in zip(srcs, r):
            assert dtype == src.dtype and shape == tuple(src.shape)
            assert values == src.float().tolist()
    # Both readers set their flags, but the sources (the EngineCore's
    # requests) are alive: the names stay, so the budget counts the pages the
    # readers hold; they go when the requests are freed.
    assert process.collect() == 0 and len(os.listdir(shm_env)) == len(srcs)
    for src in srcs:  # (empty tensors share an address: found by identity)
        assert not transfer.release_adopted(src)  # a copy: no data pages here
    assert os.listdir(shm_env) == []


def test_the_public_names_round_trip(shm_env):
    """``vllm._shm_embeds``'s public names (the user's design): a tensor
    externalized for one reader, internalized there, no copy on the way back."""
    import vllm._shm_embeds as shm_embeds

    src = torch.randn(12, 16)
    h = shm_embeds.externalize(src, readers=1)
    assert isinstance(h, shm_embeds.SharedTensorHandle)
    t = shm_embeds.internalize(h, 0)
    assert torch.equal(t, src) and not t.is_set_to(src)
    del t
    assert not transfer.release_adopted(src)
    assert sorted(shm_embeds.__all__) == sorted(
        ["SharedTensorHandle", "ShmEmbedsError", "externalize", "internalize"])


def test_reused_without_copy_and_released_on_free(shm_env):
    src = torch.arange(4096, dtype=torch.float32).view(64, 64)
    h1 = hop2.externalize(src, readers=1)
    before = counters.stats()
    h2 = hop2.externalize(src, readers=1)  # same tensor, still linked
    assert h2.name == h1.name
    assert delta(before, counters.stats()).get("copied_bytes", 0) == 0
    assert delta(before, counters.stats()).get("hop2_reused_tensors", 0) == 1
    assert process.collect() == 0  # reader has not mapped it yet
    assert h2.flag_base == h1.flag_base + 1  # each broadcast has flags of its own
    t = transfer.open_tensor(h1, 0)
    assert torch.equal(t, src)
    # The first broadcast's reader is done, the second's is not: the name stays.
    assert process.collect() == 0 and os.listdir(shm_env) == [h1.name]
    assert torch.equal(transfer.open_tensor(h2, 0), src)
    assert process.collect() == 0  # both readers are done; src is still in use
    del src  # the request (the tensor the copy was made from) is gone
    assert process.collect() == 1 and os.listdir(shm_env) == []
    # The mapping stays valid after the name is gone.
    assert torch.equal(t, torch.arange(4096, dtype=torch.float32).view(64, 64))


def test_adopt_renames_to_owner_and_hop2_reuses_it(shm_env):
    src = torch.randn(10, 32)
    sent = transfer.share_tensor(src)  # hop 1 sender (owner: us, then the adopter)
    adopted = transfer.adopt_tensor(sent)
    names = os.listdir(shm_env)
    assert len(names) == 1 and names[0] != sent.name
    assert mine(names[0])
    assert torch.equal(adopted, src)
    before = counters.stats()
    h = hop2.externalize(adopted, readers=1)
    assert h.name == names[0]
    # one copy in total (at hop 1)
    assert delta(before, counters.stats()).get("copied_bytes", 0) == 0
    transfer.open_tensor(h, 0)
    assert process.collect() == 0  # the request still uses it: the name stays
    # a second broadcast (vLLM 0.33's V2 model runner re-sends on resume)
    # reuses it by name, no copy
    again = hop2.externalize(adopted, readers=1)
    assert again.name == h.name and delta(before, counters.stats()).get("copied_bytes", 0) == 0
    transfer.open_tensor(again, 0)
    del adopted
    assert process.collect() == 1 and os.listdir(shm_env) == []


def test_adopted_but_never_broadcast_is_unlinked_when_freed(shm_env):
    adopted = transfer.adopt_tensor(transfer.share_tensor(torch.randn(4, 4)))
    assert len(os.listdir(shm_env)) == 1
    del adopted  # e.g. the request was aborted before it was scheduled
    process.collect()  # the next safe point (the reaper runs one every 0.1 s)
    assert os.listdir(shm_env) == []


def _maps_of(directory):
    return [line for line in open("/proc/self/maps") if directory in line]


def test_freed_request_lets_go_of_the_engine_pages(shm_env):
    """When vLLM frees a request, the EngineCore drops its
    pages of the adopted segment, even while something (vLLM's input path
    keeps the last request it received) still holds the tensor."""
    src = torch.randn(1024, 32)
    adopted = transfer.adopt_tensor(transfer.share_tensor(src))
    h = hop2.externalize(adopted, readers=1)
    reader = transfer.open_tensor(h, 0)  # a TP worker's mapping
    # every reader mapped it, but the request runs: the name stays (the
    # budget counts the segment by its name)
    assert process.collect() == 0 and len(os.listdir(shm_env)) == 1
    del reader
    assert len(_maps_of(shm_env)) == 1  # the EngineCore's
    assert transfer.release_adopted(adopted)
    assert os.listdir(shm_env) == []
    assert _maps_of(shm_env) == [] and adopted.shape == src.shape and not adopted.any()
    assert not transfer.release_adopted(adopted)  # once
    # Freed before it was ever broadcast (aborted): unlinked and let go at once.
    other = transfer.adopt_tensor(transfer.share_tensor(src))
    assert len(os.listdir(shm_env)) == 1
    assert transfer.release_adopted(other)
    assert os.listdir(shm_env) == [] and _maps_of(shm_env) == []
    # Not ours: nothing happens.
    assert not transfer.release_adopted(src) and torch.equal(src, src.clone())
    assert counters.stats()["engine_pages_released"] == 2


def test_request_freed_while_its_broadcast_is_pending(shm_env):
    """vLLM frees a request (abort) before every TP rank mapped the step: the
    name and the EngineCore's pages go at the safe point after the readers
    are done; flags already set count at once."""
    src = torch.randn(256, 32)
    adopted = transfer.adopt_tensor(transfer.share_tensor(src))
    h = hop2.externalize(adopted, readers=2)
    reader = transfer.open_tensor(h, 0)  # rank 0 mapped, rank 1 not yet
    assert not transfer.release_adopted(adopted)  # pending: later
    assert process.collect() == 0 and len(os.listdir(shm_env)) == 1
    del reader
    transfer.open_tensor(h, 1)  # rank 1 maps, drops
    before = counters.stats()
    assert process.collect() == 1
    assert os.listdir(shm_env) == [] and _maps_of(shm_env) == []
    assert delta(before, counters.stats()).get("engine_pages_released", 0) == 1
    assert not adopted.any()
    # every flag set but no safe point yet: released at once
    adopted = transfer.adopt_tensor(transfer.share_tensor(src))
    transfer.open_tensor(hop2.externalize(adopted, readers=1), 0)
    assert transfer.release_adopted(adopted)
    assert os.listdir(shm_env) == [] and _maps_of(shm_env) == []


def test_without_free_request_names_go_once_mapped(shm_env, monkeypatch):
    """If vLLM's ``Scheduler._free_request`` site cannot be patched nothing
    says when a request ends: a name goes once every reader mapped it."""
    monkeypatch.setattr(process.current(), "release_known", False)
    adopted = transfer.adopt_tensor(transfer.share_tensor(torch.randn(64, 32)))
    reader = transfer.open_tensor(hop2.externalize(adopted, readers=1), 0)
    assert process.collect() == 1 and os.listdir(shm_env) == []
    assert torch.equal(reader, adopted)
    src = torch.randn(64, 32)
    transfer.open_tensor(hop2.externalize(src, readers=1), 0)
    assert process.collect() == 1 and os.listdir(shm_env) == []


def test_missing_segment_is_a_clear_error(shm_env):
    h = handle.SharedTensorHandle(str(SegmentName(1, 1, 1, 1)), "float32", (2, 2))
    with pytest.raises(handle.ShmEmbedsError, match="not found"):
        transfer.open_tensor(h)
    with pytest.raises(handle.ShmEmbedsError, match="not a shm-embeds segment"):
        handle.SharedTensorHandle.from_meta({"name": "../etc/x", "dtype": "float32", "shape": [1]})


def test_pread_all_fills_the_buffer_or_says_the_file_ended(tmp_path):
    """The one read loop (segments, held files, kept tensors, streamed read-backs)."""
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, bytes(range(10)))
        buf = bytearray(8)
        seg.pread_all(fd, memoryview(buf), 2)
        assert bytes(buf) == bytes(range(2, 10))
        with pytest.raises(OSError) as e:
            seg.pread_all(fd, memoryview(bytearray(9)), 2)
        assert e.value.errno == errno.EIO
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "tensor,reason",
    [
        (torch.randn(8, 8).t(), "non_contiguous"),
        (torch.randn(8, 8).to_sparse(), "sparse"),
        (torch.empty(8, 8, device="meta"), "not_cpu"),
    ],
)
def test_ineligible_tensors_keep_stock_path(shm_env, tensor, reason):
    req = _Req(tensor)
    before = counters.stats()
    assert hop2.externalize_prompt_embeds([req], readers=2) == []
    assert req.prompt_embeds is tensor
    assert delta(before, counters.stats()).get(f"fallback.hop2.{reason}", 0) == 1
    assert delta(before, counters.stats()).get("hop2_stock_tensors", 0) == 1


def test_small_tensor_keeps_stock_path(shm_env, monkeypatch):
    monkeypatch.setenv("VLLM_SHM_EMBEDS_MIN_BYTES", str(1 << 20))
    req = _Req(torch.randn(4, 4))
    assert hop2.externalize_prompt_embeds([req], readers=1) == []
    assert isinstance(req.prompt_embeds, torch.Tensor)


def test_full_dev_shm_falls_back(shm_env, monkeypatch):
    def no_space(fd, buf, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", no_space)
    tensor = torch.randn(16, 16)
    req = _Req(tensor)
    before = counters.stats()
    assert hop2.externalize_prompt_embeds([req], readers=1) == []
    assert req.prompt_embeds is tensor
    assert delta(before, counters.stats()).get("fallback.hop2.no_space", 0) == 1
    consumer = hop1.HandleOOBConsumer()
    consumer.arm(tensor)
    assert consumer(tensor) is None  # inline
    assert delta(before, counters.stats()).get("fallback.hop1.no_space", 0) == 1


def test_externalize_internalize_restore(shm_env):
    a, b = torch.randn(5, 8), torch.randn(3, 8)
    reqs = [_Req(a), _Req(None), _Req(b)]
    swapped = hop2.externalize_prompt_embeds(reqs, readers=1)
    assert len(swapped) == 2
    wire = pickle.loads(pickle.dumps(reqs))  # what a worker receives
    assert isinstance(wire[0].prompt_embeds, handle.SharedTensorHandle)
    hop2.restore_prompt_embeds(swapped)
    assert reqs[0].prompt_embeds is a and reqs[2].prompt_embeds is b
    assert hop2.internalize_prompt_embeds(wire, reader_index=0) == 2
    assert torch.equal(wire[0].prompt_embeds, a) and torch.equal(wire[2].prompt_embeds, b)
    assert process.collect() == 0  # the requests still use a and b
    for t in (a, b):
        transfer.release_adopted(t)  # vLLM freed the requests
    assert os.listdir(shm_env) == []


def test_oob_consumer_provider_round_trip(shm_env):
    tensor = torch.randn(6, 8).to(torch.bfloat16)
    consumer = hop1.HandleOOBConsumer()
    other = torch.randn(6, 8)
    assert consumer(other) is None  # not armed: not ours
    consumer.arm(tensor)
    meta = consumer(tensor)
    assert set(meta) == {hop1.META_KEY}
    provider = hop1.HandleOOBProvider()
    got = provider("bfloat16", (6, 8), meta)
    assert torch.equal(got, tensor) and provider.is_failed(got) is None
    # The same handle again: the segment was adopted, so it is gone.
    failed = provider("bfloat16", (6, 8), meta)
    message = provider.is_failed(failed)
    assert "could not be read from shared memory" in message
    # Nothing internal reaches the client: no segment name, no directory.
    assert handle.SEGMENT_PREFIX not in message and shm_env not in message
    del got
    process.collect()
    assert os.listdir(shm_env) == []


def test_sweep_removes_only_dead_owners(shm_env):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    ns, dead_pid = pid_namespace(), int(dead.stdout)
    dead_name = str(SegmentName(ns, dead_pid, 1, 0))
    me = SegmentName(ns, os.getpid(), proc_start_time(os.getpid()), 999)
    live_name = str(me)
    # Another PID namespace (a container sharing /dev/shm): never swept.
    other_ns = str(SegmentName(ns + 1, dead_pid, 1, 0))
    for name in (dead_name, live_name, other_ns):
        open(os.path.join(shm_env, name), "wb").close()
    assert process.sweep_stale_segments() == 1
    assert sorted(os.listdir(shm_env)) == sorted([live_name, other_ns])
    os.unlink(os.path.join(shm_env, live_name))
    os.unlink(os.path.join(shm_env, other_ns))


def test_shutdown_unlinks_own_segments(shm_env):
    transfer.share_tensor(torch.randn(3, 3))  # sent, never adopted
    hop2.externalize(torch.randn(3, 3), readers=2)  # broadcast, never read
    assert len(os.listdir(shm_env)) == 2
    process.shutdown()
    assert os.listdir(shm_env) == []


_PLUGIN_PROBE = """
import logging
logging.basicConfig(level=logging.INFO)
import vllm.plugins as p
p.load_general_plugins()
from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc
from vllm.v1.engine.core_client import MPClient
fns = [MultiprocExecutor.collective_rpc, WorkerProc._execute_worker_rpc, MPClient.__init__]
print(sum(bool(getattr(f, "__shm_embeds_wrapped__", False)) for f in fns))
"""


PLUGIN_CASES = [
    ("0", {}, "0"),
    ("1", {}, "3"),
    # A bad threshold is reported and defaulted, never raised into vLLM.
    ("1", {"VLLM_SHM_EMBEDS_MIN_BYTES": "1MiB"}, "3"),
    # No usable segment directory: nothing patched at all.
    ("1", {"VLLM_SHM_EMBEDS_DIR": "/nonexistent/shm"}, "0"),
]


def test_plugin_patches_only_when_enabled(tmp_path):
    """Each case in an interpreter of its own (the plugin decides at load):
    children forked after vLLM's imports (``helpers.forked_cases``)."""
    preamble = ("import vllm.plugins\n"
                "from vllm.v1.executor import multiproc_executor\n"
                "from vllm.v1.engine import core_client\n"
                "import sys; assert 'vllm._shm_embeds' not in sys.modules")
    results = forked_cases(preamble, [({"VLLM_SHM_EMBEDS": flag, **extra}, _PLUGIN_PROBE)
                                      for flag, extra, _ in PLUGIN_CASES], tmp_path)
    for (flag, extra, expected), (status, stdout, stderr) in zip(PLUGIN_CASES, results):
        assert status == 0, stderr[-2000:]
        assert stdout.strip().splitlines()[-1] == expected, (flag, extra)
        assert ("shm-embeds: off" in stdout + stderr) == (expected == "0"), (flag, extra)


def test_forked_child_does_not_own_parents_segments(shm_env):
    h = hop2.externalize(torch.randn(4, 4), readers=1)
    pid = os.fork()
    if pid == 0:  # e.g. a TP worker under the fork start method
        process.shutdown()
        os._exit(0 if process.pending_segments() == 0 and not counters.stats() else 1)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert os.listdir(shm_env) == [h.name]
    transfer.open_tensor(h, 0)
    assert process.collect() == 1


def test_sweep_treats_zombie_owner_as_dead(shm_env):
    """vLLM SIGKILLs a slow EngineCore; until reaped it is a zombie."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while proc_start_time(child.pid) is not None:
        pass  # exits, stays a zombie (not yet waited for)
    name = str(SegmentName(pid_namespace(), child.pid, 1, 0))
    open(os.path.join(shm_env, name), "wb").close()
    assert process.sweep_stale_segments() == 1
    child.wait()


@pytest.mark.parametrize("files", [1, 3])
def test_readers_cannot_change_what_others_read(shm_env, monkeypatch, files):
    """A stray in-place write in one TP rank faults there; others are unharmed."""
    monkeypatch.setattr(handle, "PART_MIN_BYTES", 4096)
    set_limits(monkeypatch, WRITERS=files)
    src = torch.zeros(3, 4096)
    h = hop2.externalize(src, readers=2)
    assert len(os.listdir(shm_env)) == files
    child = run_child("import pickle, sys\n"
                      "from vllm._shm_embeds.lifetime import transfer\n"
                      "t = transfer.open_tensor(pickle.loads(sys.stdin.buffer.read()), 0)\n"
                      "t[-1].add_(1.0)\n", h)
    assert child.returncode < 0  # killed by SIGSEGV/SIGBUS, not silently written
    assert torch.equal(transfer.open_tensor(h, 1), src)
    assert process.collect() == 0
    transfer.release_adopted(src)
    assert os.listdir(shm_env) == []


def test_vanished_segment_is_copied_again(shm_env):
    """A tmp cleaner removed an adopted segment's name: hop 2 must not send it."""
    adopted = transfer.adopt_tensor(transfer.share_tensor(torch.randn(8, 8)))
    [name] = os.listdir(shm_env)
    os.unlink(os.path.join(shm_env, name))
    h = hop2.externalize(adopted, readers=1)
    assert h.name != name
    assert torch.equal(transfer.open_tensor(h, 0), adopted)
    assert process.collect() == 0
    # vLLM frees the request: the copy's name goes and so do the EngineCore's
    # pages of the adopted segment whose name vanished
    assert transfer.release_adopted(adopted)
    assert os.listdir(shm_env) == [] and _maps_of(shm_env) == []
    assert counters.stats().get("fallback.hop2.vanished", 0) >= 1


@pytest.fixture
def striped(shm_env, monkeypatch):
    """Stripe every segment of more than one page over 3 files."""
    monkeypatch.setattr(handle, "PART_MIN_BYTES", 4096)
    set_limits(monkeypatch, WRITERS=3)
    return shm_env


def test_striped_segment_hop1_hop2_round_trip(striped):
    """3 files written by 3 threads; adopted, re-sent and read back as one tensor."""
    src = torch.randn(37, 1000)  # 148000 bytes: the last file is not page-sized
    sent = transfer.share_tensor(src)
    assert len(sent.split) == 2 and all(b % 4096 == 0 for b in sent.split)
    assert len(os.listdir(striped)) == 3
    wire = handle.SharedTensorHandle.from_meta(sent.to_meta())
    assert wire == sent
    adopted = transfer.adopt_tensor(wire)
    assert torch.equal(adopted, src)
    names = sorted(os.listdir(striped))
    assert len(names) == 3 and all(mine(n) for n in names)
    before = counters.stats()
    h = hop2.externalize(adopted, readers=2)
    assert delta(before, counters.stats()).get("copied_bytes", 0) == 0 and h.split == sent.split
    for r in _read_in_spawned_readers([h], 2):
        assert r[0][2] == src.tolist()
    assert process.collect() == 0 and len(os.listdir(striped)) == 3
    assert transfer.release_adopted(adopted)
    assert os.listdir(striped) == []


def test_striped_segment_private_tensor_and_free(striped):
    src = torch.arange(3 * 4096, dtype=torch.float32)
    h = hop2.externalize(src, readers=1)
    assert len(os.listdir(striped)) == 3
    t = transfer.open_tensor(h, 0)
    assert torch.equal(t, src)
    assert process.collect() == 0 and len(os.listdir(striped)) == 3
    transfer.release_adopted(src)
    assert os.listdir(striped) == []
    assert torch.equal(t, src)  # the reader's mapping outlives the names
    adopted = transfer.adopt_tensor(transfer.share_tensor(src))
    assert len(os.listdir(striped)) == 3
    del adopted  # freed before any broadcast: every file goes
    process.collect()
    assert os.listdir(striped) == []


def test_striped_segment_missing_part_is_a_clear_error(striped):
    sent = transfer.share_tensor(torch.randn(3, 4096))
    os.unlink(os.path.join(striped, sent.name + "p2"))
    with pytest.raises(handle.ShmEmbedsError, match="not found"):
        transfer.adopt_tensor(sent)
    assert os.listdir(striped) == []  # the remaining files are not left behind


@pytest.mark.parametrize("split", [[4095], [8192, 4096], [0], [1 << 30], "x"])
def test_bad_split_is_rejected(split):
    meta = {"name": str(SegmentName(1, 1, 1, 1)), "dtype": "float32",
            "shape": [4, 4096], "split": split}
    with pytest.raises(handle.ShmEmbedsError, match="malformed"):
        handle.SharedTensorHandle.from_meta(meta)


def _parallel(size, local, index=0, local_only=False):
    import types

    return types.SimpleNamespace(model_config=types.SimpleNamespace(enable_prompt_embeds=True),
                                 parallel_config=types.SimpleNamespace(
                                     data_parallel_size=size, data_parallel_size_local=local,
                                     data_parallel_index=index, local_engines_only=local_only))


def test_hop1_is_decided_per_engine_with_dp_engines_on_other_nodes(shm_env):
    """DP=2 with one EngineCore on this node (DP rank 0) and one on another:
    a request for the local one goes as a handle, one for the other gets
    the bytes (counted ``fallback.hop1.remote_engine``, no segment made)."""
    from vllm._shm_embeds.sites import core_client

    assert core_client.local_engines(_parallel(2, 2)) is None
    assert core_client.local_engines(_parallel(2, 1, local_only=True)) is None
    assert core_client.local_engines(_parallel(4, 2, index=2)) == {b"\x02\x00", b"\x03\x00"}
    assert core_client._hop1_skip_reason(_parallel(2, 0)) == "every EngineCore is on another node"
    assert core_client._hop1_skip_reason(_parallel(2, 1)) is None
    local = core_client.local_engines(_parallel(2, 1))
    assert local == {b"\x00\x00"}
    consumer = hop1.HandleOOBConsumer(local_engines=local)
    t = torch.randn(64, 32)
    before = counters.stats()
    consumer.send_to(b"\x01\x00")
    consumer.arm(t)
    assert consumer(t) is None and os.listdir(shm_env) == []  # inline
    assert delta(before, counters.stats()) == {
        "fallback.hop1.remote_engine": 1, "hop1_stock_tensors": 1, "hop1_stock_bytes": t.nbytes}
    consumer.send_to(b"\x00\x00")
    consumer.arm(t)
    meta = consumer(t)
    assert isinstance(meta, dict) and hop1.META_KEY in meta
    [created] = consumer.take_created()
    assert transfer.discard_shared(created) and os.listdir(shm_env) == []
