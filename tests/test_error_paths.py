# SPDX-License-Identifier: Apache-2.0
"""Error paths of the mechanism and the glue, without engines.

One test per fault a review found; each fails on the code before
the fix: writers still running when their fds were closed, finalizers that
locked, a failed rank that let the others run the step, hop-1 segments
orphaned by a failed encode or send, a fork child unlinking its parent's
names, a sweep removing a live owner's segment, stale segments of a dead
API server staying until a restart.
"""

import asyncio
import concurrent.futures
import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import torch
from helpers import run_child, set_limits, wait_until

from vllm._shm_embeds import counters, handle
from vllm._shm_embeds.files import segment
from vllm._shm_embeds.handle import InlineEmbeds, SegmentName, ShmEmbedsError
from vllm._shm_embeds.hops import hop1, hop2
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.procfs import pid_namespace
from vllm._shm_embeds.sites import core_client, multiproc_executor, records

# -- 1. every writer finishes before any fd is closed ------------------------


def test_writers_finish_before_fds_close(shm_env, monkeypatch):
    """Part 1 fails at once (ENOSPC) while part 2 is still writing: the fds
    must stay open, and nothing be unlinked, until part 2 has returned."""
    monkeypatch.setattr(handle, "PART_MIN_BYTES", 4096)
    set_limits(monkeypatch, WRITERS=3)
    events = []
    real_write, real_close = segment.pwrite_all, os.close
    fds_of_parts: dict[int, int] = {}

    def slow_or_failing(fd, buf, offset, failed=None):
        part = fds_of_parts.get(fd)
        if part == 1:
            events.append("part1-fails")
            raise OSError(errno.ENOSPC, "No space left on device")
        if part == 2:
            time.sleep(0.5)
            real_write(fd, buf, offset)  # ignores `failed`: a writer mid-call
            events.append("part2-done")
            return
        real_write(fd, buf, offset, failed)

    real_open = os.open

    def tracking_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        name = os.path.basename(path)
        parsed = SegmentName.parse(name)
        if parsed is not None:
            fds_of_parts[fd] = parsed.part
        return fd

    def tracking_close(fd):
        if fd in fds_of_parts:
            events.append(f"close{fds_of_parts[fd]}")
        real_close(fd)

    monkeypatch.setattr(segment, "pwrite_all", slow_or_failing)
    monkeypatch.setattr(segment.os, "open", tracking_open)
    monkeypatch.setattr(segment.os, "close", tracking_close)
    with pytest.raises(OSError) as e:
        transfer.share_tensor(torch.zeros(3, 4096))
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()  # os.open/os.close are the real ones again for the teardown
    first_close = min(i for i, ev in enumerate(events) if ev.startswith("close"))
    assert events.index("part2-done") < first_close, events
    assert os.listdir(shm_env) == []


# -- 2. finalizers only record -----------------------------------------------


def test_finalizer_under_held_locks_does_not_deadlock(shm_env):
    """The last reference dies on a thread that holds the bookkeeping and the
    counters' locks (as garbage collection can make happen): no deadlock."""
    adopted = [transfer.adopt_tensor(transfer.share_tensor(torch.randn(64, 64)))]
    state = process._state

    def drop_under_locks():
        with state.owned._lock, counters._state.lock:
            adopted.clear()  # the finalizer runs here

    t = threading.Thread(target=drop_under_locks, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "finalizer deadlocked on a lock its thread held"
    assert process.collect() == 1
    assert os.listdir(shm_env) == []


def test_view_outliving_tensor_keeps_segment(shm_env):
    """What is tracked is the storage: a view keeps the segment alive."""
    adopted = transfer.adopt_tensor(transfer.share_tensor(torch.randn(16, 64)))
    view = adopted[4:8]
    expected = view.clone()
    del adopted
    assert process.collect() == 0 and len(os.listdir(shm_env)) == 1
    # Still the owner's, and still sent without a copy while linked.
    assert torch.equal(view, expected)
    del view
    assert process.collect() == 1 and os.listdir(shm_env) == []


# -- 3. a rank that cannot map fails the step on every rank ------------------

_RANK_SCRIPT = textwrap.dedent("""
    import os, pickle, sys, types
    import torch, torch.distributed as dist
    rank, store_file, handle_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store_file}",
                            rank=rank, world_size=2)
    from vllm.distributed import parallel_state
    tp = types.SimpleNamespace(world_size=2, cpu_group=dist.group.WORLD)
    pp = types.SimpleNamespace(world_size=1, cpu_group=None)
    parallel_state.get_tp_group = lambda: tp
    parallel_state.get_pp_group = lambda: pp
    parallel_state.get_pcp_group = lambda: pp
    from vllm._shm_embeds.handle import ShmEmbedsError
    from vllm._shm_embeds.hops import hop2
    from vllm._shm_embeds.sites import multiproc_executor
    if rank == 1:  # this rank cannot map (e.g. out of memory, fd limit)
        def fail(handle, reader_index=None):
            raise ShmEmbedsError("injected mapping failure")
        hop2.open_tensor = fail
    ran, outputs = [], []
    def orig(self, rpc_request):
        ran.append(rpc_request[0])
    wrapped = multiproc_executor.wrap_worker_rpc(orig)
    worker = types.SimpleNamespace(
        rank=rank, handle_output=outputs.append,
        rpc_broadcast_mq=types.SimpleNamespace(local_reader_rank=rank))
    with open(handle_file, "rb") as f:
        sched = pickle.load(f)
    wrapped(worker, ("execute_model", (sched,), {}, 0))
    print("RESULT", len(ran), [type(o).__name__ for o in outputs], flush=True)
    dist.destroy_process_group()
    # Python's exit handlers (ours included), then no C++ static destructors: under
    # load gloo's teardown can abort ("terminate called without an active exception")
    import atexit
    atexit._run_exitfuncs()
    os._exit(0)
""")


def test_one_rank_failing_to_map_fails_the_step_on_every_rank(shm_env, tmp_path):
    embeds = torch.randn(32, 64)
    req = types.SimpleNamespace(prompt_embeds=embeds)
    sched = types.SimpleNamespace(scheduled_new_reqs=[req])
    hop2.externalize_prompt_embeds(sched.scheduled_new_reqs, readers=2)
    import pickle

    (tmp_path / "handle.pkl").write_bytes(pickle.dumps(sched))
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path / "store"),
             str(tmp_path / "handle.pkl")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ,
        )
        for r in (0, 1)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(next(line for line in out.splitlines() if line.startswith("RESULT")))
    # Neither rank ran the step; the output rank (0) reported the failure.
    assert outs[0] == "RESULT 0 ['ShmEmbedsError']", outs
    assert outs[1] == "RESULT 0 []", outs
    # Rank 0 mapped it (flag set), rank 1 never did: the name stays until
    # the owner shuts down (vLLM stops the engine on the reported error).
    assert process.collect() == 0
    process.shutdown()


def test_readers_map_through_owner_fds_after_name_removed(shm_env):
    """Something else unlinks every segment name (a cleanup job, systemd's
    RemoveIPC): readers of a broadcast still map it through the owner's fds."""
    src = torch.randn(64, 64)
    adopted = transfer.adopt_tensor(transfer.share_tensor(src))
    h = hop2.externalize(adopted, readers=2)
    for name in os.listdir(shm_env):
        os.unlink(os.path.join(shm_env, name))
    reqs = [types.SimpleNamespace(prompt_embeds=h), types.SimpleNamespace(prompt_embeds=h)]
    hop2.internalize_prompt_embeds(reqs[:1], 0)
    out = run_child("import pickle, sys\n"
                    "from vllm._shm_embeds.lifetime import transfer\n"
                    "h = pickle.loads(sys.stdin.buffer.read())\n"
                    "print(float(transfer.open_tensor(h, 1).sum()))\n", h)
    assert out.returncode == 0, out.stderr[-2000:]
    assert abs(float(out.stdout) - float(src.sum())) < 1e-3
    assert torch.equal(reqs[0].prompt_embeds, src)
    assert process.collect() == 0  # both flagged: fds closed; the request runs on
    for fd, inode in h.owner_files:
        try:
            assert os.fstat(fd).st_ino != inode  # closed (or the number reused)
        except OSError as e:
            assert e.errno == errno.EBADF
    assert transfer.release_adopted(adopted)
    del adopted, reqs


def test_internalize_maps_every_handle_even_if_one_fails(shm_env):
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    reqs = [types.SimpleNamespace(prompt_embeds=x) for x in (a, b)]
    hop2.externalize_prompt_embeds(reqs, readers=1)
    bad = handle.SharedTensorHandle(str(SegmentName(1, 1, 1, 1)), "float32", (8, 8))
    wire = [types.SimpleNamespace(prompt_embeds=bad), reqs[1]]
    with pytest.raises(handle.ShmEmbedsError):
        hop2.internalize_prompt_embeds(wire, 0)
    assert torch.equal(wire[1].prompt_embeds, b)  # mapped and flagged anyway
    assert counters.stats()["fallback.hop2.map_failed"] == 1
    hop2.internalize_prompt_embeds(reqs[:1], 0)
    assert process.collect() == 0  # both flagged, the requests run on
    for t in (a, b):
        transfer.release_adopted(t)
    assert os.listdir(shm_env) == []


# -- 5. hop-1 segments of a request that is never sent -----------------------


class _FailingEncoder:
    """Calls the OOB consumer like MsgpackEncoder, then fails."""

    def __init__(self, consumer):
        self.oob_tensor_consumer = consumer

    def encode(self, obj):
        self.oob_tensor_consumer(obj.prompt_embeds)
        raise RuntimeError("encode failed")


def test_segment_removed_when_encode_fails(shm_env, monkeypatch):
    import vllm.v1.engine as engine_mod

    monkeypatch.setattr(engine_mod, "EngineCoreRequest", types.SimpleNamespace)
    consumer = hop1.HandleOOBConsumer()
    enc = core_client.ArmingEncoder(_FailingEncoder(consumer), consumer)
    with pytest.raises(RuntimeError):
        enc.encode(types.SimpleNamespace(prompt_embeds=torch.randn(16, 16)))
    assert os.listdir(shm_env) == []


def _client(consumer, send):
    client = types.SimpleNamespace()
    records.record(client, records.ClientRecord).consumer = consumer
    return client, core_client.wrap_send_input(send)


def test_segment_removed_when_sync_send_fails(shm_env):
    consumer = hop1.HandleOOBConsumer()

    def send(self, request_type, request):
        consumer.arm(request)
        consumer(request)  # encoded: a segment exists now
        raise RuntimeError("engine core is dead")  # ensure_alive / send_multipart

    client, wrapped = _client(consumer, send)
    with pytest.raises(RuntimeError):
        wrapped(client, "ADD", torch.randn(16, 16))
    assert os.listdir(shm_env) == []


def test_segment_removed_when_async_send_future_fails(shm_env):
    consumer = hop1.HandleOOBConsumer()
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def send(self, request_type, request):
        consumer.arm(request)
        consumer(request)
        return fut

    client, wrapped = _client(consumer, send)
    assert wrapped(client, "ADD", torch.randn(16, 16)) is fut
    assert len(os.listdir(shm_env)) == 1
    fut.set_exception(RuntimeError("socket closed"))
    assert os.listdir(shm_env) == []


def test_segment_kept_when_send_succeeds(shm_env):
    consumer = hop1.HandleOOBConsumer()

    async def run():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def send(self, request_type, request):
            consumer.arm(request)
            consumer(request)
            return fut

        client, wrapped = _client(consumer, send)
        wrapped(client, "ADD", torch.randn(16, 16))
        fut.set_result(None)
        await asyncio.sleep(0)

    asyncio.run(run())
    [name] = os.listdir(shm_env)  # the EngineCore will adopt it
    os.unlink(os.path.join(shm_env, name))


# -- 6. a forked child owns nothing of its parent's, even at a normal exit ---

_FORK_SCRIPT = textwrap.dedent("""
    import gc, os, sys, torch
    from vllm._shm_embeds import config
    from vllm._shm_embeds.hops import hop2
    from vllm._shm_embeds.lifetime import process, transfer
    adopted = transfer.adopt_tensor(transfer.share_tensor(torch.randn(32, 32)))
    h = hop2.externalize(torch.randn(32, 32), readers=1)
    pid = os.fork()
    if pid == 0:
        del adopted   # the child drops its copy of the parent's tensor
        gc.collect()
        process.collect()
        sys.exit(0)   # a normal exit: atexit handlers and finalizers run
    _, status = os.waitpid(pid, 0)
    left = os.listdir(config.shm_dir())
    print("CHILD", status, sorted(left) and len(left))
""")


def test_forked_child_exiting_normally_unlinks_nothing(shm_env, tmp_path):
    script = tmp_path / "fork.py"
    script.write_text(_FORK_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=os.environ, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # Both of the parent's segments were still there after the child exited
    # (the parent then unlinked them at its own exit).
    assert "CHILD 0 2" in out.stdout, out.stdout + out.stderr[-2000:]


# -- 7. a sweep never removes a segment whose owner may be alive -------------


def test_sweep_with_unreadable_proc_keeps_live_owner(shm_env, monkeypatch):
    ns = pid_namespace()
    live = str(SegmentName(ns, os.getpid(), 0, 1))  # start time unknown (0)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    gone = str(SegmentName(ns, int(dead.stdout), 0, 1))
    for name in (live, gone):
        open(os.path.join(shm_env, name), "wb").close()
    real_open = open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise PermissionError(errno.EACCES, "hidepid")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_proc)
    assert process.sweep_stale_segments() == 1
    monkeypatch.undo()
    assert os.listdir(shm_env) == [live]
    os.unlink(os.path.join(shm_env, live))


# -- 8. names are built and parsed in one place ------------------------------


def test_segment_names_round_trip():
    name = SegmentName(4026531836, 1234, 5678, 9, part=2)
    assert str(name) == "vllm-shm-embeds.4026531836.1234.5678.9p2"
    assert SegmentName.parse(str(name)) == name
    assert SegmentName.parse(str(name.base())).part == 0
    for bad in ("vllm-shm-embeds.1.2.3", "vllm-shm-embeds.a.1.2.3", "x.1.2.3.4",
                "vllm-shm-embeds.1.2.3.4/../x", "vllm-shm-embeds.1.2.3.4p"):
        assert SegmentName.parse(bad) is None


# -- 10. a dead API server's un-adopted segment comes back without a restart -


def test_engine_reaper_sweeps_dead_owners(shm_env, monkeypatch):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    name = str(SegmentName(pid_namespace(), int(dead.stdout), 1, 0))
    open(os.path.join(shm_env, name), "wb").close()
    monkeypatch.setattr(process, "SWEEP_INTERVAL_S", 0.2)
    process.start_engine_reaper()
    wait_until(lambda: not os.listdir(shm_env), 10,
               lambda: f"the reaper to sweep {os.listdir(shm_env)}", interval=0.1)
    assert counters.stats()["segments_swept"] == 1
    process._state.shutdown_done = True  # stop the reaper


def test_vllms_error_is_not_replaced_when_its_shutdown_dropped_the_queue(shm_env):
    """vLLM's shutdown sets ``rpc_broadcast_mq = None`` while a step is in
    ``collective_rpc``: the step's own error comes out, not an AttributeError
    of the wrapper's clean-up."""
    from test_sites import _fake_executor, _NewReq

    embeds = torch.randn(100, 64)
    so = types.SimpleNamespace(scheduled_new_reqs=[_NewReq(embeds)])

    def orig(self, method, timeout=None, args=(), kwargs=None, **kw):
        if callable(method):  # the wrapper's probe: every worker runs hop 2
            return [handle.HOP2_WIRE] * 2
        self.rpc_broadcast_mq = None
        raise RuntimeError("vLLM: executor is shut down")

    executor = _fake_executor(2, 0)
    with pytest.raises(RuntimeError, match="shut down"):
        multiproc_executor.wrap_executor_rpc(orig)(executor, "execute_model", args=(so,))
    assert so.scheduled_new_reqs[0].prompt_embeds is embeds
    transfer.release_adopted(embeds)
    h = [n for n in os.listdir(shm_env)]
    for name in h:  # no reader will map it: drop the step's copy
        os.unlink(os.path.join(shm_env, name))
    process.collect()


def test_a_failed_agreement_answers_as_a_worker_error(shm_env, monkeypatch):
    """The ranks' all-reduce raises (a peer died): the worker answers the step
    with an error, as vLLM's loop does for any worker error, instead of dying
    without a reply."""
    from test_pipeline import _Req, _Worker

    def died(ok):
        raise RuntimeError("gloo: connection closed by peer")

    monkeypatch.setattr(multiproc_executor, "_all_ranks_ok", died)
    monkeypatch.setattr(multiproc_executor.prompt_embeds_sites, "first_pp_stage", lambda: True)
    embeds = torch.randn(100, 64)
    so = types.SimpleNamespace(scheduled_new_reqs=[_Req(InlineEmbeds(embeds))])
    worker = _Worker()
    ran = []
    out = multiproc_executor.wrap_worker_rpc(lambda self, req: ran.append(req))(
        worker, ("execute_model", (so,), {}, 1))
    assert out is None and ran == []
    [err] = worker.outputs
    assert isinstance(err, ShmEmbedsError) and "connection closed by peer" in str(err)


def test_shutdown_after_the_segment_directory_was_removed(shm_env):
    """Someone removed the segment directory while this process held segments:
    the shutdown at exit unlinks nothing (the files went with it) and raises
    nothing (no traceback at the server's exit)."""
    import shutil

    held = transfer.adopt_tensor(transfer.share_tensor(torch.randn(64, 32)))
    shutil.rmtree(shm_env)
    try:
        assert process.current().owned.unlink_all() == 0
        process.shutdown()
    finally:
        os.mkdir(shm_env, 0o700)  # for the fixture's own check
    assert held.shape == (64, 32)
