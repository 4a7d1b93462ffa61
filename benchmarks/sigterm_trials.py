# SPDX-License-Identifier: Apache-2.0
"""SIGTERM with long requests in flight: what clients see, stock vs shm-embeds.

Each trial starts the OpenAI server (tiny model, TP=2), sends 16 embeds
requests of 1500 tokens (8 at a time, ``max_tokens=64``), sends SIGTERM to
the server's process group 1 s later, and records every client's outcome:
``ok`` (200), ``http-<code>`` (with the error type), ``cut`` (connection
closed without a response), ``timeout`` (no answer within 60 s). Modes
alternate trial by trial so that machine load weighs on both alike.

    .venv/bin/python benchmarks/sigterm_trials.py --trials 10

Writes ``benchmarks/results/sigterm_trials.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import base64
import collections
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def trial(model: str, shm_on: bool, bodies: list[dict], log_path: str) -> dict:
    """One server start, load, SIGTERM; returns outcomes and timings."""
    seg_dir = tempfile.mkdtemp(prefix="shm-embeds-sigterm-", dir="/dev/shm")
    port = _free_port()
    env = dict(os.environ, VLLM_SHM_EMBEDS="1" if shm_on else "0",
               VLLM_SHM_EMBEDS_DIR=seg_dir, VLLM_SHM_EMBEDS_MIN_BYTES="1024",
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"),
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--served-model-name", "tiny", "--port", str(port), "--enable-prompt-embeds",
             "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "-tp", "2"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server died at start; see {log_path}")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(1)
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_outcome, url, b) for b in bodies]
            time.sleep(1.0)
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(180)
            exit_s = time.monotonic() - t0
            outcomes = [f.result() for f in futures]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = [n for n in os.listdir(seg_dir) if n.startswith("vllm-shm-embeds")]
        shutil.rmtree(seg_dir, ignore_errors=True)
    return {"shm": shm_on, "outcomes": outcomes, "exit_s": round(exit_s, 2),
            "returncode": proc.returncode, "left": left}


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
            r = trial(model, shm_on, bodies, os.path.join(logs, f"{i}_{int(shm_on)}.log"))
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
