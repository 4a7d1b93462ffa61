# SPDX-License-Identifier: Apache-2.0
"""A flood of large requests on a small segment directory: stock vLLM vs shm-embeds.

Both servers in one run (tests/helpers.py's launcher, TP=2, the wide model),
the segment directory on a tmpfs of ``--tmpfs-mib`` (256), the same requests at
once: ``--binary`` binary bodies and ``--json`` base64 JSON bodies of
``--tokens`` tokens each (stock gets the binary ones as JSON: it has no binary
path), ``--text`` text prompts, and ``--stalled`` uploaders that declare a
full binary body, send 1 MiB and then nothing for ``--stall-s`` seconds. For
each mode it prints outcomes by kind (HTTP status, or ``cut``/``timeout``),
the time to the whole response (to the first token with ``--max-tokens 1``) p50/p99
by kind, the API server's peak RSS over its start RSS, the segment
directory's peak use (sampled every 50 ms), and what was left in it.

    .venv/bin/python benchmarks/bench_load.py            # about 5 minutes
    .venv/bin/python benchmarks/bench_load.py --quick    # fewer, smaller requests
    .venv/bin/python benchmarks/bench_load.py --mixed 64 # 64 at once, 1-128 MiB, text among them

``--mixed N`` replaces the flood by N requests sent at once: every fourth a
text prompt, the others alternately binary and JSON bodies of 1 MiB to
128 MiB (log-spaced sizes in a shuffled order, fixed seed), no stalled upload.

``--dev-shm`` puts the segment directory on ``/dev/shm`` itself (shared with
vLLM's rings and the rest of the host, as in a default container) with a
budget of ``--budget-mib`` (128); the peak then sampled is what the server's
segments really hold there: the named files plus the files that its
processes still map after their names went, each inode once.
``--max-tokens`` (1) makes requests decode longer.

Writes ``benchmarks/results/load.json`` (``load_mixed.json`` with ``--mixed``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import requests
import torch
from shm_embeds_client import openai_json_body

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the one server launcher: helpers.Server
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _json_body(t: torch.Tensor, max_tokens: int) -> bytes:
    return bytes(openai_json_body("tiny", t, max_tokens=max_tokens, temperature=0.0))


def _stall(url: str, t: torch.Tensor, stall_s: float) -> str:
    """Declare a full binary body, send 1 MiB, then nothing; the server's answer
    (its HTTP status), ``cut``, or ``timeout`` when nothing came ``stall_s`` + 15 s
    later (stock vLLM waits for the body as long as the connection lives)."""
    import shm_embeds_client as sec

    headers, pieces, _ = sec.frame({"model": "tiny", "max_tokens": 1, "prompt_embeds": t})
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=stall_s + 15)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"  # (head has Content-Length)
              f"{head}Connection: close\r\n\r\n".encode())
    sent = 0
    for piece in pieces:
        part = memoryview(piece)[: max(0, (1 << 20) - sent)]
        s.sendall(part)
        sent += len(part)
    try:
        reply = s.recv(64).decode(errors="replace")
        return reply.split(" ")[1] if reply.startswith("HTTP/") else "cut"
    except TimeoutError:
        return "timeout"
    finally:
        s.close()


def held_in(directory: str, procs: list) -> int:
    """Bytes that files in ``directory`` hold, each inode once: the named ones
    (allocated blocks) and those that ``procs`` (psutil processes) map, also
    after their names went (the mapping's length)."""
    sizes: dict[int, int] = {}
    for name in os.listdir(directory):
        try:
            st = os.stat(os.path.join(directory, name))
        except OSError:
            continue
        sizes[st.st_ino] = st.st_blocks * 512
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/maps") as f:
                for line in f:
                    if directory not in line:
                        continue
                    span, _, _, _, inode = line.split(None, 5)[:5]
                    lo, hi = (int(x, 16) for x in span.split("-"))
                    ino = int(inode)
                    sizes[ino] = max(sizes.get(ino, 0), hi - lo)
        except OSError:
            continue
    return sum(sizes.values())


def run_mode(shm_on: bool, args, weights: torch.Tensor, tmp: pathlib.Path) -> dict:
    from helpers import Server, ours_in

    import shm_embeds_client as sec

    env = {"VLLM_SHM_EMBEDS_MIN_BYTES": str(1 << 20)}
    if args.dev_shm:
        mnt = pathlib.Path(tempfile.mkdtemp(prefix="bench-load-", dir="/dev/shm"))
        env["VLLM_SHM_EMBEDS_MAX_BYTES"] = str(args.budget_mib << 20)
    else:
        mnt = tmp / "shm"
        mnt.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.tmpfs_mib}m", "tmpfs",
                        str(mnt)], check=True)
    try:
        server = Server(tmp, "-tp", "2", shm_on=shm_on, seg_dir=str(mnt), check_clean=False,
                        model=os.path.join(ROOT, ".models", "wide"),
                        max_model_len=max(args.sizes) + args.max_tokens + 64,
                        env_extra=env).start()
        api = psutil.Process(server.proc.pid)
        tree = [api, *api.children(recursive=True)]
        rss0 = api.memory_info().rss
        peak = {"rss": rss0, "fs": 0}
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                if args.dev_shm:
                    peak["fs"] = max(peak["fs"], held_in(str(mnt), tree))
                else:
                    st = os.statvfs(str(mnt))
                    peak["fs"] = max(peak["fs"], (st.f_blocks - st.f_bfree) * st.f_frsize)
                try:
                    peak["rss"] = max(peak["rss"], api.memory_info().rss)
                except psutil.Error:
                    pass
                time.sleep(0.05)

        gen = torch.Generator().manual_seed(16)
        tensors = [weights[torch.randint(3, weights.shape[0], (n,), generator=gen)]
                   .contiguous() for n in args.sizes]
        # encoded before the clock
        bodies = {i: _json_body(t, args.max_tokens) for i, t in enumerate(tensors)}
        jobs = [(k, i) for i, k in enumerate(args.kinds)]
        jobs += [("text", i) for i in range(args.text)] + [("stalled", i)
                                                            for i in range(args.stalled)]

        def one(job):
            kind, i = job
            t0 = time.monotonic()
            try:
                if kind == "stalled":
                    return kind, _stall(server.url, tensors[0], args.stall_s), None
                if kind == "binary" and shm_on:
                    sec.complete(server.url, "tiny", tensors[i], max_tokens=args.max_tokens,
                                 temperature=0.0, timeout=600)
                    code = "200"
                elif kind in ("binary", "json"):
                    r = requests.post(server.url + "/v1/completions", data=bodies[i],
                                      headers={"Content-Type": "application/json"},
                                      timeout=600)
                    code = str(r.status_code)
                else:
                    r = requests.post(server.url + "/v1/completions", timeout=600,
                                      json={"model": "tiny", "prompt": f"text {i} " * 50,
                                            "max_tokens": args.max_tokens,
                                            "temperature": 0.0})
                    code = str(r.status_code)
            except requests.Timeout:
                code = "timeout"
            except Exception as e:  # the binary client raises on a 4xx/5xx
                code = str(e)[:40]
            return kind, code, time.monotonic() - t0

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(one, jobs))
        time.sleep(2)
        stop.set()
        sampler.join()
        healthy = requests.get(server.url + "/health", timeout=10).status_code == 200
        left = ours_in(str(mnt))
        server.close()
    finally:
        if args.dev_shm:
            shutil.rmtree(mnt, ignore_errors=True)
        else:
            subprocess.run(["umount", str(mnt)])
    out = {"mode": "shm-embeds" if shm_on else "stock", "healthy_after": healthy,
           "left": left, "api_rss_peak_mb": (peak["rss"] - rss0) / 2**20,
           "fs_peak_mb": peak["fs"] / 2**20, "kinds": {}}
    for kind in ("binary", "json", "text", "stalled"):
        rs = [r for r in results if r[0] == kind]
        if not rs:
            continue
        codes: dict[str, int] = {}
        for _, c, _ in rs:
            codes[c] = codes.get(c, 0) + 1
        ttft = [d for _, c, d in rs if c == "200" and d is not None]
        out["kinds"][kind] = {"outcomes": codes, "ttft_p50_s": _pct(ttft, 0.5),
                              "ttft_p99_s": _pct(ttft, 0.99)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per embeds request")
    ap.add_argument("--binary", type=int, default=12)
    ap.add_argument("--json", type=int, default=12)
    ap.add_argument("--text", type=int, default=4)
    ap.add_argument("--stalled", type=int, default=4)
    ap.add_argument("--stall-s", type=float, default=45.0)
    ap.add_argument("--tmpfs-mib", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="4+4 requests of 256 tokens")
    ap.add_argument("--mixed", type=int, metavar="N",
                    help="N requests at once instead: 1-128 MiB embeds, every fourth text")
    ap.add_argument("--dev-shm", action="store_true",
                    help="segment directory on /dev/shm itself, with --budget-mib")
    ap.add_argument("--budget-mib", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--out", help="default benchmarks/results/load.json (load_mixed.json)")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.binary, args.json, args.stalled, args.stall_s = 256, 4, 4, 2, 35.0
    from helpers import embed_weights

    weights = embed_weights(os.path.join(ROOT, ".models", "wide"))
    row = weights.shape[1] * weights.element_size()
    if args.mixed:
        import random

        embeds = [i for i in range(args.mixed) if i % 4 != 3]
        lo, hi = (1 << 20) // row, (128 << 20) // row  # tokens of 1 MiB and 128 MiB
        sizes = [round(lo * (hi / lo) ** (j / max(1, len(embeds) - 1)))
                 for j in range(len(embeds))]
        random.Random(16).shuffle(sizes)
        args.sizes = sizes
        args.kinds = ["binary" if j % 2 == 0 else "json" for j in range(len(embeds))]
        args.text, args.stalled = args.mixed - len(embeds), 0
        args.binary, args.json = args.kinds.count("binary"), args.kinds.count("json")
    else:
        args.sizes = [args.tokens] * (args.binary + args.json)
        args.kinds = ["binary"] * args.binary + ["json"] * args.json
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-load-"))
    runs = [run_mode(on, args, weights, tmp / str(int(on))) for on in (False, True)]
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                        ("load_mixed" if args.mixed else "load")
                                        + ("_dev_shm" if args.dev_shm else "") + ".json")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    mbs = sorted(n * row / 2**20 for n in args.sizes)
    size = f"{mbs[0]:.0f}" if mbs[0] == mbs[-1] else f"{mbs[0]:.0f}-{mbs[-1]:.0f}"
    where = (f"/dev/shm, budget {args.budget_mib} MiB" if args.dev_shm
             else f"{args.tmpfs_mib} MiB tmpfs")
    print(f"\n{args.binary} binary + {args.json} JSON requests of {size} MiB, {args.text} "
          f"text, {args.stalled} stalled uploads, max_tokens {args.max_tokens}; "
          f"segment dir: {where}")
    print("| mode | kind | outcomes | TTFT p50 s | TTFT p99 s |")
    print("|---|---|---|---:|---:|")
    for r in runs:
        for kind, k in r["kinds"].items():
            p50 = "-" if k["ttft_p50_s"] is None else f"{k['ttft_p50_s']:.1f}"
            p99 = "-" if k["ttft_p99_s"] is None else f"{k['ttft_p99_s']:.1f}"
            print(f"| {r['mode']} | {kind} | {k['outcomes']} | {p50} | {p99} |")
    fs = "segments held peak MB" if args.dev_shm else "segment fs peak MB"
    print()
    print(C.markdown_table(
        [{**r, "left_n": len(r["left"])} for r in runs],
        [("mode", "mode", "s"), ("api_rss_peak_mb", "API server peak RSS growth MB", ".0f"),
         ("fs_peak_mb", fs, ".0f"), ("left_n", "left", "d"), ("healthy_after", "healthy", "")]))


if __name__ == "__main__":
    main()
