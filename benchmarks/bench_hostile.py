# SPDX-License-Identifier: Apache-2.0
"""Hostile input against the TP=2 server: stock vLLM vs shm-embeds, in one run.

What one cheap client (or one local user writing in the segment directory)
costs each server (issue 22). Both servers on the wide model (hidden 8192,
TP=2, tests/helpers.py's launcher), the same attacks in order:

* ``stalled``: ``--stalled`` (6) connections each declare a ``--declare-gib``
  (1.5 GiB) JSON body, send its first 64 KiB and stall for ``--stall-s`` (8) s;
* ``memo``: 4 concurrent requests carrying a valid ``torch.save`` tensor
  (1024 x 8192 fp32, 32 MiB) whose ``data.pkl`` has one extra ``LONG_BINPUT``
  of index 2**26 (CPython's C unpickler grows its memo array to twice that);
  the answers are compared with those for the same tensor saved plainly;
* ``nested``: a binary body whose JSON header is nested 100,000 deep;
* ``planted``: directories at the EngineCore's next 256 segment names (names
  are ``handle.SegmentName``s: predictable from its pid), where it adopts the
  API server's segments, then an embeds request, a text request, the
  directories removed, and both again.

For each it prints the API server's peak RSS growth over its RSS just before
(sampled every 20 ms), the HTTP outcomes, and whether ``/health`` answered and
the segment directory was clean at the end. This is a measurement, not a
test: the tests of each case are named in docs/security.md.

    .venv/bin/python benchmarks/bench_hostile.py     # about 4 minutes

Writes ``benchmarks/results/hostile.json``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import pathlib
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import psutil
import requests
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the one server launcher: helpers.Server
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MIB = 1 << 20


def memo_trick(t: torch.Tensor, index: int = 1 << 26) -> bytes:
    """``torch.save(t)`` with one extra ``LONG_BINPUT index`` after the first
    GLOBAL of ``data.pkl``: still a valid pickle of the same tensor."""
    buf = io.BytesIO()
    torch.save(t, buf)
    zin = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/data.pkl"):
                mark = b"_rebuild_tensor_v2\n"
                at = data.index(mark) + len(mark)
                data = data[:at] + b"r" + struct.pack("<I", index) + data[at:]
            zout.writestr(info.filename, data)
    return out.getvalue()


def plain_save(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


class PeakRss:
    """Peak RSS of one process over a window (sampled every 20 ms)."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc, self.peak, self.base = proc, 0, 0
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        self.base = self.peak = self.proc.memory_info().rss
        self._stop.clear()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / MIB


def _completion(url: str, body: dict | bytes, timeout: float) -> tuple[str, list | None]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        r = requests.post(url + "/v1/completions", data=data, timeout=timeout,
                          headers={"Content-Type": "application/json"})
    except requests.Timeout:
        return "timeout", None
    except requests.ConnectionError:
        return "cut", None
    if r.status_code != 200:
        return str(r.status_code), None
    return "200", [c["text"] for c in r.json()["choices"]]


def attack_stalled(url: str, args) -> dict:
    host, port = url.removeprefix("http://").split(":")
    declared = int(args.declare_gib * (1 << 30))
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\nConnection: close\r\n\r\n").encode()
    first = b'{"model": "tiny", "max_tokens": 1, "prompt_embeds": "' + b"A" * (64 << 10)
    socks = []
    for _ in range(args.stalled):
        s = socket.create_connection((host, int(port)), timeout=args.stall_s + 40)
        s.sendall(head + first)
        socks.append(s)
    time.sleep(args.stall_s)
    outcomes: dict[str, int] = {}
    for s in socks:
        s.settimeout(0.5)
        try:
            reply = s.recv(64).decode(errors="replace")
            code = reply.split(" ")[1] if reply.startswith("HTTP/") else "cut"
        except (TimeoutError, OSError):
            code = "waiting"
        outcomes[code] = outcomes.get(code, 0) + 1
        s.close()
    return {"outcomes": outcomes}


def attack_memo(url: str, weights: torch.Tensor) -> dict:
    gen = torch.Generator().manual_seed(22)
    t = weights[torch.randint(3, weights.shape[0], (1024,), generator=gen)].contiguous()
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0.0}
    tricked = dict(body, prompt_embeds=base64.b64encode(memo_trick(t)).decode())
    plain = dict(body, prompt_embeds=base64.b64encode(plain_save(t)).decode())
    ref = _completion(url, plain, 300)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: _completion(url, tricked, 300), range(4)))
    return {"outcomes": [g[0] for g in got], "plain": ref[0],
            "same_as_plain": all(g == ref for g in got)}


def attack_nested(url: str) -> dict:
    header = b"[" * 100_000 + b"]" * 100_000
    try:
        r = requests.post(url + "/v1/completions", data=header, timeout=60,
                          headers={"Content-Type": "application/octet-stream",
                                   "Inference-Header-Content-Length": str(len(header))})
        return {"status": r.status_code}
    except requests.RequestException as e:
        return {"status": type(e).__name__}


def attack_planted(url: str, api: psutil.Process, seg_dir: str, weights: torch.Tensor) -> dict:
    from vllm._shm_embeds.handle import SegmentName
    from vllm._shm_embeds.procfs import pid_namespace, proc_stat

    planted = []
    ns = pid_namespace()
    engines = [p for p in api.children(recursive=True)
               if "EngineCore" in p.name() + " ".join(p.cmdline())]
    for p in engines:
        stat = proc_stat(p.pid)
        if stat is None:
            continue
        for seq in range(256):
            path = os.path.join(seg_dir, str(SegmentName(ns, p.pid, int(stat[19]), seq)))
            try:
                os.mkdir(path)
                planted.append(path)
            except OSError:
                pass
    t = weights[:256].contiguous()
    embeds = {"model": "tiny", "max_tokens": 2, "temperature": 0.0,
              "prompt_embeds": base64.b64encode(plain_save(t)).decode()}
    text = {"model": "tiny", "max_tokens": 2, "temperature": 0.0, "prompt": "hello " * 20}
    out = {"planted": len(planted)}
    out["embeds_planted"] = _completion(url, embeds, 60)[0]
    out["text_planted"] = _completion(url, text, 60)[0]
    for path in planted:
        os.rmdir(path)
    out["embeds_after"] = _completion(url, embeds, 60)[0]
    out["text_after"] = _completion(url, text, 60)[0]
    return out


def run_mode(shm_on: bool, args, weights: torch.Tensor, tmp: pathlib.Path) -> dict:
    from helpers import Server, ours_in

    tmp.mkdir(parents=True)
    seg_dir = tempfile.mkdtemp(prefix="bench-hostile-", dir="/dev/shm")
    try:
        server = Server(tmp, "-tp", "2", shm_on=shm_on, seg_dir=seg_dir, check_clean=False,
                        model=os.path.join(ROOT, ".models", "wide"), max_model_len=2048,
                        env_extra={"VLLM_SHM_EMBEDS_MIN_BYTES": str(MIB)}).start()
        api = psutil.Process(server.proc.pid)
        out: dict = {"mode": "shm-embeds" if shm_on else "stock"}
        for name, fn in (("stalled", lambda: attack_stalled(server.url, args)),
                         ("memo", lambda: attack_memo(server.url, weights)),
                         ("nested", lambda: attack_nested(server.url)),
                         ("planted", lambda: attack_planted(server.url, api, seg_dir,
                                                            weights))):
            time.sleep(1)
            with PeakRss(api) as rss:
                result = fn()
            out[name] = dict(result, api_rss_growth_mb=round(rss.growth_mb, 1))
            print(f"{out['mode']}: {name}: {out[name]}", flush=True)
        out["healthy_after"] = requests.get(server.url + "/health", timeout=10).status_code == 200
        out["left"] = ours_in(seg_dir)
        server.close()
    finally:
        shutil.rmtree(seg_dir, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stalled", type=int, default=6)
    ap.add_argument("--declare-gib", type=float, default=1.5)
    ap.add_argument("--stall-s", type=float, default=8.0)
    ap.add_argument("--modes", default="stock,shm-embeds")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "hostile.json"))
    args = ap.parse_args()
    from helpers import embed_weights

    weights = embed_weights(os.path.join(ROOT, ".models", "wide"))
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-hostile-"))
    modes = args.modes.split(",")
    runs = [run_mode(m == "shm-embeds", args, weights, tmp / m) for m in modes]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "time": time.strftime("%Y-%m-%d %H:%M UTC",
                                                             time.gmtime()),
                   "runs": runs}, f, indent=1)
    print("\n| mode | attack | API server RSS growth MB | outcome |")
    print("|---|---|---:|---|")
    for r in runs:
        for name in ("stalled", "memo", "nested", "planted"):
            res = {k: v for k, v in r[name].items() if k != "api_rss_growth_mb"}
            print(f"| {r['mode']} | {name} | {r[name]['api_rss_growth_mb']:.0f} | {res} |")
    for r in runs:
        print(f"{r['mode']}: healthy after: {r['healthy_after']}, left: {len(r['left'])}")


if __name__ == "__main__":
    main()
