# SPDX-License-Identifier: Apache-2.0
"""Integration: offline ``vllm.LLM``, TP=2, mp executor, CPU, the tiny local model.

One engine for the tiny model (``offline_tiny`` in conftest.py, plugin on) and
one for 256 MiB of embeds on the wide model. The shm run must (1) give the
same greedy tokens for ``prompt_embeds`` as for the same prompts as token ids
(the embeds are the model's own embedding rows; token ids take stock's path,
which the plugin never touches), and (2) show in every process's counters
that both hops carried every prompt_embeds tensor through shared memory, with
one copy in total: this test fails if either hop silently falls back.
Lifetime, preemption and the fork start method are checked on the same run
(test_topologies.py). A whole engine with the plugin off counts nothing: the
follower without the plugin in test_nodes.py (each process decides at load:
test_mechanism.py, test_metrics.py).
"""

import pytest
from helpers import by_role, local_model, run_offline

pytestmark = pytest.mark.integration


def test_outputs_equal_token_ids(offline_tiny):
    on, _, _ = offline_tiny
    assert on["embeds"] == on["token_ids"]


def test_both_hops_carried_every_tensor_by_shm(offline_tiny):
    on, _, log = offline_tiny
    # The counters once the first round of embeds prompts has settled (the
    # same run goes on with prefix-cache hits, aborts and preemption).
    stats = on["stats_after_generate"]
    n, total = len(on["embeds_bytes"]), sum(on["embeds_bytes"])
    [client] = by_role(stats, "client")
    [engine] = by_role(stats, "engine")
    workers = by_role(stats, "worker")
    assert len(workers) == 2  # TP=2
    # hop 1: every tensor went as a handle and was adopted by the EngineCore.
    assert client.get("hop1_shm_tensors") == n and client.get("hop1_shm_bytes") == total
    assert "hop1_stock_tensors" not in client
    assert engine.get("hop1_adopted_tensors") == n
    # hop 2: sent as handles, reusing the hop 1 segment (no second copy) ...
    assert engine.get("hop2_shm_tensors") == n and engine.get("hop2_reused_tensors") == n
    assert "hop2_stock_tensors" not in engine
    assert "copied_bytes" not in engine
    # ... and mapped by every TP rank.
    for w in workers:
        assert w.get("hop2_shm_tensors") == n and w.get("hop2_shm_bytes") == total
    # One copy in total, done by the client; every name unlinked by its owner.
    assert client.get("copied_bytes") == total
    assert engine.get("segments_unlinked") == n
    assert "shm-embeds summary" in log


@pytest.mark.wide
def test_256mib_embeds_same_tokens_and_both_hops_by_shm(tmp_path):
    """8192 tokens x hidden 8192 x fp32 = 256 MiB of prompt_embeds, TP=2.

    The embeds give the tokens of the same prompt as token ids (the embedding
    rows of those ids), in the same run: what stock vLLM gives for both (the
    plugin never touches token ids). A stock run of its own here cost a
    minute of the suite."""
    model = local_model("wide")
    extra = ("--max-model-len", "8448", "--max-tokens", "4")
    on, stats, _ = run_offline(tmp_path, True, model, [8192], extra)
    assert on["embeds_bytes"] == [256 << 20]
    assert on["embeds"] == on["token_ids"]
    [client] = by_role(stats, "client")
    [engine] = by_role(stats, "engine")
    assert client.get("hop1_shm_bytes") == 256 << 20
    assert engine.get("hop2_reused_tensors") == 1 and "copied_bytes" not in engine
    workers = by_role(stats, "worker")
    assert len(workers) == 2 and all(w.get("hop2_shm_bytes") == 256 << 20 for w in workers)
