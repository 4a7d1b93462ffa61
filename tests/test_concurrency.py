# SPDX-License-Identifier: Apache-2.0
"""Concurrency across several API servers and several EngineCores (online, CPU).

64 concurrent requests mixing text and ``prompt_embeds`` of different lengths:
each output equals the one the same request gets alone, nothing deadlocks, the
counters of all processes add up, and no segment is left. On ``dp_server``
(DP=2, two API servers, async scheduling off).
"""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from helpers import embed_weights, encode_embeds, ours_in

pytestmark = [pytest.mark.integration, pytest.mark.online]

N_REQUESTS = 64


def _requests(model_dir):
    weights = embed_weights(model_dir)
    rng = random.Random(7)
    out = []
    for i in range(N_REQUESTS):
        n = rng.choice([8, 50, 200, 600])
        ids = [rng.randrange(3, weights.shape[0]) for _ in range(n)]
        if i % 2:
            body = {"prompt": ids}
        else:
            body = {"prompt": "", "prompt_embeds": encode_embeds(weights[ids].contiguous())}
        out.append(body)
    return out


def _send(url, body):
    r = requests.post(
        url + "/v1/completions",
        json={"model": "tiny", "max_tokens": 6, "temperature": 0.0, **body},
        timeout=600,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def _64_concurrent_mixed_requests(server, engines: int):
    bodies = _requests(server["model"])
    before = {p["pid"]: p["counters"] for p in server.read_stats()}
    alone = [_send(server["url"], b) for b in bodies[:8]]
    with ThreadPoolExecutor(N_REQUESTS) as pool:
        together = list(pool.map(lambda b: _send(server["url"], b), bodies))
    assert together[:8] == alone
    # The same requests again, alone, must give what they gave together.
    assert [_send(server["url"], b) for b in bodies[8:16]] == together[8:16]
    after = server.read_stats()
    assert ours_in(server["seg_dir"]) == []
    n_embeds = sum("prompt_embeds" in b for b in bodies) + sum(
        "prompt_embeds" in b for b in bodies[:16]
    )

    def grew(role, key):  # per process of ``role``: how much ``key`` grew
        return [p["counters"].get(key, 0) - before.get(p["pid"], {}).get(key, 0)
                for p in after if role in p["roles"]]

    assert sum(grew("client", "hop1_shm_tensors")) == n_embeds
    assert sum(grew("engine", "hop1_adopted_tensors")) == n_embeds
    assert sum(grew("engine", "hop2_shm_tensors")) == n_embeds
    # The load balancer used every EngineCore; both API servers took requests.
    assert sum(g > 0 for g in grew("engine", "hop1_adopted_tensors")) == engines
    assert sum(g > 0 for g in grew("client", "hop1_shm_tensors")) == 2


def test_64_concurrent_mixed_requests_dp2_two_api_servers(dp_server):
    _64_concurrent_mixed_requests(dp_server, engines=2)
