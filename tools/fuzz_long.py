# SPDX-License-Identifier: Apache-2.0
"""The long run of every fuzz target (hypothesis), as docs/security.md reports it.

Each target (a test of ``tests/test_fuzz_*.py``) is run again and again, in
pytest runs of the ``long`` profile (``SHM_EMBEDS_FUZZ=long``, a new random
seed each run, the example count scaled so a run takes about a minute), until
it has run for ``--minutes``; ``--parallel`` targets run at once. Prints, per
target, the wall time, the runs, the examples hypothesis reports as passing
and the failures (a failing run's output is kept under ``--out``'s folder).

    .venv/bin/python tools/fuzz_long.py --minutes 10 --parallel 16
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def targets() -> list[str]:
    out = subprocess.run(
        [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
         *sorted(f"tests/{f}" for f in os.listdir(os.path.join(ROOT, "tests"))
                 if f.startswith("test_fuzz_") and f.endswith(".py"))],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if "::" in line]


def run_target(node: str, seconds: float, out_dir: str) -> dict:
    began = time.monotonic()
    runs = examples = 0
    failures = []
    per_run = 200
    while time.monotonic() - began < seconds:
        t0 = time.monotonic()
        env = dict(os.environ, SHM_EMBEDS_FUZZ="long", SHM_EMBEDS_FUZZ_EXAMPLES=str(per_run))
        p = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "--hypothesis-show-statistics", "--hypothesis-seed",
                            str(int.from_bytes(os.urandom(4), "little")), node],
                           cwd=ROOT, env=env, capture_output=True, text=True)
        runs += 1
        examples += sum(int(n) for n in re.findall(r"(\d+) passing", p.stdout))
        if p.returncode != 0:
            path = os.path.join(out_dir, re.sub(r"\W+", "_", node) + f".{runs}.txt")
            with open(path, "w") as f:
                f.write(p.stdout + p.stderr)
            failures.append(path)
        took = time.monotonic() - t0
        per_run = max(50, min(100_000, int(per_run * 60 / max(took, 1.0))))
    return {"target": node, "wall_s": round(time.monotonic() - began), "runs": runs,
            "examples": examples, "failures": failures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("-k", default="", help="only targets whose id contains this")
    ap.add_argument("--skip", default="saw_both,memo_trick",
                    help="comma list: leave out targets whose id contains one (default: the "
                         "tests of that file that are not property-based)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "fuzz_long.json"))
    args = ap.parse_args()
    skip = [x for x in args.skip.split(",") if x]
    nodes = [n for n in targets() if args.k in n and not any(x in n for x in skip)]
    out_dir = os.path.join(os.path.dirname(args.out), "fuzz_long")
    os.makedirs(out_dir, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(lambda n: run_target(n, args.minutes * 60, out_dir), nodes))
    with open(args.out, "w") as f:
        json.dump({"minutes": args.minutes, "parallel": args.parallel,
                   "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                 time.gmtime()),
                   "targets": rows}, f, indent=1)
    print("| target | wall s | runs | passing examples | failures |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['target']} | {r['wall_s']} | {r['runs']} | {r['examples']} | "
              f"{len(r['failures']) or 'none'} |")


if __name__ == "__main__":
    main()
