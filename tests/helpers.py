# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the tests: models, payloads, servers, segments, counters.

One home for what several test modules need (conftest.py keeps the fixtures).
"""

import asyncio
import base64
import contextlib
import io
import json
import os
import random
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import requests
import torch

from vllm._shm_embeds.handle import SegmentName

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The one internal variable that changes the plugin's fixed limits (config.LIMITS and
# each extension's EXTENSION.limits)
TEST_LIMITS = "VLLM_SHM_EMBEDS_TEST_LIMITS"


def limits_env(**limits) -> dict[str, str]:
    """``{VLLM_SHM_EMBEDS_TEST_LIMITS: "NAME=value,..."}`` for a server's environment,
    e.g. ``limits_env(BODY_TIMEOUT_S=4)``."""
    return {TEST_LIMITS: ",".join(f"{name}={value}" for name, value in limits.items())}


def set_limits(monkeypatch, **limits) -> None:
    """Change fixed limits in this process (and the processes it starts) for one
    test, keeping those already changed: ``set_limits(monkeypatch, WRITERS=3)``."""
    current = dict(item.split("=", 1) for item in os.environ.get(TEST_LIMITS, "").split(",")
                   if "=" in item)
    current.update({name: str(value) for name, value in limits.items()})
    monkeypatch.setenv(TEST_LIMITS, limits_env(**current)[TEST_LIMITS])


# -- the engines a run starts ------------------------------------------------------

# A JSON line per engine started (where, seconds from its start to its stop),
# appended by every process of a run (pytest-xdist workers); read by
# conftest.py at the end of the run. Unset: nothing is recorded.
LEDGER_ENV = "SHM_EMBEDS_ENGINE_LEDGER"


def _where() -> str:
    """The ``where`` of ``conftest.INVENTORY`` that starts an engine now: the
    innermost caller it names (``<file> <name>``: a function of that file
    whose name contains ``name``; ``<file>``: any), else the innermost
    test-file caller."""
    import conftest

    known = [e.where.partition(" ") for e in (*conftest.INVENTORY, *conftest.OPT_IN_ENGINES)]
    frame, first = sys._getframe(1), None
    while frame is not None:
        base = os.path.basename(frame.f_code.co_filename)
        for file, _, name in known:
            if file == base and name in frame.f_code.co_name:
                return f"{file} {name}".strip()
        if first is None and base.startswith(("test_", "conftest")):
            first = f"{base} {frame.f_code.co_name}"
        frame = frame.f_back
    return first or "?"


class EngineLife:
    """One engine's start-to-stop time, written to the run's ledger at :meth:`end`
    (the first call: when the process exits, if :meth:`watch` is given it)."""

    def __init__(self) -> None:
        self.where = _where() if os.environ.get(LEDGER_ENV) else ""
        self.t0 = time.monotonic()
        self.done = False
        self._lock = threading.Lock()

    def watch(self, proc: subprocess.Popen) -> None:
        """End when ``proc`` exits (an engine a test kills ends then, not when
        its fixture is torn down at the end of the run)."""
        threading.Thread(target=lambda: (proc.wait(), self.end()), daemon=True).start()

    def end(self) -> None:
        path = os.environ.get(LEDGER_ENV)
        with self._lock:
            if self.done or not path:
                return
            self.done = True
        line = json.dumps({"where": self.where, "s": round(time.monotonic() - self.t0, 1)})
        with open(path, "a") as f:  # one short write per line: appends do not interleave
            f.write(line + "\n")


def read_ledger(path: str) -> list[dict]:
    """The ledger's lines (``[]`` if there is none)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


# -- segments ------------------------------------------------------------------


def mine(name: str) -> bool:
    """True if segment file ``name`` was made by this process."""
    parsed = SegmentName.parse(name)
    return parsed is not None and parsed.pid == os.getpid()


def ours_in(seg_dir: str) -> list[str]:
    """Our segment file names in ``seg_dir`` and beneath it (every file of every
    segment; a shared mount holds them in the server's private directory)."""
    return sorted(n for _, _, files in os.walk(seg_dir) for n in files
                  if SegmentName.parse(n) is not None)


def held_beneath(mount: str) -> int:
    """What the budget's walk counts (``segment_dir.held_bytes``) in every private
    segment directory of ``mount``, or in ``mount`` itself if it has none."""
    from vllm._shm_embeds.files import segment_dir
    from vllm._shm_embeds.private_dir import INNER

    dirs = [os.path.join(mount, d, INNER) for d in private_dirs_in(mount)] or [mount]
    return sum(segment_dir.held_bytes(d) for d in dirs)


def kept_memfds(pid: int) -> int:
    """How many kept conversations' memfds (``ext/conversations/tips.py``) process
    ``pid`` holds open."""
    n, fd_dir = 0, f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            n += os.readlink(os.path.join(fd_dir, name)).startswith("/memfd:shm-embeds-kept")
        except OSError:
            pass
    return n


def private_dirs_in(mount: str) -> list[str]:
    """The private segment directories in ``mount`` (``private_dir.PREFIX``): none
    may be left once the server that made it has stopped."""
    from vllm._shm_embeds.private_dir import PREFIX

    return sorted(n for n in os.listdir(mount) if n.startswith(PREFIX))


def held_by(pid: int, directory: str) -> list[str]:
    """What process ``pid`` maps or opens in ``directory`` (the mapped paths, then
    ``"fd <n>: <path>"``); unlinked files count too (``"... (deleted)"``). The
    directory itself does not: a census walk (``files/census.py``) on a thread of
    its own holds it open for a moment at any time.

    Raises:
        OSError: ``pid`` is gone (or its /proc entries cannot be read).
    """
    inside = directory.rstrip("/") + "/"
    with open(f"/proc/{pid}/maps") as f:
        found = [line.split(None, 5)[-1].strip() for line in f if inside in line]
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if inside in target:
                found.append(f"fd {fd}: {target}")
    return found


def holders(directory: str) -> dict[str, list[str]]:
    """Which processes map or open a file in ``directory``: ``{"<pid> <name>": [...]}``."""
    out: dict[str, list[str]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            found = held_by(int(pid), directory)
            if found:
                with open(f"/proc/{pid}/comm") as f:
                    out[f"{pid} {f.read().strip()}"] = found
        except OSError:
            continue
    return out


def descendants(proc, needle: str) -> list:
    """Live descendants (``psutil.Process``) of ``proc`` (a ``Popen``) whose
    command line or name contains ``needle`` (e.g. ``"EngineCore"``)."""
    import psutil

    found = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if needle in " ".join(p.cmdline()) or needle in p.name():
                found.append(p)
        except psutil.Error:  # gone, or a zombie not yet reaped
            pass
    return found


@contextlib.contextmanager
def stopped(pids):
    """SIGSTOP every pid in ``pids`` for the block, SIGCONT after (even on an
    error; a pid gone meanwhile is skipped): what is read from them inside
    the block (``held_by``, their counters) is what a signal sent inside it
    finds, since they cannot change it in between."""
    pids = list(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def wait_until(predicate, timeout: float, what, interval: float = 0.05):
    """Call ``predicate()`` until it returns something truthy; return that.

    The one polling loop of the tests: a wait that times out fails the test
    (never returns a falsy value for the test to judge).

    Args:
        predicate: called with no arguments, at least once.
        timeout: seconds to wait in all.
        what: what is awaited, for the failure message: a string, or a
            callable returning one (called once, at the timeout: e.g. to show
            the counters seen last).
        interval: seconds between calls.
    Raises:
        AssertionError: ``timeout`` passed before ``predicate`` held.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for "
                                 f"{what() if callable(what) else what}")
        time.sleep(interval)


def signal_mid_request(pids, seg_dir, send, timeout: float = 60) -> dict[int, list[str]]:
    """Call ``send()`` at a moment when one of ``pids`` maps or opens one of
    our segments in ``seg_dir`` that still has its name: a request is in
    flight there (a name lasts as long as its request; a mapping of an
    unlinked segment may outlive it by a step).

    Each try SIGSTOPs ``pids`` (:func:`stopped`), reads what they hold
    and, if any holds such a segment, calls ``send`` before they run again:
    what was read is what the signal finds. Returns ``{pid: what it held}``;
    fails the test if none was held within ``timeout`` s (nothing was in
    flight: the fault would prove nothing)."""
    def held_then_sent():
        with stopped(pids):
            held = {}
            for pid in pids:
                with contextlib.suppress(OSError):
                    named = [f for f in held_by(pid, seg_dir) if not f.endswith("(deleted)")]
                    if named:
                        held[pid] = named
            if held:
                send()
            return held

    return wait_until(held_then_sent, timeout,
                      f"a request's segment held by one of {pids} (in flight)")


VLLM_SHM_FILES = ("psm_", "vllm_dist_", "sem.mp-")  # vLLM's own /dev/shm files


def vllm_shm_files_of(pgid: int) -> set[str]:
    """vLLM's /dev/shm files that processes of process group ``pgid`` map or open."""
    out = set()
    for key, found in holders("/dev/shm/").items():
        with contextlib.suppress(OSError):
            if os.getpgid(int(key.split()[0])) == pgid:
                out.update(p.split("/")[-1].split()[0] for p in found)
    return {n for n in out if n.startswith(VLLM_SHM_FILES)}


def remove_vllm_leftovers(names: set[str]) -> list[str]:
    """Remove those of vLLM's /dev/shm files ``names`` that still exist and that
    no live process maps or opens: what vLLM leaves when a test SIGKILLs one
    of its processes. A run leaves /dev/shm as it found it. Returns the names."""
    if not names:
        return []
    used = {p.split("/")[-1].split()[0] for h in holders("/dev/shm/").values() for p in h}
    gone = sorted(n for n in names if n not in used
                  and os.path.exists(os.path.join("/dev/shm", n)))
    for n in gone:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", n))
    return gone


def new_seg_dir() -> str:
    """A private segment directory on the /dev/shm tmpfs for one engine run.

    Tests point ``VLLM_SHM_EMBEDS_DIR`` at it so concurrent jobs on the same
    machine cannot make a leak check pass or fail.
    """
    d = tempfile.mkdtemp(prefix="shm-embeds-it-", dir="/dev/shm")
    os.chmod(d, 0o1777)  # shared like /dev/shm: the server makes its private directory in it
    return d


# Loaded by every Python process of a test engine (``PYTHONPATH``, when
# SHM_EMBEDS_TEST_HOOKS is set: tests/conftest.py sets it; benchmarks do not).
# It imports nothing at start-up (importing torch before vLLM has set up its
# OpenMP threads would slow every worker down): it patches modules as they are
# first imported.
# * SHM_EMBEDS_TEST_BUSY_LOOP_S: vLLM's broadcast readers (TP workers, the
#   EngineCore) busy-loop 1 s after every read (shm_broadcast.SpinCondition);
#   with two engines on 2 cores that steals the other's CPU. Tests shorten it;
#   nothing else changes (a reader then waits on vLLM's own notify socket).
# * SHM_EMBEDS_TEST_FAIL_FILE: once that file exists, the TP worker with
#   reader index 1 cannot map any segment, as if out of memory or
#   descriptors (test_faults.py's rank-failure test creates it last).
SITECUSTOMIZE = """
import os, sys
import importlib.abc, importlib.machinery


def _fail_rank_1(m):
    from vllm._shm_embeds.handle import ShmEmbedsError
    orig = m.open_tensor
    def open_tensor(handle, reader_index=None):
        if reader_index == 1 and os.path.exists(os.environ["SHM_EMBEDS_TEST_FAIL_FILE"]):
            raise ShmEmbedsError("injected: this rank cannot map segments")
        return orig(handle, reader_index)
    m.open_tensor = open_tensor


def _short_busy_loop(m):
    limit = float(os.environ["SHM_EMBEDS_TEST_BUSY_LOOP_S"])
    orig = m.SpinCondition.__init__
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self.busy_loop_s = min(self.busy_loop_s, limit)
    m.SpinCondition.__init__ = __init__


_PATCHES = {}
if os.environ.get("SHM_EMBEDS_TEST_FAIL_FILE"):
    _PATCHES["vllm._shm_embeds.hops.hop2"] = _fail_rank_1
if os.environ.get("SHM_EMBEDS_TEST_BUSY_LOOP_S"):
    _PATCHES["vllm.distributed.device_communicators.shm_broadcast"] = _short_busy_loop


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            run = spec.loader.exec_module
            def exec_module(module):
                run(module)
                patch(module)
            spec.loader.exec_module = exec_module
        return spec


if _PATCHES:
    sys.meta_path.insert(0, _Hook())
"""


def _hooks_dir() -> str | None:
    """A directory holding :data:`SITECUSTOMIZE` when SHM_EMBEDS_TEST_HOOKS is set."""
    if not os.environ.get("SHM_EMBEDS_TEST_HOOKS"):
        return None
    path = os.path.join(tempfile.gettempdir(), f"shm-embeds-test-hooks-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, "sitecustomize.py")
    tmp = f"{target}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(SITECUSTOMIZE)
    os.replace(tmp, target)  # atomic: two workers may write it at once
    return path


def engine_env(shm_on: bool, seg_dir: str, stats_dir) -> dict:
    """Environment for one engine run: the plugin on or off, its segment and
    stats dirs, a 1 KiB threshold (the tiny model's prompts are small), the
    CPU backend's settings for TP on 2 cores, and in tests the hooks of
    :data:`SITECUSTOMIZE`."""
    hooks = _hooks_dir()
    extra = {"PYTHONPATH": os.pathsep.join(
        p for p in (hooks, os.environ.get("PYTHONPATH")) if p)} if hooks else {}
    return dict(
        os.environ,
        **extra,
        VLLM_SHM_EMBEDS="1" if shm_on else "0",
        VLLM_SHM_EMBEDS_DIR=seg_dir,
        VLLM_SHM_EMBEDS_MIN_BYTES="1024",
        VLLM_SHM_EMBEDS_STATS_DIR=str(stats_dir),
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"),
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    )


def by_role(stats, role):
    """Counters of the processes in ``stats`` (``read_stats_dir``) with ``role``."""
    return [s["counters"] for s in stats if role in s["roles"]]


_FORKED = """
import atexit, json, os, sys, traceback
exec(sys.argv[1])  # the imports every case shares, paid once
for env, code, out, err in json.loads(sys.stdin.read()):
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            os.environ.update(env)
            exec(code, {"__name__": "__main__"})
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                atexit._run_exitfuncs()  # as at a normal exit: the plugin removes what it made
            finally:
                sys.stdout.flush(); sys.stderr.flush()
                os._exit(status)
    print(os.waitpid(pid, 0)[1], flush=True)
"""


def forked_cases(preamble: str, cases: list[tuple[dict, str]], tmp,
                 timeout: float = 600) -> list[tuple[int, str, str]]:
    """Run each ``(env, code)`` of ``cases`` in a child forked from one interpreter
    that first ran ``preamble`` (e.g. vLLM's imports: 10-15 s each here, paid once):
    ``os.environ`` updated with ``env``, then ``code``; the child runs the atexit
    handlers (the plugin removes its private directory there), then ``os._exit``.
    ``[(wait status, stdout, stderr)]``, in order.
    ``preamble`` must not import what the cases decide at import (the plugin)."""
    paths = [(str(tmp / f"case{i}.out"), str(tmp / f"case{i}.err")) for i in range(len(cases))]
    out = subprocess.run([sys.executable, "-c", _FORKED, preamble], text=True,
                         input=json.dumps([(env, code, o, e) for (env, code), (o, e)
                                           in zip(cases, paths)]),
                         capture_output=True, timeout=timeout, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    statuses = [int(line) for line in out.stdout.split()]
    assert len(statuses) == len(cases), out.stdout[-2000:] + out.stderr[-3000:]
    results = []
    for status, (o, e) in zip(statuses, paths):
        with open(o) as fo, open(e) as fe:
            results.append((status, fo.read(), fe.read()))
    return results


def run_child(code: str, obj=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python (this environment), ``pickle`` of ``obj`` on stdin."""
    import pickle

    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=timeout,
                          input=pickle.dumps(obj), env=os.environ)


# -- models and payloads ---------------------------------------------------------


def local_model(variant: str = "tiny") -> str:
    """Path of the local random-weight model (built by tools/make_tiny_model.py)."""
    path = os.path.join(REPO, ".models", variant)
    if not os.path.exists(os.path.join(path, "config.json")):
        subprocess.run(
            [sys.executable, os.path.join(REPO, "tools", "make_tiny_model.py"),
             "--out", path, "--variant", variant],
            check=True,
        )
    return path


def tiny_model() -> str:
    return local_model("tiny")


def embed_weights(model_dir: str) -> torch.Tensor:
    """``model.embed_tokens.weight`` (vocab, hidden) from the model's safetensors."""
    from safetensors import safe_open

    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), "pt") as f:
                if "model.embed_tokens.weight" in f.keys():
                    return f.get_tensor("model.embed_tokens.weight")
    raise FileNotFoundError(f"no model.embed_tokens.weight in {model_dir}")


def encode_embeds(obj) -> str:
    """vLLM's online ``prompt_embeds`` format: base64 of ``torch.save`` bytes
    (of a tensor; any object for the bad-payload tests)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


# Payloads stock vLLM answers with a 4xx (``hidden``: the model's hidden size).
BAD_PAYLOADS = {
    "wrong-hidden": lambda h: encode_embeds(torch.randn(5, h + 1)),
    "int-dtype": lambda h: encode_embeds(torch.ones(5, h, dtype=torch.int64)),
    "bool-dtype": lambda h: encode_embeds(torch.ones(5, h, dtype=torch.bool)),
    "1d": lambda h: encode_embeds(torch.randn(h)),
    "3d": lambda h: encode_embeds(torch.randn(5, h, 2)),
    "zero-tokens": lambda h: encode_embeds(torch.randn(0, h)),
    "longer-than-max-model-len": lambda h: encode_embeds(torch.randn(2100, h)),
    "not-base64": lambda h: "not base64!!",
    "truncated": lambda h: encode_embeds(torch.randn(5, h))[:-40],
    "pickle-not-a-tensor": lambda h: encode_embeds({"not": "a tensor"}),
}


# -- the OpenAI server -------------------------------------------------------------


def asgi_peer(messages: list[dict]):
    """An ASGI client's ``(receive, send, sent)``: ``receive`` hands out
    ``messages`` in order, then stalls; ``send`` appends to ``sent``."""
    sent: list[dict] = []

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # the client stalls

    async def send(m):
        sent.append(m)

    return receive, send, sent


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A free TCP port, never one this process handed out before. Under
    pytest-xdist, one from a range of the worker's own, so that two workers
    starting servers at the same moment never pick the same one (bind(0)
    hands out recently freed ports; on Linux it also prefers even ones, so no
    filter on its result may loop on it). Never twice: a node pair's HTTP port
    once equalled its ``--data-parallel-rpc-port``, vLLM's ZMQ handshake
    bound it beside the HTTP socket (both SO_REUSEADDR, neither listening
    yet), and the ``/health`` poll reached the handshake ("Message from
    engine with unexpected data parallel rank": ZMTP 1.0 read ``GET /...`` as
    an identity)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker[2:].isdigit() else None
    rng = random.Random()
    for _ in range(200):
        port = 0 if index is None else 20000 + 2000 * (index % 10) + rng.randrange(2000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port
    raise RuntimeError("no free port in 200 tries")


# The tiny model has no chat template; this one renders the messages' content
# as is, so a message holding one prompt_embeds part is just those embeds.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


# `vllm serve` through the CLI's main(): vllm-cpu 0.32's CLI looks up the
# metadata of a distribution named `vllm` and fails; this answers that lookup
# (test-only). `python -m vllm.entrypoints.openai.api_server` starts one API
# server whatever --api-server-count says; `vllm serve` starts them all.
SERVE_CLI = ("import importlib.metadata as m, sys; v = m.version; "
             "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
             "sys.argv[0] = 'vllm'; from vllm.entrypoints.cli.main import main; main()")


class Server:
    """One OpenAI server on a local random-weight model, for tests and benchmarks.

    The one launcher of this repository. Started by :meth:`start` (or ``with``),
    stopped with SIGTERM by :meth:`stop` (or at the end of ``with``); with
    ``check_clean`` the private segment directory must then be empty. Reads
    like the dict it replaced: ``server["url"]``, ``["model"]``, ``["stats"]``,
    ``["proc"]``, ``["log"]``, ``["seg_dir"]``; tests may store more
    (``server["weights"] = ...``).

    Args:
        tmp: a directory for the log (and the stats directory).
        args: more ``vllm serve`` arguments (e.g. ``"-tp", "2"``).
        shm_on: ``VLLM_SHM_EMBEDS``.
        own_stats_dir: leave ``VLLM_SHM_EMBEDS_STATS_DIR`` unset (the plugin
            makes its own, under ``TMPDIR`` = ``tmp/tmp``); else ``tmp/stats``.
        seg_dir: segment directory (default: a new private one, removed at stop).
        env_extra: more environment.
        serve_cli: start it as ``vllm serve`` (needed for ``--api-server-count``
            and DP; the module entry point starts one API server).
        model: model directory (default: the tiny model).
    """

    def __init__(self, tmp, *args, shm_on=True, own_stats_dir=False, seg_dir=None,
                 env_extra=None, serve_cli=False, model=None, check_clean=True,
                 max_model_len=2048):
        self.tmp = tmp
        self.args = args
        self.model = model or tiny_model()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.own_seg_dir = seg_dir is None
        self.seg_dir = new_seg_dir() if seg_dir is None else seg_dir
        self.check_clean = check_clean
        self.log_path = tmp / "server.log"
        self.serve_cli = serve_cli
        self.max_model_len = max_model_len
        if own_stats_dir:
            self.stats_path = None
            (tmp / "tmp").mkdir(exist_ok=True)
            env = engine_env(shm_on, self.seg_dir, "")
            del env["VLLM_SHM_EMBEDS_STATS_DIR"]
            env["TMPDIR"] = str(tmp / "tmp")
        else:
            self.stats_path = str(tmp / "stats")
            os.makedirs(self.stats_path, exist_ok=True)
            env = engine_env(shm_on, self.seg_dir, self.stats_path)
        self.env = {**env, **(env_extra or {})}
        self.proc = None
        self.extra: dict = {}

    # -- dict-style access (the tests' original interface)

    def __getitem__(self, key):
        fixed = {"url": self.url, "model": self.model, "stats": self.stats,
                 "proc": self.proc, "log": self.log_path, "seg_dir": self.seg_dir}
        return fixed[key] if key in fixed else self.extra[key]

    def __setitem__(self, key, value):
        self.extra[key] = value

    @property
    def stats(self) -> str:
        """The counters directory (the plugin's own one once it exists)."""
        if self.stats_path is None:
            made = [p for p in (self.tmp / "tmp").iterdir()
                    if p.name.startswith("vllm-shm-embeds-metrics.")]
            if made:
                self.stats_path = str(made[0])
        return self.stats_path

    # -- life

    def start(self, timeout: float = 600) -> "Server":
        if self.proc is not None and self.proc.poll() is None:  # (``with`` starts it)
            raise RuntimeError("this Server is running: a second start would orphan it")
        # `vllm serve` of vllm-cpu 0.32.0 fails on its own metadata lookup; the
        # module entry point starts the same server (one API server).
        cmd = ([sys.executable, "-c", SERVE_CLI, "serve"] if self.serve_cli
               else [sys.executable, "-m", "vllm.entrypoints.openai.api_server"])
        self.life = EngineLife()
        self.proc = subprocess.Popen(
            [*cmd, "--model", self.model, "--served-model-name", "tiny", "--port",
             str(self.port), "--enable-prompt-embeds", "--dtype", "float32",
             "--max-model-len", str(self.max_model_len), "--enforce-eager", *self.args],
            env=self.env, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.life.watch(self.proc)
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log()[-4000:]
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self._vllm_files = vllm_shm_files_of(self.proc.pid)
                    return self
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(1)

    def stop(self, sig=signal.SIGTERM, timeout: float = 180) -> None:
        """Stop the whole process group (idempotent); waits for the exit."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout)
        if self.proc is not None:
            self.life.end()

    def close(self) -> None:
        """Stop; then the segment directory must be empty (``check_clean``)."""
        try:
            self.stop()
        finally:
            remove_vllm_leftovers(getattr(self, "_vllm_files", set()))  # after a SIGKILL
            left = ours_in(self.seg_dir) + private_dirs_in(self.seg_dir)
            if self.own_seg_dir:
                shutil.rmtree(self.seg_dir, ignore_errors=True)  # even when a test failed
        if self.check_clean:
            assert left == [], f"segments left after shutdown: {left}"

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- use

    def log(self) -> str:
        return self.log_path.read_text()

    def read_stats(self) -> list[dict]:
        """Every process's counters (:func:`read_stats_dir`)."""
        return read_stats_dir(self.stats) if self.stats else []

    def totals(self, role=None) -> dict:
        """Counters summed over the processes (of ``role``, if given)."""
        total: dict = {}
        for s in self.read_stats():
            if role is None or role in s["roles"]:
                for k, v in s["counters"].items():
                    total[k] = total.get(k, 0) + v
        return total

    def scrape(self) -> tuple[str, dict]:
        """``/metrics``: the text and our series (``parse_metrics``). Our part is
        computed at most once per ``http.metrics.CACHE_S``: waiting that long
        first, the scrape shows everything counted before the call."""
        from vllm._shm_embeds.ext.metrics.metrics import CACHE_S

        time.sleep(CACHE_S + 0.05)
        r = requests.get(f"{self.url}/metrics", timeout=30)
        r.raise_for_status()
        return r.text, parse_metrics(r.text)

    def complete(self, body: dict, expect: int = 200, headers: dict | None = None):
        """A greedy 4-token ``/v1/completions`` request that must get ``expect``."""
        r = requests.post(f"{self.url}/v1/completions", timeout=300, headers=headers,
                          json={"model": "tiny", "max_tokens": 4, "temperature": 0.0, **body})
        assert r.status_code == expect, r.text
        return r


def start_server(tmp, *server_args, **kw) -> Server:
    """A :class:`Server` (``with start_server(...) as s:``)."""
    return Server(tmp, *server_args, **kw)


def delta(before: dict, after: dict) -> dict:
    """Counters that changed between two ``Server.totals()``."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in after
            if after.get(k, 0) != before.get(k, 0)}


METRICS_PREFIX = "vllm:shm_embeds_"


def parse_metrics(text: str) -> dict:
    """``{(name, labels without model_name): value}`` of our series in ``text``."""
    import re

    out = {}
    for line in text.splitlines():
        if not line.startswith(METRICS_PREFIX):
            continue
        m = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
        name, labels, value = m.groups()
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels or ""))
        assert pairs.pop("model_name") == "tiny", line
        out[(name, frozenset(pairs.items()))] = float(value)
    return out


def prefix_cache_hits(server) -> float:
    """vLLM's ``vllm:prefix_cache_hits_total`` (tokens), from ``/metrics``.

    (The usage's ``cached_tokens`` is not usable here: vLLM 0.32 answers the
    empty text prompt next to the embeds too, and reports that one's.)
    """
    text = requests.get(server["url"] + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def post_completion(url: str, body: dict, timeout: float = 300, max_tokens: int = 16):
    """POST a greedy ``/v1/completions`` request (model ``tiny``); the response."""
    return requests.post(
        url + "/v1/completions",
        json={"model": "tiny", "max_tokens": max_tokens, "temperature": 0.0, **body},
        timeout=timeout,
    )


# -- offline runs ------------------------------------------------------------------


def run_offline(tmp_path, shm_on: bool, model: str, lengths=None, extra=(), seg_dir=None,
                env=None):
    """Run tests/offline_run.py in a fresh process; return (outputs, stats, log).

    Segments go to ``seg_dir`` (default: a new private dir, removed after),
    which must be empty once the run has shut down. ``lengths``: prompt
    lengths (else ``--lengths`` in ``extra``); ``env``: more environment.
    """
    stats = tmp_path / f"stats-{int(shm_on)}"
    stats.mkdir()
    out = tmp_path / f"out-{int(shm_on)}.json"
    own_dir = seg_dir is None
    seg_dir = new_seg_dir() if own_dir else seg_dir
    env = {**engine_env(shm_on, seg_dir, stats), **(env or {})}
    life = EngineLife()
    try:
        proc = subprocess.run(
            [sys.executable, os.path.join(REPO, "tests", "offline_run.py"),
             "--model", model, "--out", str(out),
             *(["--lengths", ",".join(map(str, lengths))] if lengths else []), *extra],
            env=env, capture_output=True, text=True, timeout=900,
        )
        left = ours_in(seg_dir) + private_dirs_in(seg_dir)
    finally:
        life.end()
        if own_dir:
            shutil.rmtree(seg_dir, ignore_errors=True)  # even when the run failed
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert left == [], f"segments left after shutdown: {left}"
    return json.loads(out.read_text()), read_stats_dir(str(stats)), proc.stdout + proc.stderr


def write_counters(stats_dir: str, records: list[dict]) -> list[int]:
    """Have one forked child per record count ``record["counters"]`` (flat
    names, as ``counters.stats()`` gives them) with ``record["roles"]`` into
    ``stats_dir``, through the plugin's own counters; returns their pids."""
    pids = []
    for rec in records:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 1
            try:
                os.environ["VLLM_SHM_EMBEDS_STATS_DIR"] = stats_dir
                from vllm._shm_embeds import counters

                for role in rec["roles"]:
                    counters.set_role(role)
                for key, n in rec["counters"].items():
                    parts = key.split(".")
                    if len(parts) == 1:
                        counters.count_reason(key, "", n=n)  # no reason: a plain event
                    elif parts[0] == "fallback":
                        counters.count_reason("fallback", parts[2], hop=parts[1][3:], n=n)
                    else:
                        counters.count_reason(parts[0], parts[1], n=n)
                code = 0
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        pids.append(pid)
    return pids


def open_fds() -> dict[int, str]:
    """This process's open descriptors and what each points to (``/proc/self/fd``)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own fd, already closed
            pass
    return out


def new_fds(before: dict[int, str]) -> dict[int, str]:
    """Descriptors open now that were not open in ``before`` (:func:`open_fds`) or
    point elsewhere: a leak. (Fewer is no leak: the garbage collector may close
    an earlier test's files meanwhile.) A walk of the segment directory that
    ``census.Census`` runs on a thread of its own holds the directory open for
    a moment: it is waited for first."""
    import threading

    for t in threading.enumerate():
        if t.name == "shm-embeds-census":
            t.join(10)
    return {fd: link for fd, link in open_fds().items() if before.get(fd) != link}


def ring_message(buf) -> list[bytes]:
    """The buffers of one chunk of vLLM's broadcast ring, as
    ``MessageQueue.dequeue`` (``shm_broadcast.py`` 0.32) reads them."""
    assert buf[0] == 0
    count, offset, out = int.from_bytes(buf[1:3], "big"), 3, []
    for _ in range(count):
        n = int.from_bytes(buf[offset:offset + 4], "big")
        out.append(bytes(buf[offset + 4:offset + 4 + n]))
        offset += 4 + n
    return out


class LingeringSockets:
    """TCP sockets whose last ``close`` blocks for ``SO_LINGER`` seconds: each
    is connected to a local listener that never accepts nor reads, with its
    send buffer full (unsent data). :meth:`release` resets them (the listener
    closes), so a close still waiting returns at once."""

    def __init__(self, n: int, linger_s: int = 8) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(n)
        self.fds = []
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            s.connect(self.listener.getsockname())
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger_s))
            s.setblocking(False)
            try:
                while True:
                    s.send(b"x" * 65536)
            except BlockingIOError:
                pass
            self.fds.append(s.detach())

    def release(self) -> None:
        self.listener.close()  # resets the connections waiting in its queue


async def read_whole_body(receive) -> bytes:
    """An ASGI app's read of its whole request body (every ``http.request`` piece)."""
    parts = []
    while True:
        m = await receive()
        parts.append(m.get("body", b""))
        if not m.get("more_body"):
            return b"".join(parts)


def proc_status_bytes(field: str) -> int:
    """A size field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def read_stats_dir(stats_dir: str) -> list[dict]:
    """``[{"pid": int, "roles": [str], "counters": {flat name: int}}]``, one per
    process's counter file in ``stats_dir`` (``vllm._shm_embeds.counters``)."""
    from collections import Counter

    from prometheus_client.mmap_dict import MmapedDict

    from vllm._shm_embeds.counters import parse_labels, stats_files

    out = []
    for pid, path in stats_files(stats_dir).items():
        found: Counter[str] = Counter()
        seen: set[str] = set()
        for mkey, value, _, _ in MmapedDict.read_all_values_from_file(path):
            key, role = parse_labels(json.loads(mkey)[2])
            found[key.flat()] += int(value)
            seen.update(r for r in role.split("+") if r)
        out.append({"pid": pid, "roles": sorted(seen), "counters": dict(found)})
    return out


def true_in_forked_child(check) -> bool:
    """``check()`` in a forked child, which then leaves without running anything else
    (an exception or a hang past 60 s counts as False)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            ok = bool(check())
        except BaseException:
            ok = False
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    try:
        ready = select.select([r], [], [], 60)[0]
        return bool(ready) and os.read(r, 1) == b"1"
    finally:
        os.close(r)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
