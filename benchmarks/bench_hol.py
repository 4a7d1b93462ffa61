# SPDX-License-Identifier: Apache-2.0
"""Head-of-line blocking: short text requests while big embeds requests upload.

Against a running server (``--enable-prompt-embeds``): first ``--probes``
short text requests (``--probe-tokens`` random word tokens, ``max_tokens=1``)
one every ``--interval`` s on an idle server; then the same while another
thread sends ``--tokens``-token ``prompt_embeds`` requests back to back
(``--input json``: base64 of ``torch.save``, encoded by the client each time;
``--input binary``: shm-embeds' binary body; ``--input text``: the same
number of token ids, the control: what the engine's own prefill costs the
probes, which no input format can remove). Prints p50/p99 of the probes'
latency, idle and loaded, and the loaded/idle ratio. The API server parses a
JSON body on its event loop, so every other request on it waits meanwhile.

    python benchmarks/bench_hol.py --url http://localhost:8123 --input binary \\
        [--tokens 8192] [--probes 40] [--interval 0.1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import prof_embeds as P  # noqa: E402


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def probe_latencies(client, body: bytes, n: int, interval: float) -> list[float]:
    """``n`` short requests, one started every ``interval`` s (ms each)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.post("/v1/completions", body)
        ms = (time.perf_counter() - t0) * 1e3
        out.append(ms)
        time.sleep(max(0.0, interval - ms / 1e3))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://localhost:8000")
    ap.add_argument("--input", choices=("json", "binary", "text"), default="json")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per embeds request")
    ap.add_argument("--probe-tokens", type=int, default=16)
    ap.add_argument("--probes", type=int, default=40)
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between probes")
    ap.add_argument("--embeddings", help="model dir with safetensors (default: served path)")
    ap.add_argument("--label")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as prof_embeds: the server's workers spin on the cores

    models = P.list_models(args.url, 60)
    model = models[0]["id"]
    weights = P.load_embedding_matrix(args.embeddings or models[0].get("root") or model)
    probe_client = P.Client(args.url, model, 600)
    load_client = P.Client(args.url, model, 600)
    rng = random.Random(0)
    probe = P.completion_body(model, " ".join(rng.choice(P.WORDS)
                                              for _ in range(args.probe_tokens)))
    probe_latencies(probe_client, probe, 3, 0)  # warm-up
    idle = probe_latencies(probe_client, probe, args.probes, args.interval)

    stop, sent = threading.Event(), []

    def load() -> None:
        i = 0
        while not stop.is_set():
            ids = [rng.randrange(3, weights.shape[0]) for _ in range(args.tokens)]
            if args.input == "text":
                body = P.completion_body(model, ids)
            else:
                payload, _ = P.embeds_payload(weights, ids, args.input)
                body = P.completion_body(model, embeds=payload)
            load_client.post("/v1/completions", body)
            sent.append(i)
            i += 1

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    time.sleep(1.0)
    loaded = probe_latencies(probe_client, probe, args.probes, args.interval)
    stop.set()
    loader.join()
    out = {"label": args.label, "input": args.input, "tokens": args.tokens,
           "embeds_requests": len(sent),
           "idle_p50_ms": _percentile(idle, 0.5), "idle_p99_ms": _percentile(idle, 0.99),
           "loaded_p50_ms": _percentile(loaded, 0.5),
           "loaded_p99_ms": _percentile(loaded, 0.99),
           "idle_ms": idle, "loaded_ms": loaded}
    out["p99_ratio"] = out["loaded_p99_ms"] / out["idle_p99_ms"]
    print(f"{args.label or args.input}: probes idle p50 {out['idle_p50_ms']:.0f} / p99 "
          f"{out['idle_p99_ms']:.0f} ms; while {args.tokens}-token {args.input} requests go back to "
          f"back ({len(sent)} sent): p50 {out['loaded_p50_ms']:.0f} / p99 "
          f"{out['loaded_p99_ms']:.0f} ms ({out['p99_ratio']:.1f}x idle p99)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
