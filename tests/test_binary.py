# SPDX-License-Identifier: Apache-2.0
"""Online: binary ``prompt_embeds`` bodies on a stock OpenAI server, TP=2.

On the suite's main server (conftest.py: shm on, only ``VLLM_SHM_EMBEDS=1``
and the test's dirs set; counters as deltas). Greedy outputs of the binary
path must equal those of the same token ids and of the JSON path; the
counters of every process must show the bytes went socket -> segment ->
handles with one copy and no JSON decode (a silent fallback to the JSON path
fails); bad bodies get their 4xx, leave nothing in the segment dir and the
server healthy.
"""

import concurrent.futures
import json
import socket
import time

import pytest
import requests
import torch
from helpers import delta, encode_embeds, ours_in, wait_until

import shm_embeds_client as sec

pytestmark = [pytest.mark.integration, pytest.mark.online]

MAX_LEN = 2048


def _settle(server, want_unlinked: int, before: dict) -> dict:
    """Counters once the EngineCore unlinked the names (it does so after the step)."""
    def unlinked():
        d = delta(before, server.totals())
        return d if d.get("segments_unlinked", 0) >= want_unlinked else None

    return wait_until(unlinked, 30, lambda: f"{want_unlinked} name(s) unlinked: "
                      f"{delta(before, server.totals())}", interval=0.2)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed))


KW = {"max_tokens": 6, "temperature": 0.0}


def _embeds_and_ids_answer(server, n: int, seed: int) -> tuple[str, torch.Tensor, dict]:
    """``n`` random token ids' embeddings ``[n, hidden]`` and the server's
    completion of the ids themselves (the reference): ``(url, embeds, answer)``."""
    url, ids = server["url"], _ids(n, seed)
    answer = requests.post(url + "/v1/completions", timeout=300,
                           json={"model": "tiny", "prompt": ids.tolist(), **KW}).json()
    return url, server["weights"][ids].contiguous(), answer


def test_completions_binary_equals_ids_and_json_with_one_copy(server):
    url, embeds, by_ids = _embeds_and_ids_answer(server, 300, 1)
    by_json = requests.post(url + "/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": "", "prompt_embeds": encode_embeds(embeds), **KW}).json()
    before = server.totals()
    by_bin = sec.complete(url, "tiny", embeds, **KW)
    d = _settle(server, 1, before)
    text = by_bin["choices"][0]["text"]
    assert text == by_ids["choices"][0]["text"] == by_json["choices"][0]["text"]
    n = embeds.nbytes
    # One copy in all processes: the socket-to-segment write. Then handles only.
    assert d.get("binary_bodies") == 1 and d.get("binary_bytes") == n
    assert d.get("copied_bytes") == n
    assert d.get("hop1_handover_tensors") == 1
    assert d.get("hop1_adopted_tensors") == 1 and d.get("hop2_reused_tensors") == 1
    assert d.get("hop2_shm_bytes") == 3 * n  # EngineCore + both TP workers
    assert "hop1_stock_tensors" not in d and "hop2_stock_tensors" not in d
    assert d.get("segments_created") == 1
    assert ours_in(server["seg_dir"]) == []


def _prefix_cache_hits(url: str) -> float:
    """vLLM's ``vllm:prefix_cache_hits`` counter (tokens), summed over engines."""
    text = requests.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def test_prefix_cache_hits_for_binary_and_json_alike(server):
    """A binary body is hashed in the API server while it
    arrives: the EngineCore hashes none of its blocks (counters). A repeated
    binary request hits the prefix cache, and so do the same tensor sent as
    JSON, as a chat prompt of two parts (assembled into a segment and hashed
    there) and as a binary body that the EngineCore hashes itself (fp16,
    cast to the model's fp32 first): every path's keys are stock's."""
    url, w = server["url"], server["weights"]
    # fp16-exact values: the fp16 body below casts to exactly these bytes.
    embeds = w[_ids(320, 11)].half().float().contiguous()  # 2 full blocks of 128 tokens

    def sent(send):
        before, h = server.totals(), _prefix_cache_hits(url)
        text = send()
        return text, _prefix_cache_hits(url) - h, delta(before, server.totals())

    first, h, d = sent(lambda: sec.complete(url, "tiny", embeds, **KW)["choices"][0]["text"])
    assert h == 0 and d.get("hash_engine_blocks", 0) == 0, d  # hashed on arrival
    assert d.get("hash_api_blocks", 0) == d.get("hash_reused_blocks", 0) > 0, d
    assert d.get("hop1_handover_tensors") == 1, d
    again, h, d = sent(lambda: sec.complete(url, "tiny", embeds, **KW)["choices"][0]["text"])
    assert h >= 256 and d.get("hash_engine_blocks", 0) == 0, (h, d)  # all but the last
    by_json, h, d = sent(lambda: requests.post(url + "/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": "", "prompt_embeds": encode_embeds(embeds), **KW}
    ).json()["choices"][0]["text"])
    assert h >= 256 and d.get("hash_engine_blocks", 0) == 0, (h, d)
    parts = [{"role": "user", "content": [{"type": "prompt_embeds", "data": embeds[:100]},
                                          {"type": "prompt_embeds", "data": embeds[100:]}]}]
    _, h, d = sent(lambda: sec.chat(url, "tiny", messages=parts, **KW))
    assert d.get("hash_engine_blocks", 0) == 0 and d.get("hash_api_blocks", 0) > 0, d
    # the prompt assembled in a segment of its own, hashed there, handed over
    assert d.get("hop1_handover_tensors") == 1 and d.get("hash_sent_tensors") == 1, d
    half, h, d = sent(lambda: sec.complete(url, "tiny", embeds.half(), **KW)["choices"][0]["text"])
    assert h >= 256 and d.get("hash_engine_blocks", 0) > 0, (h, d)  # vLLM's own keys hit
    assert first == again == by_json == half
    assert ours_in(server["seg_dir"]) == []


def test_completions_binary_options_behave_as_json(server):
    """logprobs, n, stream, a list of prompts and a fp16 tensor, as the JSON path."""
    url, w = server["url"], server["weights"]
    a, b = w[_ids(40, 2)].contiguous(), w[_ids(70, 3)].contiguous()
    kw = {"max_tokens": 4, "temperature": 0.8, "logprobs": 2, "n": 2, "seed": 5,
          "cache_salt": "s"}
    js = requests.post(url + "/v1/completions", timeout=300, json={
        "model": "tiny", "prompt_embeds": [encode_embeds(a), encode_embeds(b)], **kw}).json()
    bi = sec.complete(url, "tiny", [a, b], **kw)
    assert len(bi["choices"]) == 4  # n=2 per tensor; the client adds no "" text prompt
    def key(r):
        return sorted((c["index"], c["text"], json.dumps(c["logprobs"]["top_logprobs"]))
                      for c in r["choices"])

    assert key(bi) == key(js)
    # Streamed text of byte-level tokens depends on timing (incremental
    # detokenization); the streamed token ids must be the same.
    skw = {**KW, "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    streamed = sec.complete(url, "tiny", a, **skw)
    r = requests.post(url + "/v1/completions", timeout=300, json={
        "model": "tiny", "prompt_embeds": encode_embeds(a), **skw})
    js_chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                 if line.startswith("data: ") and line != "data: [DONE]"]

    def toks(chunks):  # choice index -> token ids
        out: dict = {}
        for c in chunks:
            for ch in c["choices"]:
                out.setdefault(ch["index"], []).extend((ch["logprobs"] or {}).get("tokens", []))
        return out

    assert len(streamed) > 1 and toks(streamed) == toks(js_chunks) and toks(streamed)
    half = sec.complete(url, "tiny", a.half(), **KW)  # cast as the JSON path casts
    assert half["choices"][0]["text"] == requests.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": "", "prompt_embeds": encode_embeds(a.half()), **KW},
        timeout=300).json()["choices"][0]["text"]
    assert ours_in(server["seg_dir"]) == []


def test_chat_binary_equals_ids_with_one_copy(server):
    url, embeds, by_ids = _embeds_and_ids_answer(server, 300, 7)
    before = server.totals()
    chat = sec.chat(url, "tiny", embeds, **KW)
    d = _settle(server, 1, before)
    assert chat["choices"][0]["message"]["content"] == by_ids["choices"][0]["text"]
    n = embeds.nbytes
    assert d.get("binary_bytes") == n and d.get("copied_bytes") == n
    assert d.get("hop1_handover_tensors") == 1 and d.get("hop2_reused_tensors") == 1
    assert ours_in(server["seg_dir"]) == []


def test_placeholder_from_a_json_client_gets_the_stock_error(server):
    url = server["url"]
    for body in ({"prompt": "", "prompt_embeds": "shm-embeds-binary:" + "0" * 32 + ".0"},
                 {"messages": [{"role": "user", "content": [
                     {"type": "prompt_embeds", "data": "shm-embeds-binary:00.0"}]}]}):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = requests.post(url + path, json={"model": "tiny", **body, "max_tokens": 2},
                          timeout=60)
        assert r.status_code == 400, r.text


def _raw(server, headers: dict, body: bytes, close_after: int | None = None):
    """Send a request on a raw socket; returns (status, response text) or None if
    the connection was closed by us after ``close_after`` body bytes."""
    host, port = server["url"].removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=120)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    try:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
        if close_after is not None:
            s.sendall(body[:close_after])
            time.sleep(1)
            return None
        try:
            s.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered from the header, before the body was read
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                data.split(b"content-length: ")[1].split(b"\r\n")[0] if b"content-length: "
                in data else 0):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        status = int(data.split(b" ", 2)[1])
        return status, data.split(b"\r\n\r\n", 1)[1].decode()
    finally:
        s.close()


def _framed(tensor_descs: list, data: bytes, body_extra=None):
    header = json.dumps({"model": "tiny", "prompt": "", "max_tokens": 2,
                         "prompt_embeds": tensor_descs, **(body_extra or {})}).encode()
    return header, header + data


def _d(t, h, dt="FP32", size=None):
    item = {"FP32": 4, "FP16": 2, "BF16": 2}.get(dt, 8)
    return {"datatype": dt, "shape": [t, h] if h is not None else [t],
            "parameters": {"binary_data_size": size if size is not None
                           else t * (h or 1) * item}}


def _bad_cases(h):
    ok = _d(5, h)
    data = bytes(5 * h * 4)
    return {
        # name: (header json, body bytes, declared header length delta, Content-Length delta)
        "header-longer-than-body": (ok, data, 10 ** 6, 0),
        "size-not-dtype-x-shape": (_d(5, h, size=5 * h * 4 - 4), data[:-4], 0, 0),
        "non-float-datatype": (_d(5, h, "INT64"), bytes(5 * h * 8), 0, 0),
        "not-2d": ({"datatype": "FP32", "shape": [5 * h],
                    "parameters": {"binary_data_size": 5 * h * 4}}, data, 0, 0),
        "3d": ({"datatype": "FP32", "shape": [1, 5, h],
                "parameters": {"binary_data_size": 5 * h * 4}}, data, 0, 0),
        "wrong-hidden": (_d(5, h + 1), bytes(5 * (h + 1) * 4), 0, 0),
        "longer-than-max-model-len": (_d(MAX_LEN + 1, h), bytes((MAX_LEN + 1) * h * 4), 0, 0),
        "extra-bytes": (ok, data + b"xx", 0, 0),
        "over-the-cap": ([_d(MAX_LEN, h), _d(MAX_LEN, h)], b"", 0, 2 * MAX_LEN * h * 4),
    }


@pytest.mark.parametrize("name", sorted(_bad_cases(8)))
def test_bad_binary_bodies_get_4xx_and_leave_nothing(server, name):
    h = server["weights"].shape[1]
    descs, data, hdr_delta, cl_extra = _bad_cases(h)[name]
    header, body = _framed(descs, data)
    headers = {"Content-Type": "application/octet-stream",
               "Inference-Header-Content-Length": len(header) + hdr_delta,
               "Content-Length": len(body) + cl_extra}
    status, text = _raw(server, headers, body)
    assert 400 <= status < 500, text
    err = json.loads(text)["error"]
    assert err["code"] == status and err["message"]
    assert "vllm-shm-embeds" not in text and "/dev/shm" not in text
    assert ours_in(server["seg_dir"]) == []
    ok = requests.post(server["url"] + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize("how", ["cut-short", "disconnect-midway"])
def test_upload_aborted_midway_leaves_nothing(server, how):
    h = server["weights"].shape[1]
    before = server.totals()
    data = bytes(1000 * h * 4)
    header, body = _framed(_d(1000, h), data)
    headers = {"Content-Type": "application/octet-stream",
               "Inference-Header-Content-Length": len(header)}
    if how == "cut-short":
        # Chunked framing (no Content-Length): the body ends before the tensor does.
        part = body[: len(body) // 2]
        chunked = f"{len(part):x}\r\n".encode() + part + b"\r\n0\r\n\r\n"
        status, text = _raw(server, {**headers, "Transfer-Encoding": "chunked"}, chunked)
        assert status == 400 and "cut short" in text
    else:
        assert _raw(server, {**headers, "Content-Length": len(body)}, body,
                    close_after=len(body) // 2) is None
    reason = "short" if how == "cut-short" else "disconnect"
    wait_until(lambda: delta(before, server.totals()).get(f"binary_rejected.{reason}", 0) >= 1,
               30, lambda: f"binary_rejected.{reason} counted: {delta(before, server.totals())}",
               interval=0.2)
    assert ours_in(server["seg_dir"]) == []
    ok = requests.post(server["url"] + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert ok.status_code == 200


def test_concurrent_binary_json_text_equal_serial(server):
    """16 binary, JSON, text and chat requests at once give what each gave alone."""
    url, w = server["url"], server["weights"]
    jobs = []
    for i in range(16):
        ids = _ids(20 + 37 * i, 100 + i)
        kind = ("binary", "json", "text", "chat")[i % 4]
        jobs.append((kind, ids))

    def run(job):
        kind, ids = job
        e = w[ids].contiguous()
        if kind == "binary":
            return sec.complete(url, "tiny", e, **KW)["choices"][0]["text"]
        if kind == "chat":
            return sec.chat(url, "tiny", e, **KW)["choices"][0]["message"]["content"]
        body = ({"prompt": "", "prompt_embeds": encode_embeds(e)} if kind == "json"
                else {"prompt": ids.tolist()})
        r = requests.post(url + "/v1/completions", json={"model": "tiny", **body, **KW},
                          timeout=300)
        return r.json()["choices"][0]["text"]

    serial = [run(j) for j in jobs]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs))
    assert together == serial
    assert ours_in(server["seg_dir"]) == []


def test_async_client(server):
    import asyncio

    e = server["weights"][_ids(50, 9)].contiguous()
    sync = sec.complete(server["url"], "tiny", e, **KW)["choices"][0]["text"]

    async def both():
        return await asyncio.gather(sec.acomplete(server["url"], "tiny", e, **KW),
                                    sec.achat(server["url"], "tiny", e, **KW))

    comp, chat = asyncio.run(both())
    assert comp["choices"][0]["text"] == sync == chat["choices"][0]["message"]["content"]
