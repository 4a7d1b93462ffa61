# SPDX-License-Identifier: Apache-2.0
"""Short text requests while large JSON ``prompt_embeds`` requests arrive back to back.

Against a running OpenAI server (``--enable-prompt-embeds``): one thread sends
``/v1/completions`` requests with ``--tokens`` x hidden fp32 embeds (base64
``torch.save``, as the ``openai`` client does) back to back; another sends short
text prompts (``max_tokens=1``) every ``--interval`` s and records their latency.
The API server decodes the embeds on its event loop in stock vLLM (every other
request waits meanwhile); shm-embeds' JSON path decodes them in a
worker thread. Prints p50/p99/max/mean of the text latencies, and the same with no
embeds traffic; and of ``GET /v1/models``, which never reaches the engine, so
that only the API server's event loop is measured (a text request also waits
for the engine's prefill of the embeds).

Usage::

    python benchmarks/bench_loop_latency.py --url http://localhost:8000 \\
        [--tokens 8192] [--seconds 40] [--json out.json --label stock]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import requests
import torch
from shm_embeds_client import openai_json_body


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://localhost:8000")
    ap.add_argument("--model", help="served model name (default: the first listed)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=8192, help="the model's hidden size")
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--label", default="")
    args = ap.parse_args()

    model = args.model or requests.get(args.url + "/v1/models").json()["data"][0]["id"]
    hidden = args.hidden
    payload = bytes(openai_json_body(model, torch.randn(args.tokens, hidden) * 0.01,
                                     prompt="", max_tokens=1))
    text = {"model": model, "prompt": "hello there", "max_tokens": 1}
    session = requests.Session()

    def text_latencies(seconds: float) -> tuple[list[float], list[float]]:
        """Latencies (ms) of text completions and of ``GET /v1/models`` (which
        never reaches the engine: a pure probe of the API server's event loop)."""
        out, probe, end = [], [], time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            session.get(args.url + "/v1/models", timeout=600).raise_for_status()
            t1 = time.perf_counter()
            r = session.post(args.url + "/v1/completions", json=text, timeout=600)
            r.raise_for_status()
            out.append((time.perf_counter() - t1) * 1e3)
            probe.append((t1 - t0) * 1e3)
            time.sleep(args.interval)
        return out, probe

    idle, idle_probe = text_latencies(min(10.0, args.seconds / 4))
    stop = threading.Event()
    sent = [0]

    def embeds_loop() -> None:
        s = requests.Session()
        while not stop.is_set():
            r = s.post(args.url + "/v1/completions", data=payload, timeout=600,
                       headers={"Content-Type": "application/json"})
            r.raise_for_status()
            sent[0] += 1

    th = threading.Thread(target=embeds_loop, daemon=True)
    th.start()
    time.sleep(1.0)
    busy, busy_probe = text_latencies(args.seconds)
    stop.set()
    th.join(600)
    row = {"label": args.label, "tokens": args.tokens, "embeds_requests": sent[0],
           "idle_p50": statistics.median(idle), "idle_p99": _pct(idle, 0.99),
           "busy_p50": statistics.median(busy), "busy_p99": _pct(busy, 0.99),
           "busy_max": max(busy), "busy_n": len(busy),
           "busy_mean": statistics.fmean(busy),
           "probe_idle_p99": _pct(idle_probe, 0.99),
           "probe_busy_p50": statistics.median(busy_probe),
           "probe_busy_p99": _pct(busy_probe, 0.99), "probe_busy_max": max(busy_probe)}
    print(f"{args.label}: text latency ms idle p50 {row['idle_p50']:.0f} "
          f"p99 {row['idle_p99']:.0f}; with {args.tokens}-token JSON embeds back to back "
          f"({sent[0]} sent): p50 {row['busy_p50']:.0f} p99 {row['busy_p99']:.0f} "
          f"max {row['busy_max']:.0f} mean {row['busy_mean']:.0f} (n={len(busy)}); "
          f"GET /v1/models (event loop only): idle p99 {row['probe_idle_p99']:.0f}, busy "
          f"p50 {row['probe_busy_p50']:.0f} p99 {row['probe_busy_p99']:.0f} "
          f"max {row['probe_busy_max']:.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
