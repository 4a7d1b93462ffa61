# SPDX-License-Identifier: Apache-2.0
"""Concurrency across several API servers and several EngineCores (online, CPU).

64 concurrent requests mixing text and ``prompt_embeds`` of different lengths:
each output equals the one the same request gets alone, nothing deadlocks, the
counters of all processes add up, and no segment is left.
"""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from helpers import by_role, embed_weights, encode_embeds, start_server
from vllm._shm_embeds.counters import read_stats_dir

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


@pytest.mark.parametrize(
    "server_args",
    [
        pytest.param(("-tp", "2", "--api-server-count", "2"), id="tp2-2-api-servers"),
        pytest.param(("--data-parallel-size", "2"), id="dp2"),
    ],
)
def test_64_concurrent_mixed_requests(tmp_path, server_args):
    # `vllm serve`: the module entry point would start one API server only.
    with start_server(tmp_path, *server_args, serve_cli=True) as server:
        bodies = _requests(server["model"])
        alone = [_send(server["url"], b) for b in bodies[:8]]
        with ThreadPoolExecutor(N_REQUESTS) as pool:
            together = list(pool.map(lambda b: _send(server["url"], b), bodies))
        assert together[:8] == alone
        # The same requests again, alone, must give what they gave together.
        assert [_send(server["url"], b) for b in bodies[8:16]] == together[8:16]
        stats = read_stats_dir(server["stats"])
    n_embeds = sum("prompt_embeds" in b for b in bodies) + sum(
        "prompt_embeds" in b for b in bodies[:16]
    )
    clients = by_role(stats, "client")
    engines = by_role(stats, "engine")
    assert sum(c.get("hop1_shm_tensors", 0) for c in clients) == n_embeds
    assert sum(e.get("hop1_adopted_tensors", 0) for e in engines) == n_embeds
    assert sum(e.get("hop2_shm_tensors", 0) for e in engines) == n_embeds
    if "--data-parallel-size" in server_args:
        assert len(engines) == 2  # the load balancer used both EngineCores
    if "--api-server-count" in server_args:
        assert len(clients) == 2  # both API servers took requests
