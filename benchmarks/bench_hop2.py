# SPDX-License-Identifier: Apache-2.0
"""Hop 2 in isolation: EngineCore -> R TP readers through vLLM's own MessageQueue.

The writer (this process) builds what ``MultiprocExecutor.collective_rpc``
enqueues, ``("execute_model", (scheduler_output,), {}, 0)``, around a real
``SchedulerOutput`` whose one ``NewRequestData`` carries an
``(N_tokens, hidden)`` ``prompt_embeds`` tensor of N bytes. R reader
processes (multiprocessing "spawn") attach with
``MessageQueue.create_from_handle(handle, rank)``, dequeue, do what the
worker does (shm-embeds: ``internalize_prompt_embeds``), copy the tensor into
fresh private memory (``C.fresh_empty``, then ``copy_``, what the model runner
effectively does) and report ``time.monotonic()`` (system-wide clock).

Modes (all in one run, interleaved per repeat so machine noise hits them alike):

* ``stock``            plain MessageQueue (out-of-band pickle; over the chunk size
                       the message overflows to the ZMQ XPUB socket)
* ``arena``            ``enable_shm_tensor_arena=True`` (upstream opt-in; tensors of
                       8..256 MiB go through 8 shared slots, larger ones fall back)
* ``shm-embeds``       the tensor already lives in an adopted segment (hop 1 put it
                       there; prepared untimed with ``adopt_tensor(share_tensor(t))``);
                       timed: ``collect`` + ``externalize_prompt_embeds`` + ``enqueue``
                       + ``restore_prompt_embeds``, as the glue's collective_rpc wrapper
* ``shm-embeds-copy``  same, but the tensor is private memory: externalize copies it
                       (``pwrite``) into a new segment inside the timed region
* ``floor``            one process: ``C.fresh_empty(N bytes).copy_(src)`` (fresh memory)
* ``floor-R``          the R reader processes do that at once (physical floor of R
                       private copies on this machine), started by a tiny broadcast

Metrics per (mode, MiB, dtype, R), medians over ``--repeats`` after one warm-up
(ratios to floor / floor-R: medians of per-repeat paired ratios):
``e2e_ms`` from the writer starting the send to the last reader holding its
private copy; ``send_ms`` the writer's wall time inside the send and
``send_cpu_ms`` its thread CPU time there (on 2 cores the wall time also holds
the writer being preempted by the readers it has just woken); ``deq_ms``
until the last reader holds a usable (mapped or received) tensor.

Readers start each send idle in poll: their ``SpinCondition`` busy-loop
window (vLLM: 1 s after a read) is set to ``--reader-busy-loop-s`` (default 0),
the state of workers that saw no step for over a second.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import queue
import sys
import time
from typing import Any

os.environ["VLLM_SHM_EMBEDS"] = "1"
os.environ["VLLM_SHM_EMBEDS_MIN_BYTES"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import _common as C  # noqa: E402

# Imported here, not lazily inside a timed call chain: some vLLM module keeps
# the importing frame alive, which would pin the MessageQueue it references.
from vllm import envs  # noqa: E402
from vllm._shm_embeds import config, counters  # noqa: E402
from vllm._shm_embeds.hops import hop2  # noqa: E402
from vllm._shm_embeds.lifetime import process, transfer  # noqa: E402
from vllm.distributed.device_communicators import shm_tensor_arena  # noqa: E402
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)

MODES = C.HOP2_MODES
REQ_ID = "bench-hop2"
RESULT_TIMEOUT_S = 900.0


# --------------------------------------------------------------------------
# reader process


def _reader(handles: dict[str, Any], rank: int, results: Any, busy_loop_s: float) -> None:
    """One TP reader: attach to the queues, serve control messages until None.

    ``busy_loop_s`` replaces vLLM's 1 s post-read busy-loop window of each
    queue's ``SpinCondition`` (0: wait in poll at once, as a reader that has
    been idle for over a second does).
    """
    mqs = {k: MessageQueue.create_from_handle(h, rank) for k, h in handles.items()}
    for mq in mqs.values():
        mq._spin_condition.busy_loop_s = busy_loop_s
    for k in sorted(mqs):  # same order as the writer
        mqs[k].wait_until_ready()
    ctl_mq = mqs["plain"]
    try:
        while (ctl := ctl_mq.dequeue(indefinite=True)) is not None:
            if ctl["kind"] == "floor":
                src = torch.full((ctl["nbytes"],), 7, dtype=torch.uint8)  # warm, private
                results.put(("ready", rank))
                ctl_mq.dequeue(indefinite=True)  # tiny "go"
                t_deq = time.monotonic()
                dst = C.fresh_empty(ctl["nbytes"]).copy_(src)
                t_done = time.monotonic()
                results.put(("done", rank, t_deq, t_done, float(dst[-1]), "floor"))
                del src, dst
                continue
            mq = mqs[ctl["mq"]]
            results.put(("ready", rank))
            _method, args, _kwargs, _out = mq.dequeue(indefinite=True)
            new_reqs = args[0].scheduled_new_reqs
            got = type(new_reqs[0].prompt_embeds).__name__
            hop2.internalize_prompt_embeds(new_reqs, mq.local_reader_rank)
            t_deq = time.monotonic()
            t = new_reqs[0].prompt_embeds
            priv = C.fresh_empty(t.nbytes).view(t.dtype).view(t.shape).copy_(t)
            t_done = time.monotonic()
            results.put(("done", rank, t_deq, t_done, float(priv[-1, -1]), got))
            del _method, args, _kwargs, new_reqs, t, priv
    finally:
        for mq in mqs.values():
            mq.shutdown()


# --------------------------------------------------------------------------
# writer side


def make_scheduler_output(embeds: torch.Tensor) -> Any:
    """A real ``SchedulerOutput`` with one new request carrying ``embeds``."""
    ntok = embeds.shape[0]
    req = NewRequestData(
        req_id=REQ_ID,
        prompt_token_ids=None,
        mm_features=[],
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_ids=(list(range((ntok + 15) // 16)),),
        num_computed_tokens=0,
        lora_request=None,
        prompt_embeds=embeds,
    )
    return SchedulerOutput(
        scheduled_new_reqs=[req],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={REQ_ID: ntok},
        total_num_scheduled_tokens=ntok,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


class ReaderGroup:
    """R spawned readers attached to a plain and an arena MessageQueue."""

    def __init__(self, n: int, chunk_bytes: int, with_arena: bool,
                 busy_loop_s: float = 0.0) -> None:
        self.n = n
        self.mqs = {"plain": MessageQueue(n, n, max_chunk_bytes=chunk_bytes)}
        if with_arena:
            self.mqs["arena"] = MessageQueue(
                n, n, max_chunk_bytes=chunk_bytes, enable_shm_tensor_arena=True
            )
        self.shm_names = [mq.buffer.shared_memory.name for mq in self.mqs.values()]
        if with_arena:
            self.shm_names.append(self.mqs["arena"].tensor_arena.shared_memory.name)
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        handles = {k: mq.export_handle() for k, mq in self.mqs.items()}
        self.procs = [
            ctx.Process(target=_reader, args=(handles, r, self.results, busy_loop_s),
                        daemon=True)
            for r in range(n)
        ]
        for p in self.procs:
            p.start()
        for k in sorted(self.mqs):
            self.mqs[k].wait_until_ready()

    def collect(self, kind: str) -> list[tuple]:
        """Wait for one ``kind`` message from every reader (raises if one died)."""
        out = []
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while len(out) < self.n:
            try:
                msg = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.pid for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"reader(s) died or hung: dead={dead}") from None
                continue
            assert msg[0] == kind, msg
            out.append(msg)
        return out

    def close(self) -> list[int]:
        """Stop readers, shut the queues down; returns pids that had to be killed."""
        killed = []
        try:
            self.mqs["plain"].enqueue(None, timeout=10)
        except Exception:  # noqa: BLE001 - readers may already be gone
            pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                killed.append(p.pid)
                p.terminate()
                p.join(timeout=10)
        ipc_files = [addr.removeprefix("ipc://") for mq in self.mqs.values()
                     for addr in (mq.handle.local_subscribe_addr, mq.handle.local_notify_addr)
                     if addr and addr.startswith("ipc://")]
        for mq in self.mqs.values():
            mq.shutdown()
        self.mqs.clear()
        gc.collect()
        for path in ipc_files:  # libzmq leaves bound ipc:// files behind
            if os.path.exists(path):
                os.unlink(path)
        self.results.close()
        gc.collect()
        return killed


def _sleep_until(t_ready: float, gap_s: float) -> None:
    left = gap_s - (time.monotonic() - t_ready)
    if left > 0:
        time.sleep(left)


def one_send(group: ReaderGroup, mode: str, src: torch.Tensor, val: float,
             gap_s: float) -> dict[str, Any]:
    """Time one broadcast of ``src`` (or one floor measurement) in ``mode``."""
    n = group.n
    nbytes = src.nbytes
    plain = group.mqs["plain"]
    src[-1, -1] = val
    if mode == "floor":
        _sleep_until(time.monotonic(), gap_s)
        return {"e2e_ms": C.floor_copy_ms(src), "send_ms": None, "deq_ms": 0.0}
    if mode == "floor-R":
        plain.enqueue({"kind": "floor", "nbytes": nbytes})
        group.collect("ready")
        _sleep_until(time.monotonic(), gap_s)
        t0 = time.monotonic()
        plain.enqueue("go")
        t1 = time.monotonic()
        dones = group.collect("done")
        return _summary(t0, t1, dones, 7.0, "floor")

    mq = group.mqs["arena" if mode == "arena" else "plain"]
    plain.enqueue({"kind": "rpc", "mq": "arena" if mode == "arena" else "plain"})
    group.collect("ready")
    t_ready = time.monotonic()
    embeds = transfer.adopt_tensor(transfer.share_tensor(src)) if mode == "shm-embeds" else src
    so = make_scheduler_output(embeds)
    msg = ("execute_model", (so,), {}, 0)
    arena = mq.tensor_arena
    fallbacks = arena._fallbacks if arena is not None else 0
    _sleep_until(t_ready, gap_s)

    c0 = time.thread_time()
    t0 = time.monotonic()
    if mode.startswith("shm-embeds"):
        process.collect()
        swapped = hop2.externalize_prompt_embeds(so.scheduled_new_reqs, n)
        try:
            mq.enqueue(msg)
        finally:
            hop2.restore_prompt_embeds(swapped)
    else:
        mq.enqueue(msg)
    t1 = time.monotonic()
    c1 = time.thread_time()

    dones = group.collect("done")
    expect = {"stock": "Tensor", "arena": "Tensor"}.get(mode, "SharedTensorHandle")
    out = _summary(t0, t1, dones, val, expect)
    out["send_cpu_ms"] = (c1 - c0) * 1e3
    if arena is not None:
        out["arena_used"] = (
            shm_tensor_arena._ARENA_MIN_BYTES <= nbytes <= arena.slot_bytes
            and arena._fallbacks == fallbacks
        )
    del so, msg, embeds
    gc.collect()
    process.collect()
    if process.pending_segments():
        raise RuntimeError(f"{process.pending_segments()} segment(s) still linked after {mode}")
    return out


def _summary(t0: float, t1: float, dones: list[tuple], val: float, expect: str) -> dict:
    for _, rank, _, _, got_val, got_type in dones:
        if got_val != val or got_type != expect:
            raise AssertionError(f"reader {rank}: got {got_val}/{got_type}, want {val}/{expect}")
    return {
        "e2e_ms": (max(d[3] for d in dones) - t0) * 1e3,
        "send_ms": (t1 - t0) * 1e3,
        "deq_ms": (max(d[2] for d in dones) - t0) * 1e3,
    }


# --------------------------------------------------------------------------
# driver


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (R, MiB, dtype, mode) point; returns the JSON payload."""
    from tqdm import tqdm


    chunk_bytes = envs.VLLM_MQ_MAX_CHUNK_BYTES_MB * C.MIB  # as MultiprocExecutor
    modes = [m for m in MODES if m in args.modes]
    total = len(args.readers) * len(args.sizes) * len(args.dtypes) * len(modes) * (
        1 + args.repeats
    )
    samples: list[dict[str, Any]] = []
    leftovers: dict[str, Any] = {"killed_readers": [], "segments": [], "mq_shm": []}
    reader_pids: list[int] = []
    bar = tqdm(total=total, desc="hop2", unit="send", disable=total < 30,
               mininterval=2.0, file=sys.stderr)
    val = 0
    for n in args.readers:
        group = ReaderGroup(n, chunk_bytes, with_arena="arena" in modes,
                            busy_loop_s=args.reader_busy_loop_s)
        reader_pids += [p.pid for p in group.procs]
        try:
            for mib in args.sizes:
                for dtype in args.dtypes:
                    tdt = getattr(torch, C.DTYPES[dtype])
                    shape = C.shape_for(mib * C.MIB, args.hidden, tdt.itemsize)
                    src = torch.full(shape, 0.5, dtype=tdt)  # warm, private
                    for rep in range(1 + args.repeats):
                        for mode in modes:
                            val = val % 200 + 1  # exact in bf16; catches stale reads
                            s = one_send(group, mode, src, float(val), args.gap)
                            bar.update()
                            if rep:  # rep 0 is the warm-up
                                s.update(mode=mode, mib=mib, dtype=dtype, group=n,
                                         R=None if mode == "floor" else n, rep=rep)
                                samples.append(s)
                    del src
        finally:
            leftovers["killed_readers"] += group.close()
            names = group.shm_names
            del group
            gc.collect()
            leftovers["mq_shm"] += [x for x in names if os.path.exists(f"/dev/shm/{x}")]
    bar.close()
    process.collect()
    leftovers["segments"] = C.our_segments([os.getpid(), *reader_pids], config.shm_dir())
    return {
        "bench": "hop2",
        "machine": C.machine_info(),
        "config": {"sizes_mib": args.sizes, "dtypes": args.dtypes, "readers": args.readers,
                   "reader_busy_loop_s": args.reader_busy_loop_s,
                   "repeats": args.repeats, "hidden": args.hidden, "gap_s": args.gap,
                   "modes": modes, "mq_max_chunk_bytes": chunk_bytes},
        "rows": aggregate(samples),
        "samples": samples,
        "leftovers": leftovers,
        "shm_embeds_counters": counters.stats(),
    }


def aggregate(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median per (mode, MiB, dtype, R), plus ratios to floor and floor-R.

    Ratios are paired: each sample against the floor measured in the same
    repeat round (seconds apart), then the median; this cancels most of the
    load drift from other processes on the machine.
    """
    def round_key(s: dict[str, Any]) -> tuple:
        return (s["mib"], s["dtype"], s["group"], s["rep"])

    floor = {round_key(s): s["e2e_ms"] for s in samples if s["mode"] == "floor"}
    floor_r = {round_key(s): s["e2e_ms"] for s in samples if s["mode"] == "floor-R"}
    rows = []
    for (mode, mib, dtype, n), ss in C.group_samples(samples, ("mode", "mib", "dtype", "R")):
        sends = [s["send_ms"] for s in ss if s["send_ms"] is not None]
        row = {"mode": mode, "mib": mib, "dtype": dtype, "R": n, "n": len(ss),
               "e2e_ms": C.median([s["e2e_ms"] for s in ss]),
               "e2e_min_ms": min(s["e2e_ms"] for s in ss),
               "send_ms": C.median(sends) if sends and mode != "floor-R" else None,
               "send_cpu_ms": C.median([s["send_cpu_ms"] for s in ss if "send_cpu_ms" in s])
               if mode not in ("floor", "floor-R") else None,
               "deq_ms": C.median([s["deq_ms"] for s in ss]),
               "x_floor": C.paired_ratio(ss, floor, round_key),
               "x_floor_R": C.paired_ratio(ss, floor_r, round_key) if n else None}
        if "arena_used" in ss[0]:
            row["arena_used"] = all(s["arena_used"] for s in ss)
        rows.append(row)
    order = {m: i for i, m in enumerate(MODES)}
    rows.sort(key=lambda r: (r["dtype"], r["R"] or 0, r["mib"], order[r["mode"]]))
    return rows


TABLE_COLS = [("mode", "mode", "s"), ("mib", "MiB", "d"), ("dtype", "dtype", "s"),
              ("R", "R", "d"), ("e2e_ms", "end-to-last ms", ".1f"),
              ("send_ms", "send ms", ".2f"), ("send_cpu_ms", "send cpu ms", ".2f"),
              ("deq_ms", "last-has-tensor ms", ".1f"),
              ("x_floor", "x floor", ".2f"), ("x_floor_R", "x floor-R", ".2f")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(ap, quick_sizes="16,256")
    ap.add_argument("--reader-busy-loop-s", type=float, default=0.0,
                    help="readers' SpinCondition busy-loop window in s (vLLM: 1.0; "
                         "default 0 = readers idle in poll, as after >1 s without a step)")
    ap.add_argument("--readers", type=C.csv_ints, default=C.csv_ints("1,2,4"),
                    help="reader (TP) counts R (default 1,2,4)")
    C.add_modes_arg(ap, MODES)
    args = ap.parse_args(argv)
    C.check_modes(ap, args, MODES)
    if args.quick:
        args.sizes, args.dtypes, args.readers = [16, 256], ["fp32"], [2]
    return C.run_and_finish(
        args, run, TABLE_COLS,
        lambda p: (f"segments left {len(p['leftovers']['segments'])}, MessageQueue shm left "
                   f"{len(p['leftovers']['mq_shm'])}, readers killed "
                   f"{len(p['leftovers']['killed_readers'])}; MQ chunk "
                   f"{p['config']['mq_max_chunk_bytes'] >> 20} MiB"),
        C.plot_hop2)

if __name__ == "__main__":
    main()
