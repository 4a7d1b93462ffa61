# SPDX-License-Identifier: Apache-2.0
"""The client's own cost of one large ``prompt_embeds`` request: building the
body and handing it to the HTTP library, up to the last byte read by a
transport that discards it (no server, no network; CPU only).

Variants (each in a fresh subprocess, so peak RSS do not mix):

* ``sdk``: what vLLM's examples show: ``torch.save`` into a ``BytesIO``,
  ``base64.b64encode(buf.getvalue()).decode()``, then the OpenAI SDK's
  ``client.completions.create(model=..., prompt=None, extra_body={"prompt_embeds": b64})``
  over ``httpx.Client(transport=<discarding transport>)``
* ``httpx-json``: the same base64 ``str``, but ``httpx.Client.post(json=...)``
  (the SDK's own overhead apart)
* ``builder``: ``shm_embeds_client.complete_openai_json``, whose body is built
  by ``openai_json_body`` (``torch.save`` streamed into base64 in one
  ``bytearray``; pybase64 where installed) and sent from its own memory
* ``builder-binascii``: the same with ``binascii.b2a_base64`` (a client host
  without pybase64)
* ``sdk+builder``: the builder's body sent by the OpenAI SDK itself
  (``client.post("/completions", content=..., cast_to=Completion)``)
* ``binary``: the plugin's binary body (``shm_embeds_client.complete``,
  ``_framing``): no JSON, no base64; for a server with the plugin

Every variant gets the same JSON response (a valid ``Completion``). Wall
seconds are the median of ``--repeats`` runs (after none: the first run is
counted, each run allocates afresh); peak RSS growth is ``ru_maxrss`` after
the runs minus before them (the tensor and the imports already resident).

``.venv/bin/python benchmarks/bench_client_body.py`` (256 MiB fp32, 16384 x
4096) writes ``benchmarks/results/client_body/<UTC date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import DTYPES, MIB, machine_info, markdown_table, median, print_table, write_json

VARIANTS = ("sdk", "httpx-json", "builder", "builder-binascii", "sdk+builder", "binary")
URL = "http://bench.invalid:8000"
RESPONSE = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length",
                         "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def _child(variant: str, mib: int, hidden: int, dtype: str, repeats: int) -> dict:
    """One variant, in this (fresh) process."""
    import base64
    import functools
    import gc
    import io
    import resource
    import types

    import httpx
    import openai
    import torch

    import shm_embeds_client as sec
    from shm_embeds_client import http as sec_http
    from shm_embeds_client import openai_json

    seen: list[int] = []

    class Discard(httpx.BaseTransport):
        """Reads the request body to its end, keeps nothing, answers RESPONSE."""

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            n = 0
            for chunk in request.stream:
                n += len(chunk)
            seen.append(n)
            return httpx.Response(200, json=RESPONSE)

    dt = getattr(torch, DTYPES[dtype])
    rows = mib * MIB // (hidden * dt.itemsize)
    t = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(0)).to(dt)
    fields = {"max_tokens": 1}
    sdk = openai.OpenAI(base_url=f"{URL}/v1", api_key="x",
                        http_client=httpx.Client(transport=Discard()))
    plain = httpx.Client(transport=Discard())
    # The client's senders make their own httpx.Client: theirs gets the transport
    # (httpx itself left alone: the SDK checks isinstance(.., httpx.Client)).
    sec_http.httpx = types.SimpleNamespace(
        Client=functools.partial(httpx.Client, transport=Discard()),
        HTTPStatusError=httpx.HTTPStatusError)
    if variant == "builder-binascii":
        openai_json._encode = openai_json._b2a

    def stock_b64() -> str:
        buf = io.BytesIO()
        torch.save(t, buf)
        return base64.b64encode(buf.getvalue()).decode("utf-8")

    def run() -> None:
        if variant == "sdk":
            out = sdk.completions.create(model="m", prompt=None,
                                         extra_body={"prompt_embeds": stock_b64()}, **fields)
            assert out.choices[0].text == "x"
        elif variant == "httpx-json":
            r = plain.post(f"{URL}/v1/completions",
                           json={"model": "m", **fields, "prompt_embeds": stock_b64()})
            assert r.json()["choices"][0]["text"] == "x"
        elif variant in ("builder", "builder-binascii"):
            out = sec.complete_openai_json(URL, "m", t, **fields)
            assert openai.types.Completion.model_validate(out).choices[0].text == "x"
        elif variant == "sdk+builder":
            body = sec.openai_json_body("m", t, **fields)
            out = sdk.post("/completions", cast_to=openai.types.Completion,
                           content=[memoryview(body)],
                           options={"headers": {"Content-Type": "application/json",
                                                "Content-Length": str(len(body))}})
            assert out.choices[0].text == "x"
        elif variant == "binary":
            out = sec.complete(URL, "m", t, **fields)
            assert out["choices"][0]["text"] == "x"
        else:
            raise ValueError(variant)

    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
        gc.collect()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"variant": variant, "mib": mib, "dtype": dtype, "shape": [rows, hidden],
            "tensor_bytes": t.nbytes, "body_bytes": seen[-1], "repeats": repeats,
            "wall_s": median(times), "wall_s_all": times,
            "peak_rss_growth_mb": (after - before) * 1024 / 1e6,
            "encoder": getattr(openai_json._encode, "__module__", "?")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="tensor size in MiB (default 256)")
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    ap.add_argument("--repeats", type=int, default=3, help="runs per variant (median)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma list out of {','.join(VARIANTS)}")
    ap.add_argument("--json", metavar="PATH", help="default: benchmarks/results/"
                    "client_body/<UTC date>.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.mib, args.hidden, args.dtype, args.repeats)))
        return
    variants = [v for v in args.variants.split(",") if v]
    if bad := set(variants) - set(VARIANTS):
        ap.error(f"unknown variant(s) {sorted(bad)}")
    info = machine_info()
    t_start = time.time()
    rows = []
    for v in variants:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", v, "--mib", str(args.mib),
               "--hidden", str(args.hidden), "--dtype", args.dtype,
               "--repeats", str(args.repeats)]
        got = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(got.stdout.strip().splitlines()[-1]))
        print(f"{v}: {rows[-1]['wall_s']:.3f} s", flush=True)
    ref = next((r for r in rows if r["variant"] == "sdk"), None)
    for r in rows:
        if ref:
            r["vs_sdk_wall"] = r["wall_s"] / ref["wall_s"]
            r["vs_sdk_rss"] = (r["peak_rss_growth_mb"] / ref["peak_rss_growth_mb"]
                               if ref["peak_rss_growth_mb"] else None)
    cols = [("variant", "variant", "s"), ("wall_s", "wall (s, median)", ".3f"),
            ("vs_sdk_wall", "x SDK", ".2f"), ("peak_rss_growth_mb", "peak RSS growth (MB)",
                                              ".0f"),
            ("vs_sdk_rss", "x SDK", ".2f"), ("body_bytes", "body bytes", "d")]
    print_table(rows, cols)
    payload = {"benchmark": "client_body", "machine": info,
               "config": {"mib": args.mib, "hidden": args.hidden, "dtype": args.dtype,
                          "repeats": args.repeats, "variants": variants},
               "rows": rows, "markdown": markdown_table(rows, cols),
               "wall_s": time.time() - t_start}
    path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                     "client_body", time.strftime("%Y-%m-%d", time.gmtime())
                                     + ".json")
    write_json(path, payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
