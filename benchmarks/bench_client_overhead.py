# SPDX-License-Identifier: Apache-2.0
"""The Python client's own cost per call, with and without a connection pool.

A local server that answers every ``/v1/completions`` at once (Starlette under
uvicorn, in this process's thread), so what is timed is the client: building
the body, the ``httpx`` client, the connection. For each way, ``--calls``
calls of a small binary body (16 x 64 fp32) and their median and p90 (ms):

* ``new client per call``: what ``shm_embeds_client`` did before
  ``pool.py`` (``with httpx.Client() as c: c.post(...)``: an SSL context
  loaded and a TCP connection opened per call);
* ``complete()``: the one-shot helper on the process's shared client;
* ``Conversation``: a conversation's turns on its own pool.

    .venv/bin/python benchmarks/bench_client_overhead.py [--calls 200]

Writes ``benchmarks/results/client_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time

import httpx
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

import shm_embeds_client as sec
from shm_embeds_client._framing import _body
from shm_embeds_client.http import _url
from shm_embeds_client.wire import KEPT_HEADER

OK = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "hi"}]}


async def _answer(request):
    await request.body()
    return JSONResponse(OK, headers={KEPT_HEADER: "A" * 43})


def _serve() -> tuple[str, uvicorn.Server]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(
        Starlette(routes=[Route("/v1/completions", _answer, methods=["POST"])]),
        host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the local server did not start"
        time.sleep(0.05)
    return url, server


def _times(fn, calls: int) -> dict:
    fn()  # warm: imports, the first connection
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    out.sort()
    return {"median_ms": round(statistics.median(out), 3),
            "p90_ms": round(out[int(0.9 * (len(out) - 1))], 3), "calls": calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    url, server = _serve()
    t = torch.randn(16, 64)

    def new_client_per_call():
        h, content = _body("completions", "m", t, {"max_tokens": 1}, None, False)
        with httpx.Client(timeout=60) as c:
            assert c.post(_url(url, "completions"), content=content, headers=h).status_code == 200

    conv = sec.Conversation(url, "m")
    rows = torch.randn(1, 64)
    results = {
        "new client per call": _times(new_client_per_call, args.calls),
        "complete()": _times(lambda: sec.complete(url, "m", t, max_tokens=1), args.calls),
        "Conversation": _times(lambda: conv.complete(rows, max_tokens=1), args.calls),
    }
    conv.close()
    server.should_exit = True
    base = results["new client per call"]["median_ms"]
    for name, r in results.items():
        print(f"{name:22s} median {r['median_ms']:8.2f} ms  p90 {r['p90_ms']:8.2f} ms  "
              f"(a new client per call takes {base / r['median_ms']:.1f}x this)")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "client_overhead.json"),
              "w") as f:
        json.dump({"cpus": os.cpu_count(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
