# SPDX-License-Identifier: Apache-2.0
"""A multi-turn chat: each turn a user message of embeds rows and an assistant reply.

``bench_conversation.py``'s chat counterpart (issue 54): one chat of ``--turns`` (10)
turns, each a user message of ``--new-rows`` (1024) embeds rows (the wide model's
embedding rows of random token ids: hidden 8192, fp32, 32 MiB) and, after the answer,
the assistant reply ``"reply <turn>"`` as text; the model's own chat template
(``.models/wide/chat_template.jinja``), TP=2, prefix caching on, ``max_tokens=1``,
greedy. Modes, a stock server (``VLLM_SHM_EMBEDS=0``) then a plugin server:

* ``text``: stock, each user message as the text of its token ids (about as many tokens);
* ``stock_same``: stock, every embeds part as base64 ``torch.save`` in the JSON body,
  the whole history each turn, the same bytes; ``stock_fresh``: fresh small noise on
  every part each turn (a stochastic transform: the prefix cache cannot hit);
* ``plugin_resend``: plugin, the whole history each turn in a binary chat body;
* ``plugin_kept``: plugin, ``shm_embeds_client.ChatConversation(body="binary")``: the
  earlier parts named by the kept id, only the new part sent;
  ``plugin_kept_fresh``: the same with fresh noise on the new part;
  ``plugin_kept_json``: ``body="json"`` (the new part as base64).

Per turn: TTFT (client side, encoding included), wire bytes, API server + EngineCore
CPU (``bench_conversation.cpu_of``), prefix-cache hit tokens, the plugin's counters.
Answers of the non-fresh embeds modes must equal ``stock_same``'s (exit 1 otherwise,
also on a miss or anything left in ``/dev/shm``).

    .venv/bin/python benchmarks/bench_chat.py            # 10 turns x 1024 rows, 1 rep: ~8 min
    .venv/bin/python benchmarks/bench_chat.py --quick    # 4 turns x 256 rows
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

import httpx
import requests
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import bench_conversation as B  # noqa: E402

MODES = ("text", "stock_same", "stock_fresh", "plugin_resend", "plugin_kept",
         "plugin_kept_fresh", "plugin_kept_json")
PLUGIN = {m for m in MODES if m.startswith("plugin_")}
FRESH = {"stock_fresh", "plugin_kept_fresh"}
KEPT = {"plugin_kept", "plugin_kept_fresh", "plugin_kept_json"}


def _b64(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def _messages(parts: list, replies: list[str], data=lambda t: t) -> list[dict]:
    """user part 1, reply 1, ..., user part N (a tensor as ``data(tensor)``, a str as text)."""
    out = []
    for i, p in enumerate(parts):
        out.append({"role": "user", "content": p if isinstance(p, str) else
                    [{"type": "prompt_embeds", "data": data(p)}]})
        if i < len(replies):
            out.append({"role": "assistant", "content": replies[i]})
    return out


def run_chat(mode: str, rep: int, server, procs, turns: B.Turns, texts: list[str], args,
             nonce: str) -> list[dict]:
    import shm_embeds_client as sec

    salt = f"chat-{nonce}-{mode}-{rep}"
    fields = {"model": B.MODEL, "max_tokens": 1, "temperature": 0.0, "cache_salt": salt}
    sent: list[int] = []
    client = httpx.Client(timeout=600, event_hooks={"request": [
        lambda req: sent.append(int(req.headers.get("Content-Length", 0)))]})
    # Several API servers: a new connection each turn, so that turns spread over them.
    spread = {"Connection": "close"} if args.api_servers > 1 else None
    conv = (sec.ChatConversation(server.url, B.MODEL, ttl_s=args.ttl_s, cache_salt=salt,
                                 client=client, headers=spread,
                                 body="json" if mode == "plugin_kept_json" else "binary")
            if mode in KEPT else None)
    counters, samples = B.prefix_counters(server.url), []
    before_memfds = {i for p in procs["api"] for i in B.memfds(p)}  # other chats' kept rows
    try:
        for turn in range(1, turns.n + 1):
            new = turns.embeds[(turn - 1) * turns.rows:turn * turns.rows]
            parts: list = []
            replies = [f"reply {t}" for t in range(1, turn)]
            if mode == "stock_fresh":
                parts = [turns.noisy(turns.embeds[t * turns.rows:(t + 1) * turns.rows],
                                     mode, rep, turn * 1000 + t) for t in range(turn)]
            elif mode == "plugin_kept_fresh":
                new = turns.noisy(new, mode, rep, turn)
            else:
                parts = [turns.embeds[t * turns.rows:(t + 1) * turns.rows].clone()
                         for t in range(turn)]
            sent.clear()
            stats0 = server.totals() if mode in PLUGIN else {}
            cpu0 = B.cpu_of(procs)
            t0 = time.monotonic()
            try:
                if mode in KEPT:
                    if turn > 1:
                        conv.messages[-1]["content"] = replies[-1]  # the same text every mode
                    out = conv.send(new.clone(), **{k: v for k, v in fields.items()
                                                    if k not in ("model", "cache_salt")})
                    wire = sum(sent)
                elif mode == "plugin_resend":
                    out = sec.chat(server.url, B.MODEL, timeout=600,
                                   messages=_messages(parts, replies),
                                   **{k: v for k, v in fields.items() if k != "model"})
                    wire = None
                else:
                    # (base64 of torch.save of every part, as vLLM's docs send it)
                    msgs = _messages(texts[:turn] if mode == "text" else parts, replies, _b64)
                    body = json.dumps({**fields, "messages": msgs}).encode()
                    out = B._check(requests.post(server.url + "/v1/chat/completions",
                                                 data=body, timeout=600, headers={
                                                     "Content-Type": "application/json",
                                                     **(spread or {})}),
                                   mode, turn)
                    wire = len(body)
            except (httpx.HTTPError, requests.RequestException) as e:
                raise B.BenchError(f"{mode} turn {turn}: {e!r}") from None
            ttft = (time.monotonic() - t0) * 1e3
            time.sleep(args.gap)
            cpu1 = B.cpu_of(procs)
            if wire is None:
                wire = sec.frame({**fields, "messages": _messages(parts, replies)}, "chat")[2]
            s = {"mode": mode, "rep": rep, "turn": turn, "history_rows": turn * turns.rows,
                 "wire_bytes": wire, "ttft_ms": ttft,
                 "answer": out["choices"][0]["message"]["content"],
                 **{f"{role}_cpu_s": cpu1[role] - cpu0[role] for role in cpu0}}
            s["server_cpu_s"] = s["api_cpu_s"] + s["engine_cpu_s"]
            if mode in PLUGIN:
                from helpers import delta

                s["plugin_counters"] = delta(stats0, server.totals())
                s["sibling_hits"] = s["plugin_counters"].get("sibling_hits", 0)
                s["shm_bytes"] = sum(b for p in procs["api"] for i, b in B.memfds(p).items()
                                     if i not in before_memfds)
            if conv is not None:
                s["sent_rows"], s["misses"] = conv.last_sent_rows, conv.misses
                s["kept"] = conv.kept_id is not None
            counters = B.record(server.url, s, counters, samples)
    finally:
        client.close()
    return samples


def run_server(plugin: bool, modes: list[str], args, turns, texts, tmp, nonce,
               leftovers) -> list[dict]:
    from helpers import Server, ours_in, private_dirs_in

    name = "plugin" if plugin else "stock"
    several = ("--api-server-count", str(args.api_servers)) if args.api_servers > 1 else ()
    server = Server(tmp / name, "-tp", "2", *several, shm_on=plugin, check_clean=False,
                    serve_cli=args.api_servers > 1, model=os.path.join(ROOT, ".models", "wide"),
                    max_model_len=min(16384, args.turns * (2 * args.new_rows + 64) + 64),
                    env_extra={"VLLM_SHM_EMBEDS_MIN_BYTES": str(1 << 20)})
    (tmp / name).mkdir(parents=True, exist_ok=True)
    samples, pids = [], []
    try:
        server.start()
        procs = B.server_procs(server, args.api_servers)
        pids = [p for v in procs.values() for p in v]
        B.warm_up(server, turns, plugin)
        for rep in range(args.reps):
            for mode in modes:
                samples += run_chat(mode, rep, server, procs, turns, texts, args, nonce)
    finally:
        seg_dir = server.seg_dir
        server.close()
        left = ours_in(seg_dir) + private_dirs_in(seg_dir) if os.path.isdir(seg_dir) else []
        left += C.our_segments(pids) if plugin else []
        leftovers[name] = left
        print(f"[{name}] stopped; left in /dev/shm: {left or 'nothing'}", flush=True)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--new-rows", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="4 turns x 256 rows")
    C.add_modes_arg(ap, MODES)
    ap.add_argument("--noise", type=float, default=1e-3)
    ap.add_argument("--gap", type=float, default=1.5)
    ap.add_argument("--ttl-s", type=float, default=120.0)
    ap.add_argument("--api-servers", type=int, default=1,
                    help="--api-server-count of both servers; above 1 each turn opens a new "
                         "connection (turns spread over the API servers)")
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "chat.json"))
    args = ap.parse_args()
    C.check_modes(ap, args, MODES)
    if args.quick:
        args.turns, args.new_rows = 4, 256
    from transformers import AutoTokenizer

    from helpers import embed_weights

    t_start, info = time.monotonic(), C.machine_info()
    wide = os.path.join(ROOT, ".models", "wide")
    turns = B.Turns(args, embed_weights(wide))
    tok = AutoTokenizer.from_pretrained(wide)
    texts = [tok.decode(turns.ids[t * turns.rows:(t + 1) * turns.rows].tolist())
             for t in range(turns.n)]
    tmp, nonce = pathlib.Path(tempfile.mkdtemp(prefix="bench-chat-")), os.urandom(4).hex()
    leftovers: dict[str, list] = {}
    samples: list[dict] = []
    try:
        for plugin in (False, True):
            modes = [m for m in args.modes if (m in PLUGIN) == plugin]
            if modes:
                samples += run_server(plugin, modes, args, turns, texts, tmp, nonce, leftovers)
    except B.BenchError as e:
        print(f"\nFAILED: {e}", file=sys.stderr)
        sys.exit(1)
    ref_mode = next((m for m in ("stock_same", "plugin_resend") if m in args.modes), None)
    ref = {s["turn"]: s["answer"] for s in samples if s["mode"] == ref_mode and s["rep"] == 0}
    rows = B.per_turn(samples, ref)
    for r in rows:
        if r["mode"] == "text":
            r["match"] = "-"  # (its prompt is other tokens)
    summary = B.summarize(rows, args.modes)
    problems = [f"{r['mode']} turn {r['turn']}: {r['answers']} != {ref[r['turn']]}"
                for r in rows if r["match"] == "NO" and r["mode"] not in FRESH]
    problems += [f"{s['mode']} turn {s['turn']}: kept {s['kept']}, misses {s['misses']}, "
                 f"sent {s['sent_rows']} rows" for s in samples if s["mode"] in KEPT and (
                     not s["kept"] or s["misses"] or s["sent_rows"] != args.new_rows)]
    problems += [f"{n} server left in /dev/shm: {left}" for n, left in leftovers.items() if left]
    for mode in args.modes:
        print(f"\n== {mode} ==")
        C.print_table([r for r in rows if r["mode"] == mode], B.ROW_COLS)
    print("\n== summary (turn N = the last; server CPU = API server + EngineCore) ==")
    C.print_table(summary, B.SUMMARY_COLS)
    md = C.markdown_table(summary, B.SUMMARY_COLS)
    print(f"\nmarkdown for docs/figures.md:\n\n{md}\n")
    C.write_json(args.out, {
        "command": [sys.executable, *sys.argv], "date": info["time"], "machine": info,
        "config": {**vars(args), "reference_mode": ref_mode, "noise_std": turns.noise_std},
        "samples": samples, "rows": rows, "summary": summary, "markdown": md,
        "leftovers": leftovers, "problems": problems, "wall_s": time.monotonic() - t_start})
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(1)
    print(f"OK: wrote {args.out}")


if __name__ == "__main__":
    main()
