# SPDX-License-Identifier: Apache-2.0
"""A multi-turn conversation: each turn resends the whole history, or sends its new rows.

One conversation of ``--turns`` (10) turns of ``--new-rows`` (1024) new rows
each, on the wide model (hidden 8192, fp32: 32 MiB per turn), TP=2,
``--enable-prompt-embeds``, prefix caching on (vLLM's default), through
tests/helpers.py's launcher. Every turn is a ``/v1/completions`` request with
``max_tokens=1``, greedy. The embeds are the model's embedding rows of random
token ids, so every mode's answer for a turn is the token-id prompt's answer.
The modes, a stock server (``VLLM_SHM_EMBEDS=0``) then a plugin server
(``VLLM_SHM_EMBEDS=1``), one at a time (2 cores):

* ``text``: stock, the history as token ids (``prompt``: a list of ids);
* ``stock_same``: stock, base64 JSON ``prompt_embeds`` (``torch.save`` +
  base64, as vLLM's docs do), the whole history each turn, the same bytes;
* ``stock_fresh``: as ``stock_same``, the history's rows with fresh small
  noise each turn (a stochastic transform: the prefix cache cannot hit);
* ``plugin_text``: ``text`` on the plugin server;
* ``plugin_resend``: plugin, binary body (``shm_embeds_client.complete``),
  the whole history each turn, the same bytes;
* ``plugin_resend_fresh``: as ``plugin_resend`` with fresh noise each turn;
* ``plugin_kept``: plugin, ``shm_embeds_client.Conversation``: each turn is
  kept by the server (``--ttl-s``, 60) and the next sends the kept id and its
  new rows only;
* ``plugin_kept_fresh``: as ``plugin_kept`` with fresh noise in the new rows
  (the kept rows are the server's: the history never changes);
* ``plugin_kept_json``: as ``plugin_kept`` in base64 JSON bodies
  (``Conversation(body="json")``: a continuation is the JSON object of
  docs/conversations.md).

Each conversation runs ``--reps`` (2) times (reps outer, modes inner; each
conversation under a ``cache_salt`` of its own, so none hits another's prefix
cache). Per turn it records the request body's bytes, the client-side latency
of the one-token request (the TTFT reported: the client's encoding included,
the noise of the fresh modes not), the CPU seconds of the API server, the
EngineCore and the TP workers (``/proc/<pid>/stat`` utime + stime, from just
before the request to ``--gap`` (1.5) s after its answer: vLLM's broadcast
readers spin 1 s after each step, so every turn carries about that much worker
and EngineCore CPU whatever its input), the shared memory the kept tensors
hold after the turn (the API server's kept memfds plus this conversation's files
in the plugin's private segment directory; request segments are gone by then), and vLLM's ``vllm:prefix_cache_hits`` /
``_queries`` deltas (tokens). Tables show the median over reps per turn.
Answers are compared per turn with the token-id answers (``return_token_ids``);
a mismatch fails the run except in the fresh modes, where it is recorded.
A non-200 answer fails the run at once.

    .venv/bin/python benchmarks/bench_conversation.py            # 10 turns x 1024 rows, 2 reps: ~10 min
    .venv/bin/python benchmarks/bench_conversation.py --quick    # 4 turns x 256 rows, 1 rep: ~2 min
    .venv/bin/python benchmarks/bench_conversation.py --modes text,plugin_kept --turns 6
    .venv/bin/python benchmarks/bench_conversation.py --modes text,plugin_kept --data-parallel 2

``--api-servers N`` runs both servers with ``--api-server-count N``; ``--data-parallel
N`` with ``--data-parallel-size N`` instead (TP=1 per rank, N API servers). With
several API servers each kept turn opens a new connection, so turns spread.

Writes ``benchmarks/results/conversation.json`` (``--out``): the command line,
the date, ``machine_info``, every sample, the per-turn medians and the
summary; prints a per-turn table per mode, the summary (turn-N TTFT and its
ratio to ``text``, server CPU per turn first vs last, total wire bytes), and
the summary as a markdown table for docs/figures.md. Exit status 1 if an
answer of a non-fresh mode differs, a kept conversation missed its prefix, or
anything of the servers' is left in ``/dev/shm``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import pathlib
import sys
import tempfile
import time
import zlib

import httpx
import requests
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the one server launcher: helpers.Server
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MODES = ("text", "stock_same", "stock_fresh", "plugin_text", "plugin_resend",
         "plugin_resend_fresh", "plugin_kept", "plugin_kept_fresh", "plugin_kept_json")
PLUGIN_MODES = {m for m in MODES if m.startswith("plugin_")}
FRESH = {"stock_fresh", "plugin_resend_fresh", "plugin_kept_fresh"}
KEPT = {"plugin_kept", "plugin_kept_fresh", "plugin_kept_json"}
TEXT = {"text", "plugin_text"}
MODEL = "tiny"  # the launcher's --served-model-name
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
TICK = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    """A step of the benchmark failed (a non-200 answer, a server gone)."""


# -- what the server spends --------------------------------------------------------


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), seconds, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()  # fields 3.. of proc(5)
    return (int(fields[11]) + int(fields[12])) / TICK


def server_procs(server, api_servers: int = 1, engines: int = 1) -> dict[str, list[int]]:
    """The API servers' pids (``vllm serve``'s ``APIServer`` children when there are
    several, else the server's own), the EngineCores' (one per DP rank) and the
    workers'."""
    from helpers import descendants

    engine = [p.pid for p in descendants(server.proc, "EngineCore")]
    workers = [p.pid for p in descendants(server.proc, "Worker") if p.pid not in engine]
    api = ([p.pid for p in descendants(server.proc, "APIServer")] if api_servers > 1
           else [server.proc.pid])
    if len(engine) != engines or not workers or len(api) != api_servers:
        raise BenchError(f"expected {engines} EngineCore(s), workers and {api_servers} API "
                         f"servers under the server, found EngineCore {engine}, workers "
                         f"{workers}, API servers {api}")
    return {"api": api, "engine": engine, "workers": workers}


def cpu_of(procs: dict[str, list[int]]) -> dict[str, float]:
    return {role: sum(cpu_s(p) for p in pids) for role, pids in procs.items()}


def prefix_counters(url: str) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens), summed over engines and labels."""
    r = requests.get(url + "/metrics", timeout=30)
    if r.status_code != 200:
        raise BenchError(f"/metrics answered {r.status_code}")
    out = {HITS: 0.0, QUERIES: 0.0}
    seen = set()
    for line in r.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
            seen.add(name)
    if seen != set(out):
        raise BenchError(f"/metrics has no {sorted(set(out) - seen)} (vLLM renamed them?)")
    return out


def seg_files(seg_dir: str) -> dict[str, int]:
    """Files under the segment directory (the plugin's private one inside it):
    path -> bytes allocated."""
    out = {}
    for d, _, files in os.walk(seg_dir):
        for n in files:
            try:
                out[os.path.join(d, n)] = os.lstat(os.path.join(d, n)).st_blocks * 512
            except OSError:
                pass
    return out


def memfds(pid: int) -> dict[int, int]:
    """The kept conversations' memfds (``ext/conversations/tips.py``) that process
    ``pid`` holds open (shared memory outside any directory): inode -> bytes allocated."""
    out, fd_dir = {}, f"/proc/{pid}/fd"
    for n in os.listdir(fd_dir):
        try:
            if os.readlink(os.path.join(fd_dir, n)).startswith("/memfd:shm-embeds-kept"):
                st = os.stat(os.path.join(fd_dir, n))
                out[st.st_ino] = st.st_blocks * 512
        except OSError:
            pass
    return out


# -- requests ------------------------------------------------------------------


def _check(r, mode: str, turn: int) -> dict:
    if r.status_code != 200:
        raise BenchError(f"{mode} turn {turn}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def answer_of(out: dict):
    """The one generated token's id (``return_token_ids``), else its text."""
    choice = out["choices"][0]
    ids = choice.get("token_ids")
    return ids[0] if ids else choice.get("text")


def json_embeds_body(t: torch.Tensor, fields: dict) -> bytes:
    """vLLM's documented online form: base64 of ``torch.save`` in a JSON body."""
    buf = io.BytesIO()
    torch.save(t, buf)
    return json.dumps({**fields, "prompt_embeds": base64.b64encode(buf.getvalue()).decode()}
                      ).encode()


class Turns:
    """The conversation's data: token ids, their embedding rows, and fresh noise."""

    def __init__(self, args, weights: torch.Tensor) -> None:
        self.n, self.rows = args.turns, args.new_rows
        gen = torch.Generator().manual_seed(args.seed)
        self.ids = torch.randint(3, weights.shape[0], (self.n * self.rows,), generator=gen)
        self.embeds = weights[self.ids].contiguous()
        self.noise_std = args.noise * float(weights.std())
        self.seed = args.seed

    def noisy(self, t: torch.Tensor, mode: str, rep: int, turn: int) -> torch.Tensor:
        """``t`` plus fresh Gaussian noise (its own seed per mode, rep and turn)."""
        seed = zlib.crc32(f"{self.seed}/{mode}/{rep}/{turn}".encode())
        gen = torch.Generator().manual_seed(seed)
        return t + torch.randn(t.shape, generator=gen) * self.noise_std


def record(url: str, s: dict, counters: dict, samples: list[dict]) -> dict:
    """Add the turn's prefix-cache deltas to sample ``s`` (since ``counters``), keep and
    print it; returns the counters now."""
    now = prefix_counters(url)
    s["hit_tokens"] = now[HITS] - counters[HITS]
    s["query_tokens"] = now[QUERIES] - counters[QUERIES]
    samples.append(s)
    print(f"  {s['mode']} rep {s['rep']} turn {s['turn']}: {s['wire_bytes'] / C.MIB:8.1f} MiB, "
          f"{s['ttft_ms']:8.0f} ms, server CPU {s['server_cpu_s']:.2f} s, "
          f"hits {s['hit_tokens']:.0f}/{s['query_tokens']:.0f}", flush=True)
    return now


def run_conversation(mode: str, rep: int, server, procs, turns: Turns, args,
                     nonce: str) -> list[dict]:
    import shm_embeds_client as sec

    salt = f"conv-{nonce}-{mode}-{rep}"
    fields = {"model": MODEL, "max_tokens": 1, "temperature": 0.0, "cache_salt": salt,
              "return_token_ids": True}
    url = server.url
    sent: list[int] = []  # Content-Length of each request the Conversation sends
    client = httpx.Client(timeout=600, event_hooks={"request": [
        lambda req: sent.append(int(req.headers.get("Content-Length", 0)))]})
    # Several API servers: a new connection each turn, so that turns spread over them.
    spread = {"Connection": "close"} if api_server_count(args) > 1 else None
    conv = (sec.Conversation(url, MODEL, ttl_s=args.ttl_s, cache_salt=salt, client=client,
                             body="json" if mode == "plugin_kept_json" else "binary",
                             headers=spread)
            if mode in KEPT else None)
    before_files = set(seg_files(server.seg_dir)) if mode in PLUGIN_MODES else set()
    before_memfds = {i for p in procs["api"] for i in memfds(p)}  # other conversations'
    counters = prefix_counters(url)
    samples = []
    try:
        for turn in range(1, turns.n + 1):
            end = turn * turns.rows
            # What the client holds before the clock: the history (a tensor of its
            # own: torch.save of a view would save the whole storage), its noise.
            if mode in TEXT:
                payload = turns.ids[:end]
            elif mode in KEPT:
                payload = turns.embeds[end - turns.rows:end]
                if mode in FRESH:
                    payload = turns.noisy(payload, mode, rep, turn)
            elif mode in FRESH:
                payload = turns.noisy(turns.embeds[:end], mode, rep, turn)
            else:
                payload = turns.embeds[:end].clone()
            sent.clear()
            stats0 = server.totals() if mode in PLUGIN_MODES else {}
            cpu0 = cpu_of(procs)
            t0 = time.monotonic()
            try:
                if mode in TEXT:
                    body = json.dumps({**fields, "prompt": payload.tolist()}).encode()
                    out = _check(requests.post(url + "/v1/completions", data=body, timeout=600,
                                               headers={"Content-Type": "application/json"}),
                                 mode, turn)
                    wire = len(body)
                elif mode.startswith("stock_"):
                    body = json_embeds_body(payload, fields)
                    out = _check(requests.post(url + "/v1/completions", data=body, timeout=600,
                                               headers={"Content-Type": "application/json"}),
                                 mode, turn)
                    wire = len(body)
                elif mode in KEPT:
                    out = conv.complete(payload, max_tokens=1, temperature=0.0,
                                        return_token_ids=True)
                    wire = sum(sent)
                else:
                    out = sec.complete(url, MODEL, payload, timeout=600, **{
                        k: v for k, v in fields.items() if k != "model"})
                    wire = None  # below, outside the clock
            except httpx.HTTPStatusError as e:
                raise BenchError(f"{mode} turn {turn}: {e}") from None
            except (requests.RequestException, httpx.HTTPError) as e:
                raise BenchError(f"{mode} turn {turn}: request failed: {e!r}") from None
            ttft = (time.monotonic() - t0) * 1e3
            time.sleep(args.gap)  # let the readers' spin end inside this turn's window
            cpu1 = cpu_of(procs)
            if wire is None:
                wire = sec.frame({**fields, "prompt_embeds": payload})[2]
            s = {"mode": mode, "rep": rep, "turn": turn, "history_rows": end,
                 "wire_bytes": wire, "ttft_ms": ttft, "answer": answer_of(out),
                 **{f"{role}_cpu_s": cpu1[role] - cpu0[role] for role in cpu0}}
            s["server_cpu_s"] = s["api_cpu_s"] + s["engine_cpu_s"]
            if mode in PLUGIN_MODES:
                files = seg_files(server.seg_dir)
                s["shm_bytes"] = (sum(v for k, v in files.items() if k not in before_files)
                                  + sum(b for p in procs["api"] for i, b in memfds(p).items()
                                        if i not in before_memfds))
                s["shm_dir_bytes"] = sum(files.values())
                from helpers import delta

                s["plugin_counters"] = delta(stats0, server.totals())
                s["sibling_hits"] = s["plugin_counters"].get("sibling_hits", 0)
            if conv is not None:
                s["sent_rows"], s["misses"] = conv.last_sent_rows, conv.misses
                s["kept"] = conv.kept_id is not None
            counters = record(url, s, counters, samples)
    finally:
        client.close()
    return samples


def warm_up(server, turns: Turns, plugin: bool) -> None:
    """One text and one embeds request of a turn's size (not measured): the
    first request on a fresh server pays one-off costs."""
    import shm_embeds_client as sec

    fields = {"model": MODEL, "max_tokens": 1, "temperature": 0.0,
              "cache_salt": f"warm-{os.getpid()}"}
    t = turns.embeds[:turns.rows].clone()
    r = requests.post(server.url + "/v1/completions", timeout=600,
                      json={**fields, "prompt": turns.ids[:turns.rows].tolist()})
    _check(r, "warm-up text", 0)
    r = requests.post(server.url + "/v1/completions", data=json_embeds_body(t, fields),
                      headers={"Content-Type": "application/json"}, timeout=600)
    _check(r, "warm-up JSON embeds", 0)
    if plugin:
        sec.complete(server.url, MODEL, t, **{k: v for k, v in fields.items() if k != "model"})
    time.sleep(1.5)


def api_server_count(args) -> int:
    """API servers per server: ``--data-parallel`` N starts N (vLLM's default)."""
    return args.data_parallel if args.data_parallel > 1 else args.api_servers


def run_server(plugin: bool, modes: list[str], args, turns: Turns, tmp: pathlib.Path,
               nonce: str, leftovers: dict) -> list[dict]:
    from helpers import Server, ours_in, private_dirs_in

    name = "plugin" if plugin else "stock"
    if args.data_parallel > 1:  # as tests/conftest.py's dp_server: a TP=1 engine per rank
        topology = ("--data-parallel-size", str(args.data_parallel), "--no-async-scheduling")
    else:
        topology = ("-tp", "2", *(("--api-server-count", str(args.api_servers))
                                  if args.api_servers > 1 else ()))
    server = Server(tmp / name, *topology, shm_on=plugin, check_clean=False,
                    serve_cli=api_server_count(args) > 1,
                    model=os.path.join(ROOT, ".models", "wide"),
                    max_model_len=args.turns * args.new_rows + 64,
                    env_extra={"VLLM_SHM_EMBEDS_MIN_BYTES": str(1 << 20)})
    (tmp / name).mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    samples: list[dict] = []
    pids: list[int] = []
    try:
        server.start()
        procs = server_procs(server, api_server_count(args), args.data_parallel)
        pids = [p for v in procs.values() for p in v]
        print(f"[{name}] server up in {time.monotonic() - t:.0f} s: API {procs['api']}, "
              f"EngineCore {procs['engine']}, workers {procs['workers']}", flush=True)
        warm_up(server, turns, plugin)
        for rep in range(args.reps):
            for mode in modes:
                samples += run_conversation(mode, rep, server, procs, turns, args, nonce)
    finally:
        seg_dir = server.seg_dir
        server.close()  # SIGTERM; vLLM's own /dev/shm files removed if it left them
        left = ours_in(seg_dir) + private_dirs_in(seg_dir) if os.path.isdir(seg_dir) else []
        left += C.our_segments(pids) if plugin else []
        left += [f for f in getattr(server, "_vllm_files", ())
                 if os.path.exists(os.path.join("/dev/shm", f))]
        leftovers[name] = left
        print(f"[{name}] stopped; left in /dev/shm: {left or 'nothing'}", flush=True)
    return samples


# -- reporting -----------------------------------------------------------------

ROW_COLS = [("turn", "turn", "d"), ("history_rows", "rows", "d"), ("wire_mib", "wire MiB", ".1f"),
            ("ttft_ms", "TTFT ms", ".0f"), ("api_cpu_s", "API CPU s", ".2f"),
            ("engine_cpu_s", "EngineCore CPU s", ".2f"), ("workers_cpu_s", "workers CPU s", ".2f"),
            ("shm_mib", "kept in shm MiB", ".0f"), ("hit_tokens", "cache hits", ".0f"),
            ("query_tokens", "cache queries", ".0f"), ("misses", "misses", ".0f"),
            ("sibling_hits", "served by a sibling", ".0f"), ("match", "answer = text", "s")]
SUMMARY_COLS = [("mode", "mode", "s"), ("ttft_last_ms", "turn-N TTFT ms", ".0f"),
                ("x_text", "x text", ".2f"), ("cpu_first_s", "server CPU turn 1 s", ".2f"),
                ("cpu_last_s", "turn N s", ".2f"), ("cpu_slope_s", "+ s / turn", ".3f"),
                ("wire_total_mib", "wire MiB (all turns)", ".0f"),
                ("hits_last", "turn-N cache hits", ".0f"), ("shm_last_mib", "kept MiB turn N", ".0f"),
                ("answers", "answers = text", "s")]


def per_turn(samples: list[dict], ref: dict[int, object]) -> list[dict]:
    """Median over reps of each (mode, turn), with whether every rep's answer matched."""
    rows = []
    for (mode, turn), group in C.group_samples(samples, ("mode", "turn")):
        row = {"mode": mode, "turn": turn, "history_rows": group[0]["history_rows"]}
        for key in ("wire_bytes", "ttft_ms", "api_cpu_s", "engine_cpu_s", "workers_cpu_s",
                    "server_cpu_s", "shm_bytes", "hit_tokens", "query_tokens", "misses",
                    "sibling_hits"):
            vals = [s[key] for s in group if s.get(key) is not None]
            row[key] = C.median(vals) if vals else None
        row["wire_mib"] = row["wire_bytes"] / C.MIB
        row["shm_mib"] = None if row["shm_bytes"] is None else row["shm_bytes"] / C.MIB
        row["answers"] = [s["answer"] for s in group]
        row["match"] = ("-" if turn not in ref else
                        "yes" if all(a == ref[turn] for a in row["answers"]) else "NO")
        rows.append(row)
    return rows


def summarize(rows: list[dict], modes: list[str]) -> list[dict]:
    out = []
    base = next((m for m in ("text", "plugin_text") if m in modes), None)
    last_turn = max(r["turn"] for r in rows)
    text_last = next((r["ttft_ms"] for r in rows if r["mode"] == base and r["turn"] == last_turn),
                     None)
    for mode in modes:
        mr = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["turn"])
        if not mr:
            continue
        first, last = mr[0], mr[-1]
        matches = [r["match"] for r in mr if r["match"] != "-"]
        out.append({
            "mode": mode, "turns": len(mr), "ttft_last_ms": last["ttft_ms"],
            "x_text": last["ttft_ms"] / text_last if text_last else None,
            "cpu_first_s": first["server_cpu_s"], "cpu_last_s": last["server_cpu_s"],
            "cpu_slope_s": ((last["server_cpu_s"] - first["server_cpu_s"]) / (len(mr) - 1)
                            if len(mr) > 1 else None),
            "wire_total_mib": sum(r["wire_bytes"] for r in mr) / C.MIB,
            "hits_last": last["hit_tokens"], "shm_last_mib": last["shm_mib"],
            "answers": (f"{matches.count('yes')}/{len(matches)}" if matches else "-"),
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--new-rows", type=int, default=1024, help="new rows (tokens) per turn")
    ap.add_argument("--reps", type=int, default=2, help="conversations per mode")
    ap.add_argument("--quick", action="store_true", help="4 turns x 256 rows, 1 rep")
    C.add_modes_arg(ap, MODES)
    ap.add_argument("--noise", type=float, default=1e-3,
                    help="fresh modes: noise std as a fraction of the embedding table's std")
    ap.add_argument("--gap", type=float, default=1.5,
                    help="seconds after each answer before the CPU is read (vLLM's readers "
                         "spin 1 s after a step)")
    ap.add_argument("--ttl-s", type=float, default=60.0, help="kept modes: Shm-Embeds-Keep")
    ap.add_argument("--api-servers", type=int, default=1,
                    help="--api-server-count of both servers; above 1 each kept turn opens "
                         "a new connection (turns spread over the API servers)")
    ap.add_argument("--data-parallel", type=int, default=1,
                    help="--data-parallel-size of both servers (TP=1 per rank; vLLM then "
                         "starts that many API servers, and --api-servers is ignored)")
    ap.add_argument("--seed", type=int, default=37)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "conversation.json"))
    args = ap.parse_args()
    C.check_modes(ap, args, MODES)
    if args.quick:
        args.turns, args.new_rows, args.reps = 4, 256, 1
    from helpers import embed_weights

    t_start = time.monotonic()
    info = C.machine_info()
    weights = embed_weights(os.path.join(ROOT, ".models", "wide"))
    turns = Turns(args, weights)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-conversation-"))
    nonce = os.urandom(4).hex()
    leftovers: dict[str, list] = {}
    samples: list[dict] = []
    error = None
    try:
        for plugin in (False, True):
            modes = [m for m in args.modes if (m in PLUGIN_MODES) == plugin]
            if modes:
                samples += run_server(plugin, modes, args, turns, tmp, nonce, leftovers)
    except BenchError as e:
        error = str(e)
    if error:
        print(f"\nFAILED: {error}", file=sys.stderr)
        sys.exit(1)

    ref_mode = next((m for m in ("text", "plugin_text", "stock_same", "plugin_resend",
                                 "plugin_kept") if m in args.modes), None)
    ref = {s["turn"]: s["answer"] for s in samples if s["mode"] == ref_mode and s["rep"] == 0}
    rows = per_turn(samples, ref)
    summary = summarize(rows, args.modes)
    problems = []
    for r in rows:
        if r["match"] == "NO" and r["mode"] not in FRESH:
            problems.append(f"{r['mode']} turn {r['turn']}: answers {r['answers']} != "
                            f"{ref_mode}'s {ref[r['turn']]}")
    for s in samples:
        if s["mode"] in KEPT and (not s["kept"] or s["misses"]
                                  or (s["turn"] > 1 and s["sent_rows"] != args.new_rows)):
            problems.append(f"{s['mode']} rep {s['rep']} turn {s['turn']}: kept {s['kept']}, "
                            f"misses {s['misses']}, sent {s['sent_rows']} rows")
    for name, left in leftovers.items():
        if left:
            problems.append(f"{name} server left in /dev/shm: {left}")

    print(f"\n{args.turns} turns x {args.new_rows} new rows (hidden {weights.shape[1]} fp32, "
          f"{args.new_rows * weights.shape[1] * 4 / C.MIB:.0f} MiB per turn), {args.reps} "
          f"rep(s), median per turn; answers compared with {ref_mode}")
    for mode in args.modes:
        print(f"\n== {mode} ==")
        C.print_table([r for r in rows if r["mode"] == mode], ROW_COLS)
    print("\n== summary (turn N = the last; server CPU = API server + EngineCore) ==")
    C.print_table(summary, SUMMARY_COLS)
    md = C.markdown_table(summary, SUMMARY_COLS)
    print(f"\nmarkdown for docs/figures.md:\n\n{md}\n")
    payload = {
        "command": [sys.executable, *sys.argv], "date": info["time"], "machine": info,
        "config": {**vars(args), "hidden": weights.shape[1], "dtype": "float32",
                   "tp": 1 if args.data_parallel > 1 else 2,
                   "prefix_caching": "on (vLLM default)", "reference_mode": ref_mode,
                   "noise_std": turns.noise_std},
        "samples": samples, "rows": rows, "summary": summary, "markdown": md,
        "leftovers": leftovers, "problems": problems, "wall_s": time.monotonic() - t_start,
    }
    C.write_json(args.out, payload)
    print(f"wrote {args.out}; wall {payload['wall_s']:.0f} s")
    for r in rows:
        if r["match"] == "NO" and r["mode"] in FRESH:
            print(f"note: {r['mode']} turn {r['turn']}: the noise changed the answer "
                  f"({r['answers']} vs {ref[r['turn']]})")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(1)
    print("OK: answers as expected, nothing left in /dev/shm")


if __name__ == "__main__":
    main()
