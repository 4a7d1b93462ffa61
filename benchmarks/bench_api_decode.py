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

and the same request as a binary body (shm-embeds' ``vllm._shm_embeds_binary``):

* ``header``: ``parse_header`` of the JSON header (descriptors validated)
* ``stream``: the tensor bytes, in the same 64 KiB chunks, ``pwrite`` into a
  ``StreamedSegment`` on the segment tmpfs (the one copy)
* ``finish``: map the segment as the tensor that hop 1 hands over

Medians of ``--repeats`` in ms. Usage::

    python benchmarks/bench_api_decode.py [--tokens 1024,4096,8192] [--json PATH]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

STEPS = ("join", "json.loads", "validate", "load", "hash")
BINARY_STEPS = ("header", "stream", "finish", "hash")


def _hash_blocks(embeds: torch.Tensor, hidden: int, block: int) -> None:
    flat = embeds.view(torch.uint8).reshape(-1).numpy()
    row_bytes = hidden * embeds.element_size() * block
    for i in range(0, len(flat), row_bytes):
        hashlib.sha256(flat[i : i + row_bytes]).digest()


def binary_rows(args, tensor: torch.Tensor) -> dict[str, float]:
    """Median ms per step of the binary-body path for ``tensor`` (fp32)."""
    from vllm import _shm_embeds as shm
    from vllm._shm_embeds_binary import ModelLimits, parse_header

    limits = ModelLimits(args.hidden, 1 << 20, torch.float32, True, 1 << 40)
    header = json.dumps({"model": "m", "prompt": "", "max_tokens": 1, "prompt_embeds": {
        "datatype": "FP32", "shape": list(tensor.shape),
        "parameters": {"binary_data_size": tensor.nbytes}}}).encode()
    raw = tensor.view(torch.uint8).reshape(-1).numpy().tobytes()
    chunks = [raw[i : i + 65536] for i in range(0, len(raw), 65536)]
    del raw
    times: dict[str, list[float]] = {s: [] for s in BINARY_STEPS}
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        parsed = parse_header(header, "/v1/completions", limits, None)
        t1 = time.perf_counter()
        spec = parsed.specs[0]
        seg = shm.StreamedSegment(spec.dtype, spec.shape)
        for c in chunks:
            seg.write(c)
        t2 = time.perf_counter()
        embeds = seg.finish()
        t3 = time.perf_counter()
        _hash_blocks(embeds, args.hidden, args.block)
        t4 = time.perf_counter()
        for s, a, b in zip(BINARY_STEPS, (t0, t1, t2, t3), (t1, t2, t3, t4)):
            times[s].append((b - a) * 1e3)
        shm.release_streamed(embeds)
        del embeds
    return {f"{s}_ms": C.median(times[s][1:]) for s in BINARY_STEPS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024,4096,8192", type=C.csv_ints)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block", type=int, default=16, help="prefix-cache block, tokens")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    # safe_load_prompt_embeds reads only these attributes of the ModelConfig.
    model_config = types.SimpleNamespace(
        enable_prompt_embeds=True, dtype=torch.float32,
        get_hidden_size=lambda: args.hidden)
    rows = []
    for n in args.tokens:
        tensor = torch.randn(n, args.hidden)
        buf = io.BytesIO()
        torch.save(tensor, buf)
        body = json.dumps({"model": "m", "prompt": "", "max_tokens": 1,
                           "prompt_embeds": base64.b64encode(buf.getvalue()).decode()})
        raw = body.encode()
        del body, buf
        chunks = [raw[i : i + 65536] for i in range(0, len(raw), 65536)]
        times: dict[str, list[float]] = {s: [] for s in STEPS}
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
            _hash_blocks(embeds, args.hidden, args.block)
            t5 = time.perf_counter()
            for s, a, b in zip(STEPS, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                times[s].append((b - a) * 1e3)
            del joined, obj, req, embeds
        row = {"tokens": n, "embeds_mb": tensor.nbytes / 1e6, "body_mb": len(raw) / 1e6}
        for s in STEPS:
            row[f"{s}_ms"] = C.median(times[s][1:])  # first round is the warm-up
        row["total_ms"] = sum(row[f"{s}_ms"] for s in STEPS)
        del chunks, raw
        binary = binary_rows(args, tensor)
        row.update({f"binary_{k}": v for k, v in binary.items()})
        row["binary_total_ms"] = sum(binary.values())
        rows.append(row)
        print(f"{n} tokens: JSON " + ", ".join(f"{s} {row[f'{s}_ms']:.0f}" for s in STEPS)
              + f", total {row['total_ms']:.0f} ms; binary "
              + ", ".join(f"{s} {binary[f'{s}_ms']:.0f}" for s in BINARY_STEPS)
              + f", total {row['binary_total_ms']:.0f} ms", flush=True)
        del tensor
    cols = [("tokens", "tokens", "d"), ("embeds_mb", "embeds MB", ".1f"),
            ("body_mb", "body MB", ".1f"),
            *[(f"{s}_ms", s, ".0f") for s in STEPS], ("total_ms", "total", ".0f"),
            *[(f"binary_{s}_ms", f"binary {s}", ".0f") for s in BINARY_STEPS],
            ("binary_total_ms", "binary total", ".0f")]
    C.print_table(rows, cols)
    if args.json:
        C.write_json(args.json, {"machine": C.machine_info(), "config": vars(args),
                                 "rows": rows})


if __name__ == "__main__":
    main()
