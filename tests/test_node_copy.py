# SPDX-License-Identifier: Apache-2.0
"""One copy per node (``ext/nodes/node_copy.py``) without an engine.

Four gloo ranks on one host stand for TP=4 across two nodes of two workers
(``local_world_size`` 2): ranks 0 and 1 are the head's local readers and map
the step's handle; ranks 2 and 3 are the other node's, and get a
``StepEmbeds``. Each rank runs the real worker wrapper
(``sites/multiproc_executor.wrap_worker_rpc``) with vLLM's groups faked, so
the exchange and the step's agreement run as in a worker. What each must
show: every rank's tensor equals the sent one bit for bit, rank 3 maps the
segment rank 2 received into (no bytes for it), rank 2's segment is gone
after the step; with no segment on rank 2, rank 3 gets the bytes; a rank
that fails fails the step on every rank. The steps run in turn on one group of
four processes, so a failed step must also leave every rank able to run the next.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from vllm._shm_embeds.ext.nodes import node_copy
from vllm._shm_embeds.handle import StepEmbeds
from vllm._shm_embeds.hops import hop2
from vllm._shm_embeds.lifetime import process


@pytest.mark.parametrize(("ranks", "me", "local", "want"), [
    ([0, 1, 2, 3], 0, 2, node_copy.Layout(0, 0, (2,), -1, ())),
    ([0, 1, 2, 3], 1, 2, node_copy.Layout(1, 0, (2,), -1, ())),
    ([0, 1, 2, 3], 2, 2, node_copy.Layout(2, 0, (2,), 2, (3,))),
    ([0, 1, 2, 3], 3, 2, node_copy.Layout(3, 0, (2,), 2, ())),
    ([0, 1], 1, 1, node_copy.Layout(1, 0, (1,), 1, ())),  # TP=2, a worker per node
    ([0, 1, 2, 3, 4, 5], 5, 2, node_copy.Layout(5, 0, (2, 4), 4, ())),
    ([0, 1], 1, 2, node_copy.Layout(1, 0, (), -1, ())),  # one node: nothing to do
])
def test_layout(ranks, me, local, want):
    assert node_copy.layout_of(ranks, me, local) == want


def test_layout_refuses_a_rank_outside_the_group():
    with pytest.raises(ValueError):
        node_copy.layout_of([0, 1], 2, 1)


_RANK_SCRIPT = textwrap.dedent("""
    import errno, os, pickle, sys, types
    import torch, torch.distributed as dist
    rank, store_file, sched_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    modes = sys.argv[4].split(",")
    dist.init_process_group("gloo", init_method=f"file://{store_file}",
                            rank=rank, world_size=4)
    from vllm.distributed import parallel_state
    tp = types.SimpleNamespace(world_size=4, cpu_group=dist.group.WORLD, ranks=[0, 1, 2, 3],
                               rank_in_group=rank)
    pp = types.SimpleNamespace(world_size=1, cpu_group=None, is_first_rank=True)
    parallel_state.get_tp_group = lambda: tp
    parallel_state.get_pp_group = lambda: pp
    parallel_state.get_pcp_group = lambda: pp
    from vllm._shm_embeds import counters
    from vllm._shm_embeds.handle import ShmEmbedsError
    from vllm._shm_embeds.ext.nodes import node_copy
    from vllm._shm_embeds.hops import hop2
    from vllm._shm_embeds.lifetime import transfer
    from vllm._shm_embeds.sites import multiproc_executor

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "injected: no space")
    def bug(nbytes):
        raise RuntimeError("injected: a bug of ours")
    def unmapped(handle, reader_index=None):
        raise ShmEmbedsError("injected: rank 0 cannot map")
    def fail(handle, reader_index=None):
        raise ShmEmbedsError("injected mapping failure")
    INJECT = {("no_segment", 2): (os, "posix_fallocate", full),  # the segment made, then removed
              ("leader_bug", 2): (transfer, "check_budget", bug),
              ("sender_unmapped", 0): (hop2, "open_tensor", unmapped),
              ("peer_fails", 3): (transfer, "open_tensor", fail)}

    worker = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(local_world_size=2)))
    assert node_copy.worker_call(worker, "worker_wire") == node_copy.NODE_WIRE
    assert node_copy.worker_call(worker, "worker_enable", True) is True
    step = {}
    def orig(self, rpc_request):
        step["ran"].append(rpc_request[0])
        step["seen"].extend(float(r.prompt_embeds.double().sum())
                            for r in step["sched"].scheduled_new_reqs)
    wrapped = multiproc_executor.wrap_worker_rpc(orig)
    outputs = []
    worker = types.SimpleNamespace(
        rank=rank, handle_output=outputs.append,
        rpc_broadcast_mq=types.SimpleNamespace(local_reader_rank=rank if rank < 2 else -1))
    results = {}
    for mode in modes:  # one step each, in this order, on the same group
        with open(os.path.join(sched_dir, mode + ".pkl"), "rb") as f:
            local, remote = pickle.load(f)
        step.update(sched=local if rank < 2 else remote, ran=[], seen=[])
        outputs.clear()
        before = counters.stats()
        undo = INJECT.get((mode, rank))
        if undo is not None:
            undo = (undo[0], undo[1], getattr(undo[0], undo[1]))
            setattr(*INJECT[(mode, rank)])
        try:
            wrapped(worker, ("execute_model", (step["sched"],), {}, 0))
        finally:
            if undo is not None:
                setattr(*undo)
        mine = [n for n in os.listdir(os.environ["VLLM_SHM_EMBEDS_DIR"])
                if f".{os.getpid()}." in n]
        after = counters.stats()
        c = {k: v - before.get(k, 0) for k, v in after.items()
             if k.startswith("node_") and v != before.get(k, 0)}
        results[mode] = (len(step["ran"]), [type(o).__name__ for o in outputs],
                         step["seen"], mine, c)
    print("RESULT", repr(results), flush=True)
    dist.destroy_process_group()
    # Python's exit handlers (ours included), then no C++ static destructors: under
    # load gloo's teardown can abort ("terminate called without an active exception")
    import atexit
    atexit._run_exitfuncs()
    os._exit(0)
""")

# The steps, in the order four ranks run them on one group (each process pays
# its imports once): a failed step (peer_fails, sender_unmapped) must leave the
# ranks able to run the next; the bug of ours last.
MODES = ("ok", "no_segment", "peer_fails", "sender_unmapped", "leader_bug")


def _steps(tmp_path, tensors: list[torch.Tensor]) -> dict[str, list[tuple]]:
    """Run :data:`MODES`' steps on four ranks; per mode, each rank's ``(steps run,
    outputs reported, sums of its prompt_embeds as vLLM's method saw them, its
    files left, its node counters of that step)``."""
    owned = []
    for mode in MODES:
        reqs = [types.SimpleNamespace(prompt_embeds=t) for t in tensors]
        hop2.externalize_prompt_embeds(reqs, readers=2)
        local = types.SimpleNamespace(scheduled_new_reqs=reqs)
        remote = types.SimpleNamespace(scheduled_new_reqs=[
            types.SimpleNamespace(prompt_embeds=StepEmbeds("float32", tuple(t.shape)))
            for t in tensors])
        (tmp_path / f"{mode}.pkl").write_bytes(pickle.dumps((local, remote)))
        owned.append(reqs)
    for reqs in owned:
        hop2.restore_prompt_embeds([(r, t) for r, t in zip(reqs, tensors)])
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    procs = [subprocess.Popen(
        [sys.executable, str(script), str(r), str(tmp_path / "store"), str(tmp_path),
         ",".join(MODES)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
        for r in range(4)]
    try:
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
            outs.append(eval(line.removeprefix("RESULT ")))  # our own repr
    finally:
        for p in procs:
            p.kill()
        process.collect()  # the handles' segments: both head readers flagged them
        process.shutdown()
    return {mode: [out[mode] for out in outs] for mode in MODES}


TENSORS = [torch.randn(300, 64), torch.randn(17, 64)]
NBYTES = [t.nbytes for t in TENSORS]
SUMS = [float(t.double().sum()) for t in TENSORS]


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """Every mode's step (:func:`_steps`) and what the segment directory held
    after them, in an environment of their own (``conftest.shm_environment``, as
    ``shm_env`` makes one: it also fails if anything is left)."""
    from conftest import shm_environment

    with pytest.MonkeyPatch.context() as mp, shm_environment(mp) as seg_dir:
        got = _steps(tmp_path_factory.mktemp("node-steps"), TENSORS)
        got["left"] = os.listdir(seg_dir)
    yield got


def test_nothing_left_after_the_steps(steps):
    assert steps["left"] == []


def test_one_copy_per_node(steps):
    """Rank 0 sends each tensor once, to rank 2 (the other node's first rank); rank 2
    receives it into a segment and rank 3 maps that segment; every rank runs the step
    with the sent tensors; rank 2's segments are gone after the step."""
    outs = steps["ok"]
    for rank, (ran, reported, seen, mine, c) in enumerate(outs):
        assert ran == 1 and reported == [], (rank, outs)
        assert seen == pytest.approx(SUMS, rel=0, abs=0), (rank, seen)
        assert mine == [], (rank, mine)
    assert outs[0][4] == {"node_sent_tensors": 2, "node_sent_bytes": sum(NBYTES)}
    assert outs[1][4] == {}
    assert outs[2][4] == {"node_received_tensors": 2, "node_received_bytes": sum(NBYTES),
                          "node_segment_tensors": 2}
    assert outs[3][4] == {"node_mapped_tensors": 2}  # no bytes sent to it


def test_no_segment_on_the_node_sends_the_bytes_on(steps):
    """Rank 2 cannot make a segment (ENOSPC): it receives into memory and sends rank 3
    the bytes; the step runs with the right tensors everywhere."""
    outs = steps["no_segment"]
    for rank, (ran, reported, seen, _, _) in enumerate(outs):
        assert ran == 1 and reported == [] and seen == SUMS, (rank, outs)
    assert outs[2][4] == {"node_received_tensors": 2, "node_received_bytes": sum(NBYTES),
                          "node_peer_bytes": sum(NBYTES)}
    assert outs[3][4] == {}


def test_a_rank_that_cannot_map_fails_the_step_on_every_rank(steps):
    """Rank 3 cannot map rank 2's segment: no rank runs the step, the output rank (0)
    reports the error, and rank 2's segments are gone all the same."""
    outs = steps["peer_fails"]
    for rank, (ran, reported, _, mine, _) in enumerate(outs):
        assert ran == 0, (rank, outs)
        assert reported == (["ShmEmbedsError"] if rank == 0 else []), (rank, outs)
        assert mine == [], (rank, mine)


def test_a_bug_on_the_nodes_first_rank_sends_the_bytes_on(steps):
    """Rank 2 fails unexpectedly making its segment (not an OSError): it receives into
    memory all the same and rank 3 gets the bytes; nobody waits on an operation that
    was skipped, and the step runs everywhere."""
    outs = steps["leader_bug"]
    for rank, (ran, reported, seen, _, _) in enumerate(outs):
        assert ran == 1 and reported == [] and seen == SUMS, (rank, outs)
    assert outs[2][4].get("node_peer_bytes") == sum(NBYTES), outs[2]


def test_rank_0_unable_to_map_fails_the_step_without_a_hang(steps):
    """Rank 0 cannot map the step's handle: it still sends (zeros) so that no rank waits,
    and the step fails on every rank, reported once; nothing is left on rank 2's node."""
    outs = steps["sender_unmapped"]
    for rank, (ran, reported, _, mine, _) in enumerate(outs):
        assert ran == 0, (rank, outs)
        assert reported == (["ShmEmbedsError"] if rank == 0 else []), (rank, outs)
        assert mine == [], (rank, mine)
