# SPDX-License-Identifier: Apache-2.0
"""Hostile input against the TP=2 server: stock vLLM vs shm-embeds, in one run.

What one cheap client (or one local user writing in the segment directory)
costs each server. Both servers on the wide model (hidden 8192,
TP=2, tests/helpers.py's launcher), the same attacks in order:

* ``stalled``: ``--stalled`` (6) connections each declare a ``--declare-gib``
  (1.5 GiB) JSON body, send its first 64 KiB and stall for ``--stall-s`` (8) s;
* ``memo``: 4 concurrent requests carrying a valid ``torch.save`` tensor
  (1024 x 8192 fp32, 32 MiB) whose ``data.pkl`` has one extra ``LONG_BINPUT``
  of index 2**26 (CPython's C unpickler grows its memo array to twice that);
  the answers are compared with those for the same tensor saved plainly;
* ``nested``: a binary body whose JSON header is nested 100,000 deep;
* ``stride0``: 4 concurrent JSON bodies whose payload is ``torch.save`` of a
  stride-0 view, 1 GiB logical and longer than ``--max-model-len``, padded to
  2 MiB (statuses, wall, ``/dev/shm`` growth);
* ``late_base64``: a 1000-row payload with one bad base64 character near its
  end, twice (the API server's CPU seconds);
* ``binary_drip``: 64 binary bodies announcing a 16 MiB header and a 19-digit
  ``Content-Length``, dripping a byte every 5 s, while an ordinary binary body
  is sent (the wide server runs with the in-flight cap, ``INFLIGHT_BYTES``, at 1 GiB);
* ``planted``: directories at the EngineCore's next 256 segment names (names
  are ``handle.SegmentName``s: predictable from its pid) at the top of the
  segment mount, then an embeds request, a text request, the directories
  removed, and both again. This targets the old layout: segments now live in
  the server's private 0700 directory ``<mount>/vllm-shm-embeds-<random>/segments``
  (``private_dir.py``), so the directories land in the mount's top level,
  where nothing of ours lives;

and on the tiny model (hidden 128, TP=2), a server per mode of its own:

* ``planted_names``: ``--planted-names`` (200,000) empty files named like
  segments (``SegmentName`` with random fields) at the top of the mount, then
  20 JSON embeds requests (256 rows, ``max_tokens`` 1), then
  two bodies at once, each ``prompt_embeds`` a list of 5 non-contiguous
  256-row tensors, while text requests run (wall, text max); then the 20
  again while 8 threads scrape ``/metrics`` in a loop and text requests run;
  the files removed after;
* ``listing``: while two embeds requests (300 and 77 rows, 200 tokens) run,
  the mount listed recursively as uid 65534 (``/usr/bin/python3 -I``): the
  names, kinds and sizes another local user can read;
* ``binary_skeleton``: 4 connections each send a binary body whose JSON header
  is a 16 MiB ``[{},{},...]`` (declaring 1 MiB of tensor bytes after it),
  then stall 12 s; ``/health`` is timed meanwhile;
* ``datatype_list``: 10 binary bodies whose descriptor has ``"datatype":
  ["FP32"]``; statuses, and tracebacks in the server log meanwhile;
* ``json_skeleton``: 4 concurrent JSON bodies of 16 MiB each: a short prompt,
  then ``prompt_embeds`` holding a ``[{},{},...]`` skeleton (not a base64
  string: 400 from both); statuses, and ``/health`` timed meanwhile;
* ``regions_linger`` (shm-embeds only: stock has no regions socket): a
  producer's registration carries one memfd and two TCP sockets whose last
  ``close`` blocks 8 s (``SO_LINGER``, unsent data); then another producer
  registers a tensor: how long its answer takes.

Stock vLLM does not know binary bodies: what it answers is reported.
Every mount is mode 1777 (shared, like ``/dev/shm``), for both servers.

For each it prints the API server's peak RSS growth over its RSS just before
(sampled every 20 ms), the HTTP outcomes, and whether ``/health`` answered and
the segment directory was clean at the end. This is a measurement, not a
test: the tests of each case are named in docs/security.md.

    .venv/bin/python benchmarks/bench_hostile.py     # every attack: 4 servers
    .venv/bin/python benchmarks/bench_hostile.py --only planted_names,listing

Writes ``benchmarks/results/hostile.json`` (with ``--only``, the attacks run
replace theirs in the file; the others' figures are kept, each with its time).
"""

from __future__ import annotations

import argparse
import array
import base64
import fcntl
import io
import json
import os
import pathlib
import shutil
import socket
import struct
import subprocess
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


def _outcomes(socks: list) -> dict[str, int]:
    """How many of ``socks`` got each HTTP status (``waiting``: no answer within
    0.5 s; ``cut``: closed without one; ``no connection``: None); closes them."""
    outcomes: dict[str, int] = {}
    for s in socks:
        code = "no connection"
        if s is not None:
            s.settimeout(0.5)
            try:
                reply = s.recv(64).decode(errors="replace")
                code = reply.split(" ")[1] if reply.startswith("HTTP/") else "cut"
            except (TimeoutError, OSError):
                code = "waiting"
            s.close()
        outcomes[code] = outcomes.get(code, 0) + 1
    return outcomes


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
    outcomes = _outcomes(socks)
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


def _post_json(url: str, body: bytes, timeout: float) -> str:
    """POST a JSON body to ``/v1/completions``: its status, or the error's name."""
    try:
        return str(requests.post(url + "/v1/completions", data=body, timeout=timeout,
                                 headers={"Content-Type": "application/json"}).status_code)
    except requests.RequestException as e:
        return type(e).__name__


class PeakShm:
    """Peak growth of ``/dev/shm``'s used bytes over a window (every 20 ms)."""

    def __init__(self, mount: str = "/dev/shm") -> None:
        self.mount, self.peak, self.base = mount, 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, shutil.disk_usage(self.mount).used)
            time.sleep(0.02)

    def __enter__(self) -> PeakShm:
        self.base = self.peak = shutil.disk_usage(self.mount).used
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()

    @property
    def growth_mb(self) -> float:
        return round((self.peak - self.base) / MIB, 1)


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def attack_stride0(url: str, hidden: int, max_len: int) -> dict:
    """4 concurrent JSON bodies whose ``prompt_embeds`` is ``torch.save`` of
    ``torch.ones(1, H).expand(T, H)``, ``T x H`` fp32 = 1 GiB logical with
    ``T > --max-model-len`` (a payload of kilobytes), the body padded to
    2 MiB with a long ``"user"`` string (so that the JSON path takes it)."""
    rows = max((1 << 30) // (hidden * 4), max_len + 1)
    buf = io.BytesIO()
    torch.save(torch.ones(1, hidden).expand(rows, hidden), buf)
    payload = base64.b64encode(buf.getvalue()).decode()
    body = json.dumps({"model": "tiny", "max_tokens": 1, "prompt_embeds": payload,
                       "user": "u" * (2 * MIB)}).encode()

    t0 = time.monotonic()
    with PeakShm() as shm, ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda _: _post_json(url, body, 300), range(4)))
    return {"statuses": _codes(statuses), "payload_kb": round(len(payload) / 1024, 1),
            "logical_mib": rows * hidden * 4 // MIB, "wall_s": round(time.monotonic() - t0, 2),
            "dev_shm_growth_mb": shm.growth_mb}


def attack_late_base64(url: str, api: psutil.Process, hidden: int) -> dict:
    """One JSON payload (1000 rows, fp32) with one bad base64 character 100
    characters before its end, twice: statuses and the API server's CPU
    seconds for each."""
    buf = io.BytesIO()
    torch.save(torch.randn(1000, hidden), buf)
    payload = base64.b64encode(buf.getvalue()).decode()
    payload = payload[:-100] + "!" + payload[-99:]
    body = json.dumps({"model": "tiny", "max_tokens": 1, "prompt_embeds": payload}).encode()
    statuses, cpu = [], []
    for _ in range(2):
        c0 = _cpu_s(api)
        try:
            statuses.append(str(requests.post(url + "/v1/completions", data=body, timeout=300,
                                              headers={"Content-Type": "application/json"}
                                              ).status_code))
        except requests.RequestException as e:
            statuses.append(type(e).__name__)
        time.sleep(0.5)
        cpu.append(round(_cpu_s(api) - c0, 2))
    return {"statuses": _codes(statuses), "body_mib": round(len(body) / MIB, 1),
            "api_cpu_s": cpu}


def attack_binary_drip(url: str, hidden: int, hold_s: float = 12.0) -> dict:
    """64 connections each announce a binary body with a 16 MiB JSON header and
    a 19-digit ``Content-Length``, then send one byte every 5 s; meanwhile
    one ordinary binary body (256 rows): what it gets, and when the drippers
    are answered."""
    host, port = url.removeprefix("http://").split(":")
    head = _binary_head("/v1/completions", 16 << 20, 10 ** 18)
    socks: list = []
    for _ in range(64):
        s = socket.create_connection((host, int(port)), timeout=hold_s + 60)
        s.sendall(head + b"[")
        socks.append(s)
    stop = threading.Event()

    def drip() -> None:
        while not stop.wait(5.0):
            for s in socks:
                try:
                    s.sendall(b" ")
                except OSError:
                    pass

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    time.sleep(3)
    rows = 256
    header = json.dumps({"model": "tiny", "max_tokens": 1, "prompt_embeds": {
        "datatype": "FP32", "shape": [rows, hidden],
        "parameters": {"binary_data_size": rows * hidden * 4}}}).encode()
    data = torch.randn(rows, hidden).numpy().tobytes()
    try:
        r = requests.post(url + "/v1/completions", data=header + data, timeout=120, headers={
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(header))})
        ordinary = str(r.status_code)
    except requests.RequestException as e:
        ordinary = type(e).__name__
    time.sleep(hold_s)
    stop.set()
    dripper.join(10)
    return {"ordinary_binary": ordinary, "drippers_after_s": round(hold_s + 3),
            "drippers": _outcomes(socks)}


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
    out = {"planted": len(planted),
           "where": "top level of the mount (segments of shm-embeds now live in its private "
                    "0700 directory beneath: nothing of ours is at these names)"}
    out["embeds_planted"] = _completion(url, embeds, 60)[0]
    out["text_planted"] = _completion(url, text, 60)[0]
    for path in planted:
        os.rmdir(path)
    out["embeds_after"] = _completion(url, embeds, 60)[0]
    out["text_after"] = _completion(url, text, 60)[0]
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def _timed_completion(url: str, body: dict, timeout: float = 120) -> tuple[str, float]:
    t0 = time.monotonic()
    code = _completion(url, body, timeout)[0]
    return code, time.monotonic() - t0


def attack_planted_names(url: str, seg_dir: str, weights: torch.Tensor, n: int) -> dict:
    """``n`` empty files named like segments at the top of the mount; embeds
    requests, then the same with 8 scrapers and text requests running."""
    import random

    from vllm._shm_embeds.handle import SegmentName

    rng = random.Random(22)
    planted = []
    gen = torch.Generator().manual_seed(22)

    def embeds_body() -> dict:
        t = weights[torch.randint(3, weights.shape[0], (256,), generator=gen)].contiguous()
        return {"model": "tiny", "max_tokens": 1, "temperature": 0.0,
                "prompt_embeds": base64.b64encode(plain_save(t)).decode()}

    def inline_body() -> dict:
        # 5 prompts of 256 rows, each non-contiguous (column-major): the API
        # server cannot pass such a tensor's bytes through as they are.
        ts = [weights[torch.randint(3, weights.shape[0], (256,), generator=gen)]
              .t().contiguous().t() for _ in range(5)]
        return {"model": "tiny", "max_tokens": 1, "temperature": 0.0,
                "prompt_embeds": [base64.b64encode(plain_save(t)).decode() for t in ts]}

    bodies = [embeds_body() for _ in range(20)]
    got = [_timed_completion(url, b) for b in bodies]  # the same, nothing planted yet
    lat = [d for _, d in got]
    before = {"codes": _codes(c for c, _ in got), "p50_s": _pct(lat, 0.5),
              "max_s": round(max(lat), 3), "first_s": round(lat[0], 3),
              "max_after_first_s": round(max(lat[1:]), 3)}
    t0 = time.monotonic()
    for _ in range(n):
        name = SegmentName(rng.randrange(1 << 32), rng.randrange(1, 1 << 22),
                           rng.randrange(1 << 40), rng.randrange(1 << 20),
                           rng.choice((0, 0, 0, rng.randrange(1, 64))))
        path = os.path.join(seg_dir, str(name))
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            planted.append(path)
        except OSError:
            pass
    out: dict = {"planted": len(planted), "plant_s": round(time.monotonic() - t0, 1),
                 "embeds_before_planting": before}
    try:
        got = [_timed_completion(url, b) for b in bodies]
        lat = [d for _, d in got]
        out["embeds"] = {"codes": _codes(c for c, _ in got), "p50_s": _pct(lat, 0.5),
                         "max_s": round(max(lat), 3)}
        out["inline"] = _inline_with_text(url, [inline_body() for _ in range(2)])
        stop = threading.Event()
        scrapes: list[float] = []
        scrape_err: list[str] = []
        texts: list[float] = []
        text_codes: list[str] = []

        def scraper() -> None:
            while not stop.is_set():
                t1 = time.monotonic()
                try:
                    r = requests.get(url + "/metrics", timeout=30)
                    if r.status_code == 200:
                        scrapes.append(time.monotonic() - t1)
                    else:
                        scrape_err.append(str(r.status_code))
                except requests.RequestException as e:
                    scrape_err.append(type(e).__name__)

        threads = [threading.Thread(target=scraper, daemon=True) for _ in range(8)]
        threads.append(threading.Thread(target=_text_loop, daemon=True,
                                        args=(url, stop, texts, text_codes, 60)))
        for t in threads:
            t.start()
        try:
            got = [_timed_completion(url, b) for b in bodies]
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        lat = [d for _, d in got]
        out["loaded"] = {"embeds_codes": _codes(c for c, _ in got),
                         "embeds_p50_s": _pct(lat, 0.5), "embeds_max_s": round(max(lat), 3),
                         "text_n": len(texts), "text_codes": _codes(text_codes),
                         "text_p50_s": _pct(texts, 0.5), "text_p90_s": _pct(texts, 0.9),
                         "scrapes": len(scrapes), "scrape_p50_s": _pct(scrapes, 0.5),
                         "scrape_max_s": round(max(scrapes), 3) if scrapes else None,
                         "scrape_errors": len(scrape_err),
                         "scrape_error_kinds": sorted(set(scrape_err))}
    finally:
        for path in planted:
            os.unlink(path)
    return out


def _text_loop(url: str, stop: threading.Event, latencies: list[float], codes: list[str],
               timeout: float) -> None:
    """Text completions (20 words, 4 tokens) back to back until ``stop``: each
    one's latency and status appended."""
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0.0, "prompt": "hello " * 20}
    while not stop.is_set():
        code, d = _timed_completion(url, body, timeout)
        codes.append(code)
        latencies.append(d)


def _inline_with_text(url: str, bodies: list[dict]) -> dict:
    """``bodies`` sent at once while one client sends text requests in a loop:
    their statuses, the wall time until the last answered, and the text
    requests' latencies meanwhile."""
    stop = threading.Event()
    texts: list[float] = []
    th = threading.Thread(target=_text_loop, daemon=True, args=(url, stop, texts, [], 120))
    th.start()
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            got = list(pool.map(lambda b: _timed_completion(url, b, 300), bodies))
    finally:
        wall = time.monotonic() - t0
        stop.set()
        th.join(130)
    return {"codes": _codes(c for c, _ in got), "wall_s": round(wall, 2),
            "text_n": len(texts), "text_p50_s": _pct(texts, 0.5),
            "text_max_s": round(max(texts), 3) if texts else None}


def _codes(codes) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in codes:
        out[c] = out.get(c, 0) + 1
    return out


# Run as uid 65534 by /usr/bin/python3 -I: lists every entry beneath argv[1]
# it can see, one JSON line per listing, every 20 ms until its stdin closes.
LISTER = r"""
import json, os, stat, sys, threading, time
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
def listing():
    out = {"entries": [], "denied": []}
    def walk(d, rel):
        try:
            names = sorted(os.listdir(d))
        except OSError as e:
            out["denied"].append([rel or ".", e.strerror])
            return
        for n in names:
            p, r = os.path.join(d, n), (rel + "/" + n if rel else n)
            try:
                st = os.lstat(p)
            except OSError as e:
                out["entries"].append([r, "?", None, e.strerror])
                continue
            kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
            out["entries"].append([r, kind, st.st_size, oct(st.st_mode & 0o7777)])
            if kind == "dir":
                walk(p, r)
    walk(sys.argv[1], "")
    return out
print("ready", flush=True)
while True:
    print(json.dumps(listing()), flush=True)
    if done.wait(0.02):
        break
"""


def start_lister(mount: str) -> subprocess.Popen:
    """A process of uid 65534 listing ``mount`` until its stdin is closed."""
    proc = subprocess.Popen(["/usr/bin/python3", "-I", "-c", LISTER, mount], user=65534,
                            group=65534, extra_groups=[], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-500:]
    proc.lines = []  # read as they come: a full pipe would stall its listings
    proc.reader = threading.Thread(target=lambda: proc.lines.extend(proc.stdout), daemon=True)
    proc.reader.start()
    return proc


def stop_lister(proc: subprocess.Popen) -> tuple[str, str]:
    """Close the lister's stdin; its listings (JSON lines) and stderr."""
    proc.stdin.close()
    proc.reader.join(60)
    err = proc.stderr.read()
    proc.wait(30)
    return "".join(proc.lines), err


def attack_listing(url: str, seg_dir: str, weights: torch.Tensor) -> dict:
    """What uid 65534 sees in the mount while two embeds requests run."""
    gen = torch.Generator().manual_seed(23)
    results: list = [None, None]
    bodies = []
    for rows in (300, 77):
        t = weights[torch.randint(3, weights.shape[0], (rows,), generator=gen)].contiguous()
        bodies.append({"model": "tiny", "max_tokens": 200, "temperature": 0.0,
                       "ignore_eos": True,
                       "prompt_embeds": base64.b64encode(plain_save(t)).decode()})

    def send(i: int) -> None:
        results[i] = _completion(url, bodies[i], 300)[0]

    lister = start_lister(seg_dir)
    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    in_flight_s = time.monotonic() - t0
    out, err = stop_lister(lister)
    snapshots = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    seen: dict[str, tuple] = {}
    denied: set[str] = set()
    for s in snapshots:
        for name, kind, size, mode in s.get("entries", []):
            seen.setdefault(name, (kind, size, mode))
        denied.update(d for d, _ in s.get("denied", []))
    from vllm._shm_embeds.handle import SegmentName

    segment_like = [n for n in seen if SegmentName.parse(n.rsplit("/", 1)[-1]) is not None]
    return {"requests": results, "in_flight_s": round(in_flight_s, 1),
            "snapshots": len(snapshots),
            "seen": [[n, *v] for n, v in sorted(seen.items())],
            "sizes_readable": sorted({v[1] for v in seen.values() if v[1] is not None}),
            "segment_names_seen": len(segment_like), "denied": sorted(denied),
            "lister_errors": err[-300:] if lister.returncode else ""}


SKELETON_ITEMS = ((16 << 20) - 4) // 3  # "[" + "{}," * k + "{}]" is exactly 16 MiB


class HealthProbe:
    """Times ``GET /health`` every 50 ms while its ``with`` block runs."""

    def __init__(self, url: str) -> None:
        self.url, self.took, self.errors = url, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                r = requests.get(self.url + "/health", timeout=30)
                if r.status_code != 200:
                    self.errors.append(str(r.status_code))
            except requests.RequestException as e:
                self.errors.append(type(e).__name__)
            self.took.append(time.monotonic() - t0)
            time.sleep(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(40)

    def figures(self) -> dict:
        return {"health_n": len(self.took),
                "health_max_s": round(max(self.took), 3) if self.took else None,
                "health_p50_s": _pct(self.took, 0.5), "health_errors": len(self.errors)}


def _binary_head(url_path: str, header_len: int, total: int) -> bytes:
    return (f"POST {url_path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {header_len}\r\n"
            f"Content-Length: {total}\r\nConnection: close\r\n\r\n").encode()


def attack_binary_skeleton(url: str, stall_s: float = 12.0) -> dict:
    host, port = url.removeprefix("http://").split(":")
    header = b"[" + b"{}," * SKELETON_ITEMS + b"{}]"
    assert len(header) == 16 << 20
    head = _binary_head("/v1/completions", len(header), len(header) + MIB)
    socks: list = [None] * 4
    sent: list[str] = ["?"] * 4

    def send(i: int) -> None:
        try:
            s = socket.create_connection((host, int(port)), timeout=stall_s + 30)
            socks[i] = s
            s.sendall(head + header)
            sent[i] = "all"
        except OSError as e:
            sent[i] = type(e).__name__

    with HealthProbe(url) as health:
        senders = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(4)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(stall_s + 30)
        time.sleep(stall_s)
    return {"outcomes": _outcomes(socks), "sent": _codes(sent), **health.figures()}


def _log_size(path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _log_since(path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def attack_datatype_list(url: str, log_path, hidden: int) -> dict:
    rows = 4
    nbytes = rows * hidden * 4
    header = json.dumps({"model": "tiny", "max_tokens": 1, "prompt_embeds": {
        "datatype": ["FP32"], "shape": [rows, hidden],
        "parameters": {"binary_data_size": nbytes}}}).encode()
    body = header + bytes(nbytes)
    start = _log_size(log_path)
    statuses: list[str] = []
    for _ in range(10):
        try:
            r = requests.post(url + "/v1/completions", data=body, timeout=60, headers={
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": str(len(header))})
            statuses.append(str(r.status_code))
            last = r.text[:200]
        except requests.RequestException as e:
            statuses.append(type(e).__name__)
            last = ""
    time.sleep(1.0)  # the log is written by the server's processes
    log = _log_since(log_path, start)
    return {"statuses": _codes(statuses), "last_body": last,
            "tracebacks": log.count("Traceback"),
            "asgi_exceptions": log.count("Exception in ASGI application")}


def attack_json_skeleton(url: str) -> dict:
    """4 concurrent 16 MiB JSON bodies: a short prompt, then ``prompt_embeds``
    holding ``[{},{},...]``."""
    items = ((16 << 20) - 64) // 3
    body = b'{"model": "tiny", "prompt": "hi", "prompt_embeds": [' + b"{}," * items + b'{}]}'
    t0 = time.monotonic()
    with HealthProbe(url) as health, ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda _: _post_json(url, body, 120), range(4)))
    wall = time.monotonic() - t0
    return {"statuses": _codes(statuses), "body_mib": round(len(body) / MIB, 1),
            "wall_s": round(wall, 2), **health.figures()}


def attack_regions_linger(regions_path: str | None) -> dict:
    """Another producer's registration while the regions server holds two
    lingering sockets that an attacker sent beside a memfd."""
    if regions_path is None:
        return {"skipped": "no regions socket (stock)"}
    from helpers import LingeringSockets
    from shm_embeds_client import RegionClient

    hidden, rows = 128, 4
    victim = RegionClient(regions_path, timeout=30)
    lingering = LingeringSockets(2)
    attacker = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        attacker.connect(regions_path)
        fd = os.memfd_create("bench", os.MFD_ALLOW_SEALING)
        os.write(fd, bytes(rows * hidden * 4))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK
                    | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        fds = [fd, *lingering.fds]
        attacker.sendmsg([json.dumps({"op": "register", "datatype": "FP32",
                                      "shape": [rows, hidden]}).encode()],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                           array.array("i", fds).tobytes())])
        for f in fds:
            os.close(f)  # the server's copies are the last ones
        time.sleep(0.3)
        t0 = time.monotonic()
        try:
            region = victim.register(torch.randn(rows, hidden))
            answered, ok = time.monotonic() - t0, True
            region.unregister()
        except (TimeoutError, ConnectionError, RuntimeError) as e:
            answered, ok = time.monotonic() - t0, type(e).__name__
        attacker.settimeout(20)
        try:
            reply = attacker.recv(1 << 16).decode(errors="replace")[:120]
        except OSError as e:
            reply = type(e).__name__
        return {"victim_registered": ok, "victim_answer_s": round(answered, 3),
                "attacker_reply": reply}
    finally:
        attacker.close()
        victim.close()
        lingering.release()


WIDE = ("stalled", "memo", "nested", "planted", "stride0", "late_base64", "binary_drip")
TINY = ("planted_names", "listing", "binary_skeleton", "datatype_list", "json_skeleton",
        "regions_linger")


def new_mount() -> str:
    d = tempfile.mkdtemp(prefix="bench-hostile-", dir="/dev/shm")
    os.chmod(d, 0o1777)  # shared like /dev/shm: the server makes its private directory in it
    return d


def run_server(shm_on: bool, model: str, attacks: list[str], args, weights: torch.Tensor,
               tmp: pathlib.Path) -> dict:
    from helpers import Server, limits_env, ours_in, private_dirs_in

    tmp.mkdir(parents=True)
    seg_dir = new_mount()
    mode = "shm-embeds" if shm_on else "stock"
    out: dict = {}
    try:
        # The wide model's server: the in-flight cap at its floor (1 GiB, the
        # default wherever /dev/shm is under 4 GiB), as binary_drip assumes.
        env = ({"VLLM_SHM_EMBEDS_MIN_BYTES": str(MIB), **limits_env(INFLIGHT_BYTES=1 << 30)}
               if model == "wide" else {})
        regions_path = str(tmp / "regions.sock") if shm_on and model == "tiny" else None
        if regions_path is not None:
            env["VLLM_SHM_EMBEDS_REGIONS"] = regions_path
        t0 = time.monotonic()
        server = Server(tmp, "-tp", "2", shm_on=shm_on, seg_dir=seg_dir, check_clean=False,
                        model=os.path.join(ROOT, ".models", model), max_model_len=2048,
                        env_extra=env).start()
        print(f"{mode}: {model} server up in {time.monotonic() - t0:.0f} s", flush=True)
        api = psutil.Process(server.proc.pid)
        hidden = weights.shape[1]
        fns = {"stalled": lambda: attack_stalled(server.url, args),
               "memo": lambda: attack_memo(server.url, weights),
               "nested": lambda: attack_nested(server.url),
               "planted": lambda: attack_planted(server.url, api, seg_dir, weights),
               "planted_names": lambda: attack_planted_names(server.url, seg_dir, weights,
                                                             args.planted_names),
               "listing": lambda: attack_listing(server.url, seg_dir, weights),
               "binary_skeleton": lambda: attack_binary_skeleton(server.url, args.skeleton_stall_s),
               "datatype_list": lambda: attack_datatype_list(server.url, server.log_path,
                                                             hidden),
               "json_skeleton": lambda: attack_json_skeleton(server.url),
               "regions_linger": lambda: attack_regions_linger(regions_path),
               "stride0": lambda: attack_stride0(server.url, hidden, 2048),
               "late_base64": lambda: attack_late_base64(server.url, api, hidden),
               "binary_drip": lambda: attack_binary_drip(server.url, hidden)}
        try:
            for name in attacks:
                time.sleep(1)
                t1 = time.monotonic()
                with PeakRss(api) as rss:
                    try:
                        result = fns[name]()
                    except Exception as e:  # noqa: BLE001 - a measurement: report, go on
                        result = {"error": repr(e)[:500]}
                out[name] = dict(result, api_rss_growth_mb=round(rss.growth_mb, 1),
                                 model=model, seconds=round(time.monotonic() - t1, 1),
                                 time=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
                print(f"{mode}: {name}: {out[name]}", flush=True)
            try:
                healthy = requests.get(server.url + "/health", timeout=10).status_code == 200
            except requests.RequestException:
                healthy = False
            for name in attacks:
                out[name]["healthy_after"] = healthy
        finally:
            server.close()
        left = ours_in(seg_dir) + private_dirs_in(seg_dir)
        for name in attacks:
            out[name]["left_after_stop"] = left
    finally:
        shutil.rmtree(seg_dir, ignore_errors=True)
    return out


# The attacks whose cell is one line of their result's fields.
SUMMARIES = {
    "binary_skeleton": "answers {outcomes}, sent {sent}; /health max {health_max_s} s "
                       "(n {health_n}, errors {health_errors})",
    "datatype_list": "statuses {statuses}; log: {tracebacks} Traceback, "
                     "{asgi_exceptions} 'Exception in ASGI application'",
    "json_skeleton": "statuses {statuses} in {wall_s} s; /health max {health_max_s} s "
                     "(n {health_n})",
    "stride0": "statuses {statuses} in {wall_s} s ({payload_kb} KB payloads, {logical_mib} MiB "
               "logical); /dev/shm +{dev_shm_growth_mb} MB",
    "late_base64": "statuses {statuses} ({body_mib} MiB body); API CPU s {api_cpu_s}",
    "binary_drip": "an ordinary binary body meanwhile: {ordinary_binary}; the 64 drippers after "
                   "{drippers_after_s} s: {drippers}",
}


def summary(name: str, r: dict) -> str:
    """One cell: the figures of one attack's result."""
    if "error" in r:
        return f"error: {r['error'][:120]}"
    if name == "planted_names":
        e, lo, il = r.get("embeds", {}), r.get("loaded", {}), r.get("inline", {})
        b = r.get("embeds_before_planting", {})
        return (f"(before planting: embeds p50 {b.get('p50_s')} s max {b.get('max_s')} s, "
                f"first {b.get('first_s')} s, max after it {b.get('max_after_first_s')} s) "
                f"{r['planted']} files; embeds p50 {e.get('p50_s')} s max {e.get('max_s')} s "
                f"{e.get('codes')}; inline (2 x 5 non-contiguous tensors) {il.get('codes')} "
                f"in {il.get('wall_s')} s, text max {il.get('text_max_s')} s "
                f"(n {il.get('text_n')}); loaded: embeds p50 {lo.get('embeds_p50_s')} max "
                f"{lo.get('embeds_max_s')} s, text p50 {lo.get('text_p50_s')} p90 "
                f"{lo.get('text_p90_s')} s (n {lo.get('text_n')}), scrape p50 "
                f"{lo.get('scrape_p50_s')} s (n {lo.get('scrapes')}), scrape errors "
                f"{lo.get('scrape_errors')}")
    if name == "listing":
        seen = "; ".join(f"{n} ({k}, {s} B)" for n, k, s, _ in r["seen"][:4]) or "nothing"
        more = f" (+{len(r['seen']) - 4} more)" if len(r["seen"]) > 4 else ""
        return (f"requests {r['requests']}, {r['snapshots']} listings: {seen}{more}; "
                f"cannot enter: {r['denied'] or 'none'}")
    if name in SUMMARIES:
        return SUMMARIES[name].format_map(r)
    if name == "regions_linger":
        if "skipped" in r:
            return r["skipped"]
        return (f"another producer registered: {r['victim_registered']} in "
                f"{r['victim_answer_s']} s; the attacker got {r['attacker_reply']!r}")
    return str({k: v for k, v in r.items() if k not in (
        "api_rss_growth_mb", "model", "seconds", "time", "healthy_after", "left_after_stop",
        "where")})


def worse(stock: dict, on: dict) -> list[str]:
    """Where shm-embeds does worse than stock (the brief's thresholds)."""
    flags = []
    for name, r in on.items():
        s = stock.get(name)
        if not isinstance(r, dict) or not isinstance(s, dict):
            continue
        if "error" in r:
            flags.append(f"{name}: the attack failed on shm-embeds: {r['error'][:200]}")
        if r.get("api_rss_growth_mb", 0) > s.get("api_rss_growth_mb", 0) + 256:
            flags.append(f"{name}: RSS growth {r['api_rss_growth_mb']} MB vs stock "
                         f"{s['api_rss_growth_mb']} MB")
        lat = []
        if name == "planted_names" and "embeds" in r and "embeds" in s:
            b_on, b_st = r.get("embeds_before_planting"), s.get("embeds_before_planting")
            if b_on and b_st:
                lat = [("embeds p50 before planting (no attack)", b_on["p50_s"], b_st["p50_s"]),
                       ("embeds max before planting (no attack)", b_on["max_s"], b_st["max_s"])]
            lat += [("embeds p50", r["embeds"]["p50_s"], s["embeds"]["p50_s"]),
                   ("embeds max", r["embeds"]["max_s"], s["embeds"]["max_s"])]
            if "inline" in r and "inline" in s:
                lat += [(f"inline {k}", r["inline"][k], s["inline"][k])
                        for k in ("wall_s", "text_max_s")]
            lo, ls = r["loaded"], s["loaded"]
            lat += [(k, lo[k], ls[k]) for k in ("embeds_p50_s", "embeds_max_s", "text_p50_s",
                                                 "text_p90_s", "scrape_p50_s")]
            if lo["scrape_errors"] > ls["scrape_errors"]:
                flags.append(f"{name}: scrape errors {lo['scrape_errors']} vs stock "
                             f"{ls['scrape_errors']}")
        if name == "regions_linger" and r.get("victim_registered") is not True:
            flags.append(f"regions_linger: the other producer's registration: "
                         f"{r.get('victim_registered')} after {r.get('victim_answer_s')} s")
        if name == "stride0" and "wall_s" in r:
            lat = [("wall", r["wall_s"], s.get("wall_s"))]
            if r.get("dev_shm_growth_mb", 0) > s.get("dev_shm_growth_mb", 0) + 64:
                flags.append(f"stride0: /dev/shm +{r['dev_shm_growth_mb']} MB vs stock "
                             f"+{s.get('dev_shm_growth_mb')} MB")
        if name == "late_base64" and r.get("api_cpu_s") and s.get("api_cpu_s"):
            lat = [("API CPU max", max(r["api_cpu_s"]), max(s["api_cpu_s"]))]
        if name == "binary_drip" and r.get("ordinary_binary") != "200":
            flags.append(f"binary_drip: an ordinary binary body got {r.get('ordinary_binary')}")
        if name in ("binary_skeleton", "json_skeleton") and "health_max_s" in r:
            lat = [("/health max", r["health_max_s"], s.get("health_max_s"))]
        for what, v_on, v_st in lat:
            if v_on is not None and v_st is not None and v_on > 1.5 * v_st + 0.25:
                flags.append(f"{name}: {what} {v_on} s vs stock {v_st} s")
        if r.get("tracebacks") or r.get("asgi_exceptions"):
            flags.append(f"{name}: {r.get('tracebacks')} Traceback / {r.get('asgi_exceptions')} "
                         "ASGI exception lines in the shm-embeds server's log")
        if name == "listing" and r.get("segment_names_seen"):
            flags.append(f"listing: uid 65534 saw {r['segment_names_seen']} segment names")
        if r.get("healthy_after") is False:
            flags.append(f"{name}: shm-embeds server not healthy after")
    return flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stalled", type=int, default=6)
    ap.add_argument("--declare-gib", type=float, default=1.5)
    ap.add_argument("--stall-s", type=float, default=8.0)
    ap.add_argument("--planted-names", type=int, default=200_000)
    ap.add_argument("--skeleton-stall-s", type=float, default=12.0)
    ap.add_argument("--modes", default="stock,shm-embeds")
    ap.add_argument("--only", default=",".join(WIDE + TINY),
                    help="attacks to run, comma-separated: " + ",".join(WIDE + TINY))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "hostile.json"))
    args = ap.parse_args()
    only = args.only.split(",")
    unknown = sorted(set(only) - set(WIDE + TINY))
    if unknown:
        ap.error(f"unknown attacks: {unknown}")
    from helpers import embed_weights

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-hostile-"))
    modes = args.modes.split(",")
    runs = {m: {"mode": m} for m in modes}
    t0 = time.monotonic()
    for model, group in (("wide", WIDE), ("tiny", TINY)):
        attacks = [a for a in group if a in only]
        if not attacks:
            continue
        weights = embed_weights(os.path.join(ROOT, ".models", model))
        for m in modes:
            runs[m].update(run_server(m == "shm-embeds", model, attacks, args, weights,
                                      tmp / f"{model}-{m}"))
    shutil.rmtree(tmp, ignore_errors=True)
    total_s = round(time.monotonic() - t0)

    # The file: attacks run now replace theirs; the others' figures stay.
    old: dict = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
    merged = {r["mode"]: r for r in old.get("runs", [])}
    for m, r in runs.items():
        merged.setdefault(m, {"mode": m}).update(r)
    for r in merged.values():  # per attack now (healthy_after / left_after_stop)
        r.pop("healthy_after", None)
        r.pop("left", None)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "time": stamp, "seconds": total_s,
                   "runs": list(merged.values())}, f, indent=1)

    print(f"\nwhole run: {total_s} s\n")
    print("| attack | mode | API server RSS growth MB | outcome |")
    print("|---|---|---:|---|")
    for name in [a for a in WIDE + TINY if a in only]:
        for m in modes:
            r = runs[m].get(name)
            if r is not None:
                print(f"| {name} | {m} | {r['api_rss_growth_mb']:.0f} | {summary(name, r)} |")
    for m in modes:
        left = sorted({n for r in runs[m].values() if isinstance(r, dict)
                       for n in r.get("left_after_stop", [])})
        healthy = all(r.get("healthy_after", True) for r in runs[m].values()
                      if isinstance(r, dict))
        print(f"{m}: healthy after every attack: {healthy}, left after stop: {len(left)}")
    if "stock" in runs and "shm-embeds" in runs:
        flags = worse(runs["stock"], runs["shm-embeds"])
        print("\nshm-embeds worse than stock: " + ("; ".join(flags) if flags else "nowhere"))


if __name__ == "__main__":
    main()
