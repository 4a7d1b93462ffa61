# SPDX-License-Identifier: Apache-2.0
"""The API server's own work on one ``prompt_embeds`` request, step by step.

Whatever carries the tensor between processes, vLLM's OpenAI server must first
turn the HTTP body into a tensor, and the EngineCore hashes it for prefix
caching. This times those steps in one process, with vLLM's own code where it
has one, for the wide model's request sizes (``tokens x 8192`` fp32), so the
end-to-end host tax can be split into "protocol" and "transport":

* ``join``: Starlette's ``Request.body()`` joins the received chunks (64 KiB
  each here) into one ``bytes``
* ``json.loads``: Starlette's ``Request.json()``
* ``validate``: pydantic validation into vLLM's ``CompletionRequest``
  (``prompt_embeds: bytes``: the base64 str is encoded to bytes)
* ``load``: vLLM's ``safe_load_prompt_embeds`` (``vllm/renderers/embed_utils.py``,
  0.32): ``pybase64.b64decode`` + ``torch.load`` + checks
* ``hash``: sha256 of the tensor in 16-token blocks, as the prefix cache does
  (``vllm/v1/core/kv_cache_utils.py``, ``_gen_prompt_embeds_extra_hash_keys``)

With shm-embeds' JSON path (``vllm/_shm_embeds/ext/json/json_body.py``), the same
body, in the worker thread the middleware uses (its own steps, then the
whole :func:`prepare` as the server runs it):

* ``j.buffer``: the chunks copied into a pre-faulted buffer (the faulting
  runs in a thread while the body arrives; here not overlapped, so this is
  an upper bound)
* ``j.scan``: find the long strings, build and ``json.loads`` the skeleton
* ``j.load``: vLLM's ``safe_load_prompt_embeds`` on a ``memoryview`` of the body
* ``j.seg+hash``: write into a streamed segment, hashing the blocks meanwhile
  (the EngineCore then hashes nothing); ``j.load`` + ``j.seg+hash`` is what a
  payload that is not one plain tensor of the model's dtype costs
* ``j.direct``: instead of those two, the plain case: the zip's metadata
  checked (``_plain_tensor_layout``: no tensor bytes read), then the base64 of
  the tensor bytes decoded 4 MiB at a time straight into the segment, hashed
  meanwhile
* ``j.total``: ``prepare()`` itself
* ``stall``: the longest the event loop went without running (a 1 ms ticker)
  while one request's decode ran: stock (join + ``json.loads`` + validation
  on the loop, ``safe_load_prompt_embeds`` in a thread as vLLM's async
  renderer does) vs the JSON path (``prepare`` in a thread)

and the same tensor as a binary body (``vllm/_shm_embeds/ext/binary/binary.py``):

* ``b.header``: ``parse_header`` of the JSON header (descriptors validated)
* ``b.stream``: the tensor bytes, in the same 64 KiB chunks, ``pwrite`` into a
  ``StreamedSegment`` (the one copy; the middleware does this on the loop)
* ``b.finish``: map the segment as the tensor that hop 1 hands over
* ``b.hash``: the prefix-cache digests (the EngineCore computes them for a
  binary body)

Medians of ``--repeats`` in ms. Usage::

    python benchmarks/bench_api_decode.py [--tokens 1024,4096,8192] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import types

import torch
from shm_embeds_client import openai_json_body

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

from vllm._shm_embeds import counters
from vllm._shm_embeds.ext.json import torch_save
from vllm._shm_embeds.ext.binary import common
from vllm._shm_embeds.ext.json import json_body, json_strings
from vllm._shm_embeds.lifetime import transfer
from vllm._shm_embeds.ext.digests import streamed

STEPS = ("join", "json.loads", "validate", "load", "hash")
JSON_STEPS = ("j.buffer", "j.scan", "j.load", "j.seg+hash", "j.direct", "j.total")
BINARY_STEPS = ("b.header", "b.stream", "b.finish", "b.hash")


def _binary_round(tensor: torch.Tensor, header: bytes, chunks: list, block: int
                  ) -> dict[str, float]:
    """One binary body's steps in the API server (seconds each)."""
    from vllm._shm_embeds.ext.binary.binary import parse_header
    from vllm._shm_embeds.ext.binary.common import ServerContext

    limits = ServerContext(tensor.shape[1], 1 << 20, torch.float32, True, 1 << 40)
    t0 = time.perf_counter()
    spec = parse_header(header, "/v1/completions", limits, None).specs[0]
    t1 = time.perf_counter()
    seg = streamed.StreamedSegment(spec.dtype, spec.shape)
    for c in chunks:
        seg.write(c)
    t2 = time.perf_counter()
    embeds = seg.finish()
    t3 = time.perf_counter()
    flat = embeds.view(torch.uint8).reshape(-1).numpy()
    row_bytes = tensor.shape[1] * embeds.element_size() * block
    for i in range(0, len(flat), row_bytes):
        hashlib.sha256(flat[i : i + row_bytes]).digest()
    t4 = time.perf_counter()
    del flat
    transfer.release_streamed(embeds)
    return {"b.header": t1 - t0, "b.stream": t2 - t1, "b.finish": t3 - t2, "b.hash": t4 - t3}


def _json_path_round(chunks, ctx, route="/v1/completions") -> dict[str, float]:
    """One request through the JSON path's steps, then through ``prepare`` (ms)."""

    t0 = time.perf_counter()
    raw = _fill(json_body.body_buffer(sum(map(len, chunks))), chunks)
    t1 = time.perf_counter()
    spans = json_strings.find_long_strings(raw)
    names = [f"p{i}" for i in range(len(spans))]
    json.loads(json_strings.build_skeleton(raw, spans, names))
    t2 = time.perf_counter()
    view = memoryview(raw)
    tensor = json_body._load(ctx, view[spans[0][0]:spans[0][1]])
    t3 = time.perf_counter()
    out = json_body._to_segment(ctx, tensor)
    t4 = time.perf_counter()
    transfer.release_streamed(out)
    del tensor, out
    t4b = time.perf_counter()
    out = torch_save.direct_decode(ctx, view[spans[0][0]:spans[0][1]])
    t4c = time.perf_counter()
    assert out is not None, "not the plain case: the direct decode did not run"
    transfer.release_streamed(out)
    view.release()
    raw.close()
    del out
    t5 = time.perf_counter()
    raw = _fill(json_body.body_buffer(sum(map(len, chunks))), chunks)
    prepared = json_body.prepare(raw, route, ctx)
    raw.close()
    t6 = time.perf_counter()
    assert prepared.upload is not None, prepared.reason
    for t in prepared.upload.tensors:
        if t is not None:
            transfer.release_streamed(t)
    del prepared
    return {"j.buffer": t1 - t0, "j.scan": t2 - t1, "j.load": t3 - t2,
            "j.seg+hash": t4 - t3, "j.direct": t4c - t4b, "j.total": t6 - t5}


def _fill(buf, chunks):
    pos = 0
    for c in chunks:
        buf[pos:pos + len(c)] = c
        pos += len(c)
    return buf


def _stall_ms(work) -> float:
    """Longest gap (ms) of a 1 ms ticker on the event loop while ``await work()`` runs."""
    import asyncio

    return asyncio.run(_stall_main(work))


async def _stall_main(work) -> float:
    import asyncio

    state = {"done": False, "max": 0.0}

    async def ticker():
        last = time.perf_counter()
        while not state["done"]:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            state["max"] = max(state["max"], now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    await work()
    state["done"] = True
    await tick
    return state["max"] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024,4096,8192", type=C.csv_ints)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block", type=int, default=16, help="prefix-cache block, tokens")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--no-json-path", action="store_true",
                    help="only vLLM's own steps (not shm-embeds' JSON path)")
    args = ap.parse_args()
    ours = not args.no_json_path
    if ours:  # segments go to a private dir on the /dev/shm tmpfs
        import tempfile

        os.environ["VLLM_SHM_EMBEDS_DIR"] = tempfile.mkdtemp(
            prefix="shm-embeds-bench-", dir="/dev/shm")

        ctx_of = lambda: common.ServerContext.from_model_config(model_config, args.block)  # noqa: E731

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    # safe_load_prompt_embeds reads only these attributes of the ModelConfig.
    model_config = types.SimpleNamespace(
        enable_prompt_embeds=True, dtype=torch.float32,
        get_hidden_size=lambda: args.hidden)
    rows = []
    for n in args.tokens:
        tensor = torch.randn(n, args.hidden)
        raw = bytes(openai_json_body("m", tensor, prompt="", max_tokens=1))
        chunks = [raw[i : i + 65536] for i in range(0, len(raw), 65536)]
        times: dict[str, list[float]] = {s: [] for s in (*STEPS, *JSON_STEPS, *BINARY_STEPS,
                                                          "stall stock", "stall json")}
        bin_header = json.dumps({"model": "m", "prompt": "", "max_tokens": 1, "prompt_embeds": {
            "datatype": "FP32", "shape": list(tensor.shape),
            "parameters": {"binary_data_size": tensor.nbytes}}}).encode()
        bin_raw = tensor.view(torch.uint8).reshape(-1).numpy().tobytes()
        bin_chunks = [bin_raw[i : i + 65536] for i in range(0, len(bin_raw), 65536)]
        del bin_raw
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            joined = b"".join(chunks)
            t1 = time.perf_counter()
            obj = json.loads(joined)
            t2 = time.perf_counter()
            req = CompletionRequest.model_validate(obj)
            t3 = time.perf_counter()
            embeds = safe_load_prompt_embeds(model_config, req.prompt_embeds)
            t4 = time.perf_counter()
            flat = embeds.view(torch.uint8).numpy()
            row_bytes = args.hidden * embeds.element_size() * args.block
            for i in range(0, len(flat), row_bytes):
                hashlib.sha256(flat[i : i + row_bytes]).digest()
            t5 = time.perf_counter()
            for s, a, b in zip(STEPS, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                times[s].append((b - a) * 1e3)
            del joined, obj, req, embeds, flat
            if ours:
                for k, v in _json_path_round(chunks, ctx_of()).items():
                    times[k].append(v * 1e3)
                # chunks bound as a default: the loop's `del chunks` unbinds the name
                times["stall stock"].append(_stall_ms(lambda c=chunks: _stock_async(
                    c, CompletionRequest, safe_load_prompt_embeds, model_config)))
                times["stall json"].append(_stall_ms(lambda c=chunks: _json_async(c, ctx_of())))
                for k, v in _binary_round(tensor, bin_header, bin_chunks, args.block).items():
                    times[k].append(v * 1e3)
        row = {"tokens": n, "embeds_mb": tensor.nbytes / 1e6, "body_mb": len(raw) / 1e6}
        for s in STEPS:
            row[f"{s}_ms"] = C.median(times[s][1:])  # first round is the warm-up
        row["total_ms"] = sum(row[f"{s}_ms"] for s in STEPS)
        shown = STEPS
        if ours:
            shown = (*STEPS, *JSON_STEPS, "stall stock", "stall json", *BINARY_STEPS)
            for s in shown[len(STEPS):]:
                row[f"{s}_ms"] = C.median(times[s][1:])
            row["b.total_ms"] = sum(row[f"{s}_ms"] for s in BINARY_STEPS)
            row["b.vs_stock"] = row["b.total_ms"] / row["total_ms"]
            # the EngineCore's hash is gone on the JSON path (done in j.seg+hash)
            row["j.vs_stock"] = row["j.total_ms"] / row["total_ms"]
            # peak RSS growth of one request (segments in /dev/shm not counted: the
            # segment holds the embeds once, as on the stock shm path)
            row["peak_stock_mb"] = peak_memory("stock", n, args.hidden, args.block)
            row["peak_json_mb"] = peak_memory("json", n, args.hidden, args.block)
            print(f"  peak RSS growth: stock {row['peak_stock_mb']:.0f} MB, "
                  f"JSON path {row['peak_json_mb']:.0f} MB", flush=True)
        rows.append(row)
        print(f"{n} tokens: " + ", ".join(f"{s} {row[f'{s}_ms']:.0f}" for s in shown)
              + f", total {row['total_ms']:.0f} ms", flush=True)
        del chunks, raw, tensor, bin_chunks
    cols = [("tokens", "tokens", "d"), ("embeds_mb", "embeds MB", ".1f"),
            ("body_mb", "body MB", ".1f"),
            *[(f"{s}_ms", s, ".0f") for s in STEPS], ("total_ms", "total", ".0f")]
    if ours:
        cols += [*[(f"{s}_ms", s, ".0f") for s in (*JSON_STEPS, "stall stock", "stall json")],
                 ("j.vs_stock", "j.total / total", ".2f"),
                 *[(f"{s}_ms", s, ".0f") for s in BINARY_STEPS],
                 ("b.total_ms", "b.total", ".0f"), ("b.vs_stock", "b.total / total", ".2f"),
                 ("peak_stock_mb", "peak MB stock", ".0f"), ("peak_json_mb", "peak MB json", ".0f")]
    C.print_table(rows, cols)
    if ours:
        import shutil

        shutil.rmtree(os.environ["VLLM_SHM_EMBEDS_DIR"], ignore_errors=True)
    if args.json:
        C.write_json(args.json, {"machine": C.machine_info(), "config": vars(args),
                                 "rows": rows})


def _peak_child(path: str, tokens: int, hidden: int, block: int, conn) -> None:
    """In a fresh process: build one body's chunks, then run one decode path;
    sends the peak RSS growth (bytes) over the chunks' own footprint (the peak
    is reset through ``/proc/self/clear_refs`` once the body is built)."""
    import psutil

    tensor = torch.randn(tokens, hidden)
    raw = bytes(openai_json_body("m", tensor, prompt="", max_tokens=1))
    chunks = [raw[i : i + 65536] for i in range(0, len(raw), 65536)]
    del tensor, raw
    model_config = types.SimpleNamespace(enable_prompt_embeds=True, dtype=torch.float32,
                                         get_hidden_size=lambda: hidden)
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to now
        f.write("5")
    base = psutil.Process().memory_info().rss
    if path == "stock":  # what uvicorn/FastAPI/vLLM hold for one request
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.renderers.embed_utils import safe_load_prompt_embeds

        joined = b"".join(chunks)
        chunks.clear()  # (Starlette keeps them until the join returns)
        obj = json.loads(joined)
        req = CompletionRequest.model_validate(obj)
        embeds = safe_load_prompt_embeds(model_config, req.prompt_embeds)
        del embeds
    else:
        import asyncio


        asyncio.run(_json_async(chunks, common.ServerContext.from_model_config(model_config, block)))
        assert counters.stats().get("json_tensors") == 1
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    conn.send(peak - base)


def peak_memory(path: str, tokens: int, hidden: int, block: int) -> float:
    """Peak RSS growth (MB) of the API-server process for one request on ``path``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_peak_child, args=(path, tokens, hidden, block, child))
    p.start()
    value = parent.recv()
    p.join()
    return value / 1e6


async def _stock_async(chunks, request_cls, load, model_config) -> None:
    """Stock: FastAPI's join, ``json.loads`` and validation on the loop, then
    the async renderer's decode in a thread."""
    import asyncio

    obj = json.loads(b"".join(chunks))
    req = request_cls.model_validate(obj)
    del obj
    await asyncio.to_thread(load, model_config, req.prompt_embeds)


async def _json_async(chunks, ctx) -> None:
    """The JSON path as the middleware runs it: ``read_body`` on the loop, then
    ``prepare`` in a worker thread."""
    import asyncio


    it = iter(chunks)

    async def receive():  # the chunks as uvicorn hands them over
        await asyncio.sleep(0)
        c = next(it, None)
        return {"type": "http.request", "body": c or b"", "more_body": c is not None}

    raw = await json_body.read_body(receive, sum(map(len, chunks)))
    prepared = await asyncio.to_thread(json_body.prepare, raw, "/v1/completions", ctx)
    raw.close()
    for t in prepared.upload.tensors:
        if t is not None:
            transfer.release_streamed(t)


if __name__ == "__main__":
    main()
