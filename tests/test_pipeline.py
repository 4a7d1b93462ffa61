# SPDX-License-Identifier: Apache-2.0
"""Pipeline stages and readers on other nodes.

Unit tests (no engine): what each kind of reader gets (``hop2.reader_plan``);
the broadcast's reader flags are the first stage's local readers only; a
later-stage worker builds a NaN placeholder and maps nothing; every rank
joins the same agreement for every form a reader can receive; vLLM's own
``MessageQueue.enqueue`` split in two (handles to the ring, the remote form to
the remote socket); the newer runner's upload skipped on later stages.

Integration (``offline_pp``: offline PP=2, TP=1 on the 2-layer tiny model,
plugin on): the embeds prompts' outputs equal the same prompts' as token ids
(stock's path: the plugin touches no token ids) while the stage-1 worker got
NaN placeholders (a tripwire: had it read them, its
outputs would differ); the stage-1 worker never mapped or opened a segment
(its ``/proc/<pid>/maps`` and fds, polled while the embeds prompts ran, with
the stage-0 worker seen mapping as the control) and counted placeholders,
not mappings; nothing left in the segment directory.
"""

import contextlib
import os
import pickle
import types

import pytest
import torch
from helpers import by_role, held_by, new_fds, open_fds, ring_message

from vllm._shm_embeds import counters, handle
from vllm._shm_embeds.handle import HOP2_WIRE, EmbedsPlaceholder, InlineEmbeds, SharedTensorHandle
from vllm._shm_embeds.hops import hop2
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.sites import multiproc_executor, records, shm_broadcast
from vllm._shm_embeds.sites import prompt_embeds as prompt_embeds_sites

# --------------------------------------------------------------------------
# who gets what


@pytest.mark.parametrize("layout, plan, kinds", [
    # (first-stage ranks TP x PCP, local readers, remote readers)
    ((1, 2, 0), (1, 1, 0, False), {"local_handle": 1, "local_placeholder": 1}),  # PP=2
    ((2, 4, 0), (2, 2, 0, False), {"local_handle": 2, "local_placeholder": 2}),  # PP=2 TP=2
    ((2, 2, 0), (2, 0, 0, False), {"local_handle": 2}),  # TP=2
    ((1, 1, 1), (1, 0, 1, False), {"local_handle": 1, "remote_placeholder": 1}),  # PP nodes
    ((2, 2, 2), (2, 0, 2, False), {"local_handle": 2, "remote_placeholder": 2}),
    ((2, 1, 1), (1, 0, 1, True), {"local_handle": 1, "remote_bytes": 1}),  # TP nodes
    ((4, 2, 6), (2, 0, 6, True), {"local_handle": 2, "remote_bytes": 6}),
])
def test_reader_plan(layout, plan, kinds):
    got = hop2.reader_plan(*layout)
    assert (got.handle_readers, got.local_later, got.remote, got.remote_bytes) == plan
    assert got.reader_kinds() == kinds


def test_reader_plan_refuses_nonsense():
    for layout in ((1, 0, 2), (0, 2, 0), (1, 1, -1), (5000, 5000, 0)):
        with pytest.raises(ValueError):
            hop2.reader_plan(*layout)


def test_placeholder_costs_one_element_and_is_nan():
    p = handle.placeholder_tensor(torch.bfloat16, (24576, 8192))
    assert p.shape == (24576, 8192) and p.dtype == torch.bfloat16
    assert p.stride() == (0, 0) and p.untyped_storage().nbytes() == 2
    assert torch.isnan(p[123, 456]) and torch.isnan(p[:3].float()).all()
    assert len(pickle.dumps(EmbedsPlaceholder("bfloat16", (24576, 8192)))) < 200


# --------------------------------------------------------------------------
# the EngineCore's side: flags for the first stage's local readers only


class _Req:
    def __init__(self, t):
        self.prompt_embeds = t


def _executor(n_local, n_remote, tp=1, pp=2):
    mq = types.SimpleNamespace(n_local_reader=n_local, n_remote_reader=n_remote)
    cfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(enable_prompt_embeds=True),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp,
                                              pipeline_parallel_size=pp,
                                              prefill_context_parallel_size=1))
    return types.SimpleNamespace(rpc_broadcast_mq=mq, vllm_config=cfg)


def _send(executor, tensor, answers=(HOP2_WIRE, HOP2_WIRE)):
    """One ``execute_model`` through the wrapper: what the broadcast carried.
    ``answers``: what the workers answer the wrapper's probe (readers on other
    nodes), or an exception it raises."""
    so = types.SimpleNamespace(scheduled_new_reqs=[_Req(tensor)])
    seen = {}

    def orig(self, method, timeout=None, args=(), kwargs=None, **kw):
        if callable(method):  # the probe: does every worker run hop 2?
            seen["probed"] = method
            if isinstance(answers, Exception):
                raise answers
            return list(answers)
        seen["form"] = args[0].scheduled_new_reqs[0].prompt_embeds
        seen["remote"] = getattr(records.peek(self.rpc_broadcast_mq, records.QueueRecord), "remote", None)
        return "ok"

    assert multiproc_executor.wrap_executor_rpc(orig)(executor, "execute_model",
                                                      args=(so,)) == "ok"
    assert so.scheduled_new_reqs[0].prompt_embeds is tensor  # restored
    assert getattr(records.peek(executor.rpc_broadcast_mq, records.QueueRecord), "remote",
                   None) is None
    return seen


def test_flags_for_first_stage_local_readers_only(shm_env):
    """PP=2, TP=1 on one host: two local readers, one on the first stage. The
    handle has flags for that one alone, so its mapping settles the broadcast:
    the name goes when the request ends although the stage-1 reader never
    maps (with a flag for it too, the name would stay until shutdown)."""
    embeds = torch.randn(100, 64)
    seen = _send(_executor(2, 0), embeds)
    h = seen["form"]
    assert isinstance(h, SharedTensorHandle) and h.readers == 1 and seen["remote"] is None
    transfer.open_tensor(h, 0)  # the stage-0 worker; the stage-1 worker maps nothing
    transfer.release_adopted(embeds)  # vLLM freed the request
    process.collect()
    assert os.listdir(shm_env) == []
    c = counters.stats()
    assert c["hop2_reader_tensors.hop2.local_handle"] == 1
    assert c["hop2_reader_tensors.hop2.local_placeholder"] == 1
    assert "hop2_remote_bytes" not in c


@pytest.mark.parametrize("tp, pp, form", [(1, 2, EmbedsPlaceholder), (2, 1, InlineEmbeds)])
def test_remote_readers_get_their_form_locals_keep_handles(shm_env, monkeypatch, tp, pp,
                                                            form):
    """One local and one remote reader: PP=2 across two nodes (the remote
    reader is stage 1: a placeholder) or TP=2 across them (the remote reader
    is on the first stage: the bytes). The local reader gets a handle."""
    monkeypatch.setitem(multiproc_executor.STATUS, "remote", [])
    embeds = torch.randn(100, 64)
    seen = _send(_executor(1, 1, tp=tp, pp=pp), embeds)
    assert isinstance(seen["form"], SharedTensorHandle) and seen["form"].readers == 1
    [(_, remote)] = seen["remote"]
    assert isinstance(remote, form)
    if form is InlineEmbeds:
        assert remote.tensor is embeds
    else:
        assert remote == EmbedsPlaceholder("float32", (100, 64))
    c = counters.stats()
    assert c["hop2_reader_tensors.hop2.local_handle"] == 1
    kind = "remote_bytes" if form is InlineEmbeds else "remote_placeholder"
    assert c[f"hop2_reader_tensors.hop2.{kind}"] == 1
    assert c.get("hop2_remote_bytes", 0) == (embeds.nbytes if form is InlineEmbeds else 0)
    transfer.open_tensor(seen["form"], 0)
    transfer.release_adopted(embeds)
    process.collect()


def test_remote_readers_without_the_split_go_stock(shm_env, monkeypatch):
    monkeypatch.setitem(multiproc_executor.STATUS, "remote", ["enqueue: missing"])
    embeds = torch.randn(100, 64)
    seen = _send(_executor(1, 1), embeds)
    assert seen["form"] is embeds and seen["remote"] is None
    assert counters.stats() == {"fallback.hop2.remote": 1, "hop2_stock_tensors": 1,
                                "hop2_stock_bytes": embeds.nbytes}
    assert os.listdir(shm_env) == []


@pytest.mark.parametrize("answers", [(HOP2_WIRE, None), (HOP2_WIRE, HOP2_WIRE + 1),
                                     (HOP2_WIRE, True)],
                         ids=["a_worker_without_hop2", "another_wire_format",
                              "an_older_version_answering_a_bool"])
def test_remote_workers_without_the_plugin_keep_hop2_stock(shm_env, monkeypatch, answers):
    """A follower node started without ``VLLM_SHM_EMBEDS=1`` (or without
    shm-embeds) cannot take our forms nor join the agreement: the wrapper asks
    every worker once, and one that says no, answers another wire format
    (another shm-embeds version, whose forms would not unpickle), or does not
    answer a number, keeps hop 2 stock for every reader instead of failing
    the engine."""
    monkeypatch.setitem(multiproc_executor.STATUS, "remote", [])
    embeds = torch.randn(100, 64)
    executor = _executor(1, 1)
    seen = _send(executor, embeds, answers)
    assert callable(seen["probed"])
    assert seen["form"] is embeds and seen["remote"] is None
    assert counters.stats() == {"fallback.hop2.remote": 1, "hop2_stock_tensors": 1,
                                "hop2_stock_bytes": embeds.nbytes}
    assert "probed" not in _send(executor, embeds, answers)  # asked once per executor
    assert os.listdir(shm_env) == []


def test_probe_errors_are_not_swallowed(shm_env, monkeypatch):
    """A failed or timed-out probe leaves vLLM's reply queues out of step (the
    later ranks' replies stay queued): the error reaches vLLM, as at its next
    RPC, instead of a fallback on broken queues."""
    monkeypatch.setitem(multiproc_executor.STATUS, "remote", [])
    with pytest.raises(RuntimeError, match="Worker failed"):
        _send(_executor(1, 1), torch.randn(100, 64), RuntimeError("Worker failed"))


def test_probe_answers_none_where_shm_embeds_is_missing(tmp_path):
    """The probe travels by value (a closure, no reference to our module) and
    imports inside ``try``: in a process where ``vllm._shm_embeds`` cannot be
    imported it answers None instead of failing (a failure would leave
    vLLM's reply queues out of step)."""
    import subprocess
    import sys

    import cloudpickle

    (tmp_path / "probe.pkl").write_bytes(cloudpickle.dumps(multiproc_executor._probe()))
    code = ("import pickle, sys; sys.modules['vllm._shm_embeds'] = None; "
            f"f = pickle.loads(open({str(tmp_path / 'probe.pkl')!r}, 'rb').read()); "
            "print(f(None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr[-2000:]


def test_worker_answers_its_wire_format_when_its_sites_are_patched(monkeypatch):
    monkeypatch.setitem(multiproc_executor.STATUS, "hop2", [])
    assert multiproc_executor.worker_hop2_wire(None) == HOP2_WIRE
    assert multiproc_executor._probe()(None) == HOP2_WIRE
    monkeypatch.setitem(multiproc_executor.STATUS, "hop2", ["off"])
    assert multiproc_executor.worker_hop2_wire(None) is None
    monkeypatch.delitem(multiproc_executor.STATUS, "hop2")
    assert multiproc_executor.worker_hop2_wire(None) is None


# --------------------------------------------------------------------------
# vLLM's MessageQueue.enqueue, split by the site


class _FakeQueue:
    """Just what ``MessageQueue.enqueue`` (0.32) touches on a writer: the ring
    (``acquire_write``, ``buffer.max_chunk_bytes``, ``_spin_condition``) and the
    remote socket; records what each kind of reader would receive."""

    _is_writer = True
    tensor_arena = None

    def __init__(self, n_local, n_remote, fail_remote=False):
        self.n_local_reader, self.n_remote_reader = n_local, n_remote
        self.buffer = types.SimpleNamespace(max_chunk_bytes=1 << 26)
        self._spin_condition = types.SimpleNamespace(notify=lambda: None)
        self.local, self.remote, self.fail_remote = [], [], fail_remote
        self.remote_socket = types.SimpleNamespace(send_multipart=self._send_remote)

    def _send_remote(self, buffers, copy=False):
        if self.fail_remote:
            raise OSError("socket gone")
        self.remote.append([bytes(b) for b in buffers])

    @contextlib.contextmanager
    def acquire_write(self, timeout=None):
        buf = bytearray(self.buffer.max_chunk_bytes)
        yield memoryview(buf)
        self.local.append(buf)


def _received(buffers):
    return pickle.loads(buffers[0], buffers=buffers[1:])


@pytest.mark.parametrize("remote_bytes", [False, True])
def test_enqueue_split_through_vllms_enqueue(remote_bytes):
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    enqueue = shm_broadcast.wrap_enqueue(MessageQueue.enqueue)
    tensor = torch.randn(4096, 128)  # 2 MiB: out of band in vLLM's pickle
    h = SharedTensorHandle("vllm-shm-embeds.1.2.3.4", "float32", (4096, 128), readers=2)
    req = _Req(h)
    mq = _FakeQueue(2, 3)
    plan = hop2.reader_plan(4 if remote_bytes else 2, 2, 3)
    records.record(mq, records.QueueRecord).remote = [(req, hop2.remote_form(tensor, plan))]
    enqueue(mq, ("execute_model", (types.SimpleNamespace(scheduled_new_reqs=[req]),), {}, 0))
    [ring], [remote] = mq.local, mq.remote
    local_msg = _received(ring_message(ring))
    assert local_msg[1][0].scheduled_new_reqs[0].prompt_embeds == h
    assert len(ring_message(ring)) == 1  # no tensor bytes for the local readers
    got = _received(remote)[1][0].scheduled_new_reqs[0].prompt_embeds
    if remote_bytes:
        assert isinstance(got, InlineEmbeds) and torch.equal(got.tensor, tensor)
    else:
        assert got == EmbedsPlaceholder("float32", (4096, 128))
        assert sum(map(len, remote)) < 1024  # zero embeds bytes on the wire
    assert (mq.n_local_reader, mq.n_remote_reader) == (2, 3) and req.prompt_embeds is h


def test_enqueue_unchanged_without_a_plan_and_restored_on_error():
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    enqueue = shm_broadcast.wrap_enqueue(MessageQueue.enqueue)
    mq = _FakeQueue(2, 1)
    enqueue(mq, ("ping", (), {}, None))
    assert len(mq.local) == 1 and len(mq.remote) == 1
    assert _received(mq.remote[0]) == _received(ring_message(mq.local[0]))
    h = SharedTensorHandle("vllm-shm-embeds.1.2.3.4", "float32", (8, 8), readers=2)
    req = _Req(h)
    mq = _FakeQueue(2, 1, fail_remote=True)
    records.record(mq, records.QueueRecord).remote = [
        (req, EmbedsPlaceholder("float32", (8, 8)))]
    with pytest.raises(OSError):
        enqueue(mq, ("execute_model", (types.SimpleNamespace(scheduled_new_reqs=[req]),),
                     {}, 0))
    assert (mq.n_local_reader, mq.n_remote_reader) == (2, 1) and req.prompt_embeds is h


# --------------------------------------------------------------------------
# the worker's side


def _seg_held(seg_dir):
    return held_by(os.getpid(), seg_dir)


def test_later_stage_worker_maps_nothing(shm_env):
    embeds = torch.randn(100, 64)
    h = hop2.externalize(embeds, 1)
    fds = open_fds()
    held = _seg_held(shm_env)
    before = counters.stats()
    reqs = [_Req(h), _Req(EmbedsPlaceholder("float32", (7, 64))), _Req(InlineEmbeds(embeds)),
            _Req(None)]
    assert hop2.internalize_prompt_embeds(reqs, 1, first_stage=False) == 0
    for req, shape in zip(reqs[:3], [(100, 64), (7, 64), (100, 64)]):
        t = req.prompt_embeds
        assert t.shape == shape and t.dtype == torch.float32 and t.stride() == (0, 0)
        assert torch.isnan(t).all()
    assert reqs[3].prompt_embeds is None
    assert _seg_held(shm_env) == held and new_fds(fds) == {}  # nothing mapped or opened
    after = counters.stats()
    assert {k: v - before.get(k, 0) for k, v in after.items()
            if v != before.get(k, 0)} == {"hop2_placeholder_tensors": 3}
    transfer.open_tensor(h, 0)
    transfer.release_adopted(embeds)
    process.collect()


def test_first_stage_worker_maps_unwraps_and_refuses(shm_env):
    embeds = torch.randn(100, 64)
    h = hop2.externalize(embeds, 1)
    reqs = [_Req(h), _Req(InlineEmbeds(embeds))]
    assert hop2.internalize_prompt_embeds(reqs, 0, first_stage=True) == 1
    assert torch.equal(reqs[0].prompt_embeds, embeds) and reqs[1].prompt_embeds is embeds
    # a first-stage reader must never get a placeholder, nor a handle whose
    # broadcast has no flag for it
    for bad, index in ((EmbedsPlaceholder("float32", (100, 64)), 0), (h, 1)):
        with pytest.raises(handle.ShmEmbedsError):
            hop2.internalize_prompt_embeds([_Req(bad)], index, first_stage=True)
    transfer.release_adopted(embeds)
    process.collect()


class _Group:
    def __init__(self, name, world_size, stage=0):
        self.cpu_group, self.world_size = name, world_size
        self.is_first_rank, self.is_last_rank = stage == 0, stage == world_size - 1
        self.prev_rank, self.next_rank = f"stage {stage - 1}", f"stage {stage + 1}"


class _Done:
    def is_completed(self):
        return True


class _Worker:
    rank = 1

    def __init__(self):
        self.rpc_broadcast_mq = types.SimpleNamespace(local_reader_rank=-1)
        self.outputs = []

    def handle_output(self, output):
        self.outputs.append(output)


@pytest.mark.parametrize("form", ["handle", "placeholder", "inline", "none"])
@pytest.mark.parametrize("first", [True, False])
def test_every_rank_joins_the_agreement_for_every_form(shm_env, monkeypatch, form, first):
    """A step carrying embeds in any form makes the worker join one all-reduce
    per group within its stage (TP, then PCP), whatever its stage; then the
    first stage sends its outcome to the next (``isend``: it waits for no
    later stage), and a later stage receives the earlier stage's. No
    all-reduce spans stages. A step without embeds joins none."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    calls = []
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: _Group("tp", 2))
    monkeypatch.setattr(parallel_state, "get_pcp_group", lambda: _Group("pcp", 2))
    monkeypatch.setattr(parallel_state, "get_pp_group",
                        lambda: _Group("pp", 2, stage=0 if first else 1))
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: calls.append(group))
    monkeypatch.setattr(dist, "isend", lambda t, dst, group, tag: (
        calls.append(("isend", dst, group, tag)), _Done())[1])
    monkeypatch.setattr(dist, "recv", lambda t, src, group, tag: calls.append(
        ("recv", src, group, tag)))
    monkeypatch.setattr(prompt_embeds_sites, "first_pp_stage", lambda: first)
    embeds = torch.randn(100, 64)
    h = hop2.externalize(embeds, 1)
    value = {"handle": h, "placeholder": EmbedsPlaceholder("float32", (100, 64)),
             "inline": InlineEmbeds(embeds), "none": embeds}[form]
    if first and form == "placeholder":
        value = InlineEmbeds(embeds)  # a first-stage reader never gets a placeholder
    so = types.SimpleNamespace(scheduled_new_reqs=[_Req(value)])
    ran = []

    def orig(self, rpc_request):
        ran.append(rpc_request[1][0].scheduled_new_reqs[0].prompt_embeds)

    worker = _Worker()
    if form == "handle":  # the reader index of a first-stage local reader
        worker.rpc_broadcast_mq.local_reader_rank = 0
    multiproc_executor.wrap_worker_rpc(orig)(worker, ("execute_model", (so,), {}, None))
    tag = hop2.STAGE_TAG
    chain = [("isend", "stage 1", "pp", tag)] if first else [("recv", "stage 0", "pp", tag)]
    assert calls == ([] if form == "none" else ["tp", "pcp", *chain])
    [t] = ran
    assert isinstance(t, torch.Tensor) and worker.outputs == []
    assert torch.isnan(t).all() if not first and form != "none" else torch.equal(t, embeds)
    ran.clear()
    del so, t
    if not (first and form == "handle"):
        transfer.open_tensor(h, 0)  # the first-stage reader that settles the broadcast
    transfer.release_adopted(embeds)
    process.collect()


@pytest.mark.parametrize("failing_stage", [None, 0, 1])
def test_an_earlier_stage_failure_ends_the_step_on_every_stage(monkeypatch, failing_stage):
    """Three stages, one rank each, over a fake point-to-point link: a stage that
    could not map makes itself and every later stage end the step; an earlier
    stage never learns of a later one's outcome (it never waits for it)."""
    import torch.distributed as dist

    wire = []
    monkeypatch.setattr(dist, "isend", lambda t, dst, group, tag: (
        wire.append(int(t.item())), _Done())[1])
    monkeypatch.setattr(dist, "recv", lambda t, src, group, tag: t.fill_(wire.pop(0)))
    outcomes = []
    for stage in range(3):
        chain = hop2.StageChain()
        outcomes.append(chain.agree(stage != failing_stage, _Group("pp", 3, stage)))
    want = [failing_stage is None or stage < failing_stage for stage in range(3)]
    assert outcomes == want and wire == []


def test_a_stage_chain_of_one_stage_sends_nothing(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "isend", None)
    monkeypatch.setattr(dist, "recv", None)
    chain = hop2.StageChain()
    assert chain.agree(True, _Group("pp", 1)) and not chain.agree(False, _Group("pp", 1))


# --------------------------------------------------------------------------
# the newer runner's upload (vllm/v1/worker/gpu/model_states/prompt_embeds.py)


@pytest.mark.parametrize("first", [True, False])
def test_newer_runner_upload_skipped_on_later_stages(monkeypatch, first):
    """vLLM's own ``PromptEmbedsState.add_request``, wrapped, on a state
    built without a GPU: the first stage uploads (``async_tensor_h2d``), a
    later stage uploads nothing, holds no tensor and leaves length 0 for the
    kernel; the caller's request keeps its tensor either way."""
    import numpy as np
    from vllm.v1.worker.gpu.model_states import prompt_embeds as vllm_pe

    uploads = []
    monkeypatch.setattr(vllm_pe, "async_tensor_h2d",
                        lambda t, device=None, dtype=None: uploads.append(t) or t.clone())
    monkeypatch.setattr(prompt_embeds_sites, "first_pp_stage", lambda: first)
    state = vllm_pe.PromptEmbedsState.__new__(vllm_pe.PromptEmbedsState)
    state.device = "cpu"
    state.dtype = torch.float32
    state.gpu_tensors = {"old": (torch.zeros(1), None)}
    for name in ("embeds_ptrs", "mask_ptrs", "embeds_lens"):
        setattr(state, name, types.SimpleNamespace(np=np.full(4, 99, dtype=np.int64)))
    add = prompt_embeds_sites.wrap_add_request(vllm_pe.PromptEmbedsState.add_request)
    embeds = torch.randn(30, 8)
    req = types.SimpleNamespace(req_id="old", prompt_embeds=embeds, prompt_is_token_ids=None)
    add(state, 2, req)
    assert req.prompt_embeds is embeds
    if first:
        assert uploads == [embeds] and state.embeds_lens.np[2] == 30
        assert "old" in state.gpu_tensors
    else:
        assert uploads == [] and state.embeds_lens.np[2] == 0
        assert "old" not in state.gpu_tensors  # nothing held for the request


def test_upload_group_only_where_the_newer_runner_is_loaded(monkeypatch):
    import sys

    from vllm._shm_embeds import sites

    monkeypatch.setattr(sites, "STATUS", {})
    monkeypatch.delitem(sys.modules, prompt_embeds_sites.MODULE, raising=False)
    monkeypatch.setattr(sites, "check", lambda group: ([], []))
    assert "pp_upload" not in sites.apply()
    monkeypatch.setitem(sys.modules, prompt_embeds_sites.MODULE, types.ModuleType("m"))
    monkeypatch.setattr(prompt_embeds_sites, "_decided", False)
    prompt_embeds_sites.maybe_patch()
    assert sites.STATUS["pp_upload"] == []


# --------------------------------------------------------------------------
# the engine: offline PP=2, TP=1


pp_integration = pytest.mark.integration


@pp_integration
def test_pp2_outputs_equal_token_ids(offline_pp):
    on, _, _ = offline_pp
    assert on["embeds"] == on["token_ids"]
    assert on["left_after_generate"] == []


@pp_integration
def test_pp2_later_stage_maps_nothing_and_counts_placeholders(offline_pp):
    on, stats, _ = offline_pp
    n = len(on["embeds"])
    maps = on["worker_maps"]
    assert sorted(maps) == ["VLLM::Worker_PP0", "VLLM::Worker_PP1"], maps
    stage0, stage1 = maps["VLLM::Worker_PP0"], maps["VLLM::Worker_PP1"]
    assert stage0["samples"] > 0 and stage1["samples"] > 0
    # the control: the poller sees the stage-0 worker's mappings
    assert stage0["held"], "the stage-0 worker was never seen mapping: the watch proves nothing"
    assert stage1["held"] == []
    per_pid = {s["pid"]: s["counters"] for s in stats}
    c0, c1 = per_pid[stage0["pid"]], per_pid[stage1["pid"]]
    assert c1.get("hop2_placeholder_tensors") == n and c1.get("hop2_shm_tensors", 0) == 0
    assert c0.get("hop2_shm_tensors") == n and c0.get("hop2_placeholder_tensors", 0) == 0
    [engine] = by_role(stats, "engine")
    assert engine["hop2_reader_tensors.hop2.local_handle"] == n
    assert engine["hop2_reader_tensors.hop2.local_placeholder"] == n


@pp_integration
@pytest.mark.skipif(not os.environ.get("SHM_EMBEDS_TEST_PP_TP2"),
                    reason="PP=2 x TP=2 runs 4 workers on 2 cores: about 110 s for one "
                    "engine here (measured), over the suite's budget; set "
                    "SHM_EMBEDS_TEST_PP_TP2=1 to run it")
def test_pp2_tp2_later_stage_maps_nothing(tmp_path):
    """Plugin on only (stock's outputs are the token-ids run's, as above):
    both stage-1 TP workers get placeholders and map nothing, both stage-0
    ones map; flags for the two first-stage readers only."""
    from helpers import run_offline, tiny_model

    out, stats, _ = run_offline(
        tmp_path, True, tiny_model(), None,
        ["--tp", "2", "--pp", "2", "--lengths", "40,300,700", "--max-model-len", "768",
         "--watch-maps"], env={"VLLM_CPU_OMP_THREADS_BIND": "0|1|0|1"})
    n = len(out["embeds"])
    assert out["embeds"] == out["token_ids"] and out["left_after_generate"] == []
    maps = out["worker_maps"]
    assert sorted(maps) == [f"VLLM::Worker_PP{p}_TP{t}" for p in (0, 1) for t in (0, 1)]
    per_pid = {s["pid"]: s["counters"] for s in stats}
    for title, rec in maps.items():
        c = per_pid[rec["pid"]]
        if "PP0" in title:
            assert rec["held"] and c.get("hop2_shm_tensors") == n, (title, rec, c)
        else:
            assert rec["held"] == [] and rec["samples"] > 0, (title, rec)
            assert c.get("hop2_placeholder_tensors") == n and "hop2_shm_tensors" not in c
    [engine] = by_role(stats, "engine")
    assert engine["hop2_reader_tensors.hop2.local_handle"] == 2 * n
    assert engine["hop2_reader_tensors.hop2.local_placeholder"] == 2 * n


def test_a_rebuilt_broadcast_queue_gets_a_plan_of_its_own(shm_env, monkeypatch):
    """The plan belongs to one broadcast queue: after vLLM replaces
    ``rpc_broadcast_mq`` (here: readers moved to another node), the next RPC
    plans again and asks the workers again."""
    monkeypatch.setitem(multiproc_executor.STATUS, "remote", [])
    executor = _executor(2, 0, tp=2, pp=1)
    embeds = torch.randn(100, 64)
    seen = _send(executor, embeds)
    assert isinstance(seen["form"], SharedTensorHandle) and seen["remote"] is None
    transfer.open_tensor(seen["form"], 0)
    transfer.open_tensor(seen["form"], 1)
    executor.rpc_broadcast_mq = types.SimpleNamespace(n_local_reader=1, n_remote_reader=1)
    seen = _send(executor, embeds)
    assert "probed" in seen
    [(_, remote)] = seen["remote"]
    assert isinstance(remote, InlineEmbeds) and seen["form"].readers == 1
    transfer.open_tensor(seen["form"], 0)
    transfer.release_adopted(embeds)
    process.collect()


def test_rays_v2_executor_keeps_hop2_stock(shm_env):
    """``RayExecutorV2`` subclasses ``MultiprocExecutor`` and inherits both
    hop-2 sites; untested with shm-embeds, it keeps hop 2 stock (the
    workers then get tensors, none of our forms, and join no agreement)."""
    RayExecutorV2 = type("RayExecutorV2", (types.SimpleNamespace,),
                         {"__module__": "vllm.v1.executor.ray_executor_v2"})
    executor = RayExecutorV2(**vars(_executor(2, 0, tp=2, pp=1)))
    embeds = torch.randn(100, 64)
    seen = _send(executor, embeds)
    assert seen["form"] is embeds and "probed" not in seen
    assert "RayExecutorV2" in multiproc_executor._stock_executor(executor)
