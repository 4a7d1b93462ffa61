# SPDX-License-Identifier: Apache-2.0
"""SIGTERM with long requests in flight: what clients see, stock vs shm-embeds.

Each trial starts the OpenAI server (tiny model, TP=2), sends 16 embeds
requests of 1500 tokens (8 at a time, ``max_tokens=64``), sends SIGTERM to
the server's process group 1 s later, and records every client's outcome:
``ok`` (200), ``http-<code>`` (with the error type), ``cut`` (connection
closed without a response), ``timeout`` (no answer within 60 s). Modes
alternate trial by trial so that machine load weighs on both alike.

    .venv/bin/python benchmarks/sigterm_trials.py --trials 10

Writes ``benchmarks/results/sigterm_trials.json`` and prints a table (each
trial's server log under the printed ``logs`` directory).
"""

from __future__ import annotations

import argparse
import base64
import collections
import io
import json
import os
import pathlib
import random
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the one server launcher: helpers.Server


def _embeds_body(weights: torch.Tensor, rng: random.Random, length: int) -> dict:
    ids = [rng.randrange(3, weights.shape[0]) for _ in range(length)]
    buf = io.BytesIO()
    torch.save(weights[ids].contiguous(), buf)
    return {"model": "tiny", "prompt": "", "max_tokens": 64, "temperature": 0.0,
            "prompt_embeds": base64.b64encode(buf.getvalue()).decode()}


def _outcome(url: str, body: dict) -> str:
    try:
        r = requests.post(url + "/v1/completions", json=body, timeout=60)
    except requests.Timeout:
        return "timeout"
    except requests.ConnectionError:
        return "cut"
    if r.status_code == 200:
        return "ok"
    kind = ""
    try:
        kind = r.json().get("error", {}).get("type", "") or ""
    except ValueError:
        pass
    if "EngineDead" in r.text:
        kind = "EngineDeadError"
    return f"http-{r.status_code}{':' + kind if kind else ''}"


def trial(shm_on: bool, bodies: list[dict], tmp: pathlib.Path) -> dict:
    """One server start (tests/helpers.py's launcher), load, SIGTERM; returns
    outcomes and timings."""
    from helpers import Server, ours_in

    tmp.mkdir(parents=True)
    server = Server(tmp, "-tp", "2", shm_on=shm_on, check_clean=False).start()
    try:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_outcome, server.url, b) for b in bodies]
            time.sleep(1.0)
            t0 = time.monotonic()
            server.stop(signal.SIGTERM)
            exit_s = time.monotonic() - t0
            outcomes = [f.result() for f in futures]
    finally:
        server.stop(signal.SIGKILL)
        left = ours_in(server.seg_dir)
        server.close()
    return {"shm": shm_on, "outcomes": outcomes, "exit_s": round(exit_s, 2),
            "returncode": server.proc.returncode, "left": left}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10, help="trials per mode")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "sigterm_trials.json"))
    args = ap.parse_args()
    model = os.path.join(ROOT, ".models", "tiny")
    weights = None
    from safetensors.torch import load_file

    for f in os.listdir(model):
        if f.endswith(".safetensors"):
            weights = next(v for k, v in load_file(os.path.join(model, f)).items()
                           if "embed_tokens" in k)
    rng = random.Random(9)
    bodies = [_embeds_body(weights, rng, 1500) for _ in range(16)]
    logs = tempfile.mkdtemp(prefix="sigterm-trials-")
    results = []
    for i in range(args.trials):
        for shm_on in (False, True):
            r = trial(shm_on, bodies, pathlib.Path(logs) / f"{i}_{int(shm_on)}")
            results.append(r)
            c = collections.Counter(r["outcomes"])
            print(f"trial {i} {'shm-embeds' if shm_on else 'stock':10} exit {r['exit_s']:5.1f} s"
                  f" rc {r['returncode']} left {len(r['left'])}: {dict(c)}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"trials": results, "logs": logs}, f, indent=1)
    print("\n| mode | trials | trials with a 5xx or timeout | outcomes (all requests) |")
    print("|---|---:|---:|---|")
    for shm_on in (False, True):
        rs = [r for r in results if r["shm"] == shm_on]
        bad = sum(any(o == "timeout" or o.startswith("http-5") for o in r["outcomes"])
                  for r in rs)
        total = collections.Counter(o for r in rs for o in r["outcomes"])
        print(f"| {'shm-embeds' if shm_on else 'stock'} | {len(rs)} | {bad} | "
              + ", ".join(f"{k} {v}" for k, v in sorted(total.items())) + " |")


if __name__ == "__main__":
    main()
