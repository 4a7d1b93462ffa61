# SPDX-License-Identifier: Apache-2.0
"""How long each kind of miss takes to resolve, across API servers (issue 52).

An owner process keeps one tensor (40 x 8 fp32) under a salt; a second owner keeps one
and exits. A sibling (both forked from this process: the same uid and parent, as the API
servers of one ``vllm serve``) then resolves ``--n`` (500) times each, in a random order, with
``prefixes.HOOK.resolve`` (what a continuation's body does before a byte is read):

* ``hit``: the id under its salt (a pin round trip, then let go);
* ``other_salt``: the id under another salt (live owner);
* ``unknown_id``: a random id with the live owner's tag;
* ``exited_owner``: an id kept by the owner that exited (its tag's socket is gone);
* ``local_unknown``: a random id with the sibling's own tag (no round trip).

Every miss must be a ``PrefixNotFound`` (404) with the one message; prints the median,
p90 and p99 in microseconds and writes ``benchmarks/results/misses.json`` (``--out``).

    .venv/bin/python benchmarks/bench_misses.py
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import secrets
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

ROWS, HIDDEN, SALT = 40, 8, "salt-a"
KINDS = ("hit", "other_salt", "unknown_id", "exited_owner", "local_unknown")


def _several() -> None:
    from vllm._shm_embeds.ext.binary import common

    common._api_servers = 2  # (vLLM's _api_process_count: ids carry tags, siblings listen)


def _owner(conn) -> None:
    from vllm._shm_embeds.ext.conversations import prefixes

    _several()
    tip = prefixes.new_tip(torch.float32, ROWS, HIDDEN)
    tip.ensure(ROWS)
    tip.write(memoryview(bytes(ROWS * HIDDEN * 4)), 0)
    kid = prefixes.store().put(tip, ROWS, None, SALT, 600, 16)
    prefixes.store().let_go(tip)
    conn.send(kid)
    conn.recv()  # until told to exit


def _sibling(conn, live: str, dead: str, n: int) -> None:
    from vllm._shm_embeds.ext.conversations import prefixes, store

    _several()
    own = prefixes.store().tag
    tail = 43 - store.TAG_CHARS
    asks = {"hit": (live, SALT), "other_salt": (live, "salt-b"),
            "unknown_id": (store.tag_of(live) + secrets.token_urlsafe(32)[:tail], SALT),
            "exited_owner": (dead, SALT),
            "local_unknown": (own + secrets.token_urlsafe(32)[:tail], SALT)}
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    messages = set()
    rng = random.Random(7)
    for _ in range(n):
        for kind in rng.sample(KINDS, len(KINDS)):  # (a random order: no kind after another)
            kid, salt = asks[kind]
            t = time.perf_counter()
            try:
                prefixes.HOOK.resolve(kid, {"cache_salt": salt}, torch.float32, HIDDEN).release()
                got = "hit"
            except prefixes.PrefixNotFound as e:
                got = "miss"
                messages.add(e.message)
            times[kind].append((time.perf_counter() - t) * 1e6)
            if (got == "hit") != (kind == "hit"):
                conn.send(f"{kind}: {got}")
                return
    conn.send((times, sorted(messages)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "misses.json"))
    args = ap.parse_args()
    ctx = multiprocessing.get_context("fork")
    owners = []
    for _ in range(2):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_owner, args=(there,), daemon=True)
        proc.start()
        owners.append((here.recv(), here, proc))
    (live, live_conn, _), (dead, dead_conn, dead_proc) = owners
    dead_conn.send("exit")
    dead_proc.join(30)
    here, there = ctx.Pipe()
    sib = ctx.Process(target=_sibling, args=(there, live, dead, args.n), daemon=True)
    sib.start()
    got = here.recv()
    sib.join(30)
    live_conn.send("exit")
    if isinstance(got, str):
        sys.exit(f"FAILED: {got}")
    times, messages = got
    rows = [{"kind": k, "median_us": statistics.median(v),
             "p90_us": sorted(v)[int(0.9 * len(v))], "p99_us": sorted(v)[int(0.99 * len(v))]}
            for k, v in times.items()]
    cols = [("kind", "kind", "s"), ("median_us", "median us", ".0f"), ("p90_us", "p90 us", ".0f"),
            ("p99_us", "p99 us", ".0f")]
    C.print_table(rows, cols)
    print(f"\nmessages of the misses: {len(messages)}\n\n{C.markdown_table(rows, cols)}")
    C.write_json(args.out, {"command": [sys.executable, *sys.argv], "machine": C.machine_info(),
                            "n": args.n, "rows": rows, "messages": messages})
    if len(messages) != 1:
        sys.exit("FAILED: the misses' messages differ")


if __name__ == "__main__":
    main()
