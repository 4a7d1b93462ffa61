# SPDX-License-Identifier: Apache-2.0
"""Online: the OpenAI server (TP=2, shm on) with the ``openai`` client.

``prompt_embeds`` go as base64 of ``torch.save`` bytes (vLLM's online
format); greedy outputs must equal those of the same text prompt, the
counters of the API server, EngineCore and both TP workers must show both
hops carried the bytes through shared memory, and bad input must get a 400
without hurting later requests or leaking a segment.
"""


import time

import pytest
import requests
import torch
from helpers import (
    BAD_PAYLOADS,
    by_role,
    embed_weights,
    encode_embeds,
    ours_in,
)


pytestmark = [pytest.mark.integration, pytest.mark.online]


@pytest.fixture
def server(main_server):
    return main_server


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=server["url"] + "/v1", api_key="none")


def _same_tokens_as_embeds(server, text: str) -> torch.Tensor:
    r = requests.post(server["url"] + "/tokenize", json={"model": "tiny", "prompt": text})
    r.raise_for_status()
    ids = torch.tensor(r.json()["tokens"])
    return embed_weights(server["model"])[ids].contiguous()


TEXTS = [
    "the quick brown fox jumps over the lazy dog " * 3,
    "shared memory carries the prompt embeddings from one process to the next " * 12,
]


def test_embeds_equal_text_and_use_shm(server):
    client = _client(server)
    before = {p["pid"]: p["counters"] for p in server.read_stats()}
    total = 0
    for text in TEXTS:
        embeds = _same_tokens_as_embeds(server, text)
        total += embeds.nbytes
        kw = {"model": "tiny", "max_tokens": 8, "temperature": 0.0}
        by_text = client.completions.create(prompt=text, **kw)
        by_embeds = client.completions.create(
            prompt="", extra_body={"prompt_embeds": encode_embeds(embeds)}, **kw
        )
        assert by_embeds.choices[0].text == by_text.choices[0].text
    # What each process counted for these requests (the server is shared).
    stats = [{**p, "counters": {k: v - before.get(p["pid"], {}).get(k, 0)
                                for k, v in p["counters"].items()}}
             for p in server.read_stats()]
    [api] = by_role(stats, "client")
    [engine] = by_role(stats, "engine")
    workers = by_role(stats, "worker")
    assert api.get("hop1_shm_tensors") == len(TEXTS) and api.get("hop1_shm_bytes") == total
    assert engine.get("hop1_adopted_tensors") == len(TEXTS)
    assert engine.get("hop2_reused_tensors") == len(TEXTS)
    assert len(workers) == 2
    assert all(w.get("hop2_shm_tensors") == len(TEXTS) for w in workers)
    # a name goes when vLLM frees its request, before the answer is sent
    assert ours_in(server["seg_dir"]) == []


# That test's decode: long enough that the workers are stopped mid-decode
# (the poll sees their count within a few ms; a token takes 5-20 ms on 2
# loaded cores), short enough not to hold the shared server long after the
# stop (1700 tokens cost it about 25 s).
DECODE_TOKENS = 400


def test_segment_counts_while_its_request_runs(server):
    """On ``/dev/shm`` the budget counts our segments by name, so a
    request's segment keeps its name for as long as the TP workers map it
    (the whole decode), and ``/metrics`` shows it held; it goes when vLLM
    frees the request.

    Once both TP workers have counted the request's segment mapped (its
    first step ran), both are stopped (SIGSTOP): the step cannot finish, so
    the request cannot end, while the EngineCore runs on and its reaper
    passes safe points every 0.1 s (on the old lifetime the name went at the
    first of them). Then the names, what the budget counts and ``/metrics``
    are read, and the workers go on. (A stop after a fixed sleep could miss
    the decode, and so could waiting for a token to reach this client: a
    starved API server forwarded the first token after the decode ended. The
    stop follows the workers' own count within milliseconds, so the decode
    need only outlast that: :data:`DECODE_TOKENS`.)
    """
    import threading

    from helpers import (METRICS_PREFIX, by_role, descendants, held_beneath, parse_metrics,
                         stopped)

    def held() -> float:
        r = requests.get(server["url"] + "/metrics", timeout=60)
        return parse_metrics(r.text)[(METRICS_PREFIX + "dir_held_bytes", frozenset())]

    def mapped() -> int:  # segments the TP workers mapped (both ranks count)
        return sum(c.get("hop2_shm_tensors", 0) for c in by_role(server.read_stats(), "worker"))

    workers = descendants(server["proc"], "Worker_TP")
    assert len(workers) == 2, workers
    embeds = embed_weights(server["model"])[torch.arange(3, 303)].contiguous()
    tries = []
    for _ in range(3):  # a run where the request ended before it could be seen proves nothing
        before = mapped()
        t0 = time.monotonic()
        out: dict = {}

        def request(out: dict = out) -> None:
            r = requests.post(server["url"] + "/v1/completions", timeout=300, json={
                "model": "tiny", "max_tokens": DECODE_TOKENS, "temperature": 0.0,
                "ignore_eos": True,
                "prompt_embeds": encode_embeds(embeds)})
            out["status"], out["text"] = r.status_code, r.text

        thread = threading.Thread(target=request, daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while mapped() < before + 2 and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        with stopped([w.pid for w in workers]):
            running = thread.is_alive()
            seen = (mapped() - before, round(time.monotonic() - t0, 3))
            # the EngineCore's reaper passes 5 safe points, where the old lifetime
            # unlinked a name once every rank had mapped it
            time.sleep(0.5)
            budget_sees = held_beneath(server["seg_dir"])
            during = ours_in(server["seg_dir"])
            during_bytes = held()
            running = running and thread.is_alive()
        thread.join(300)
        tries.append((*seen, round(time.monotonic() - t0, 3)))
        if running:
            break
    assert out.get("status") == 200, out
    if not running:  # inconclusive: the request ended before the workers were stopped
        pytest.skip("three requests ended before both TP workers counted their segment "
                    f"(mapped, at s, ended s: {tries})")
    assert during, "the segment's name went while its request ran"
    assert budget_sees >= embeds.nbytes and during_bytes >= embeds.nbytes
    assert ours_in(server["seg_dir"]) == [] and held() == 0


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("name", sorted(BAD_PAYLOADS))
def test_bad_embeds_get_4xx_and_server_stays_healthy(server, name, endpoint):
    hidden = embed_weights(server["model"]).shape[1]
    payload = BAD_PAYLOADS[name](hidden)
    body = ({"prompt": "", "prompt_embeds": payload} if endpoint == "completions" else
            {"messages": [{"role": "user", "content": [
                {"type": "prompt_embeds", "data": payload}]}]})
    r = requests.post(
        server["url"] + ("/v1/completions" if endpoint == "completions"
                         else "/v1/chat/completions"),
        json={"model": "tiny", "max_tokens": 2, **body},
        timeout=120,
    )
    assert 400 <= r.status_code < 500, r.text
    ok = _client(server).completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert ok.choices
    assert ours_in(server["seg_dir"]) == []


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_inf_embeds_never_hurt_the_server(server, value):
    """Stock vLLM does not validate values; neither path may crash on them."""
    hidden = embed_weights(server["model"]).shape[1]
    bad = torch.randn(40, hidden)
    bad[3, 5] = value
    r = requests.post(
        server["url"] + "/v1/completions",
        json={"model": "tiny", "prompt": "", "max_tokens": 2,
              "prompt_embeds": encode_embeds(bad)},
        timeout=120,
    )
    assert r.status_code < 500, r.text
    ok = _client(server).completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert ok.choices
    assert ours_in(server["seg_dir"]) == []


def test_many_embeds_parts_in_one_request(server):
    weights = embed_weights(server["model"])
    parts = [weights[i : i + 30 + i].contiguous() for i in range(3, 43)]
    r = requests.post(
        server["url"] + "/v1/completions",
        json={"model": "tiny", "prompt": "", "max_tokens": 3, "temperature": 0.0,
              "prompt_embeds": [encode_embeds(p) for p in parts]},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    # vLLM 0.32 also answers the (empty) text prompt next to the embeds parts.
    assert len(parts) <= len(r.json()["choices"]) <= len(parts) + 1
    assert ours_in(server["seg_dir"]) == []


def test_chat_completions_embeds_part_uses_shm(server):
    """/v1/chat/completions with a ``prompt_embeds`` content part (vLLM 0.32)."""

    def hop1_bytes():
        return server.totals("client").get("hop1_shm_bytes", 0)

    ids = torch.randint(3, 1000, (300,), generator=torch.Generator().manual_seed(7))
    embeds = embed_weights(server["model"])[ids].contiguous()
    kw = {"model": "tiny", "max_tokens": 6, "temperature": 0.0}
    before = hop1_bytes()
    chat = requests.post(server["url"] + "/v1/chat/completions", timeout=300, json={
        **kw, "messages": [{"role": "user", "content": [
            {"type": "prompt_embeds", "data": encode_embeds(embeds)}]}]})
    assert chat.status_code == 200, chat.text
    assert hop1_bytes() - before >= embeds.nbytes  # the embeds went by shm
    # The same token ids as a prompt (no BOS added to either) give the same text.
    text = requests.post(server["url"] + "/v1/completions", timeout=300,
                         json={**kw, "prompt": ids.tolist()})
    assert text.status_code == 200, text.text
    assert chat.json()["choices"][0]["message"]["content"] == text.json()["choices"][0]["text"]
    assert ours_in(server["seg_dir"]) == []
