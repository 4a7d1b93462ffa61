# SPDX-License-Identifier: Apache-2.0
"""Hop 1 in isolation: client -> EngineCore, by vLLM's own encode/socket/decode path.

The client (this process) builds an ``EngineCoreRequest`` whose
``prompt_embeds`` is an ``(N_tokens, hidden)`` tensor of N bytes, encodes it
with ``vllm.v1.serial_utils.MsgpackEncoder`` and sends the frames with
``send_multipart(copy=False)`` on a ZMQ ROUTER socket bound on ``ipc://``; an
"EngineCore" process (multiprocessing "spawn") receives them on a DEALER
socket with ``recv_multipart(copy=False)`` and decodes with
``MsgpackDecoder(EngineCoreRequest, oob_tensor_provider=...)``; socket types,
options and the ADD type frame are those of ``MPClient`` /
``EngineCoreProc.process_input_sockets`` (built with vLLM's
``make_zmq_socket``). The EngineCore keeps the decoded request (as it would)
until the next one arrives.

Modes (interleaved per repeat):

* ``stock``       plain encoder/decoder: the tensor bytes travel as a ZMQ frame;
                  the kernel copies them into the unix socket and out again
                  (2 copies), the decoder aliases the received frame
* ``shm-embeds``  encoder wrapped as the glue does (``HandleOOBConsumer`` armed
                  with ``prompt_embeds``): one copy (``pwrite``) into a ``/dev/shm``
                  segment, a handle in the frames; the decoder's ``HandleOOBProvider``
                  adopts the segment (rename + mmap, no copy)
* ``floor``       one ``C.fresh_empty(N bytes).copy_(src)`` into fresh memory

Metrics, medians over ``--repeats`` after one warm-up: ratios to the floor are
medians of per-repeat paired ratios. ``e2e_ms`` from the
client starting ``encode`` to ``decode`` returning in the EngineCore;
``client_ms`` encode + ``send_multipart`` in the client; ``read_ms`` the
EngineCore's first full read pass over the tensor afterwards (not in
``e2e_ms``; it stands for the later prefix-cache hashing, and shows the page
faults a fresh mapping defers); ``copies`` of the N bytes, counted as
user-space copies (shm-embeds counter ``copied_bytes``, or a decoded tensor
not aliasing a received frame) plus 2 per byte sent through the socket.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
from typing import Any

os.environ["VLLM_SHM_EMBEDS"] = "1"
os.environ["VLLM_SHM_EMBEDS_MIN_BYTES"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402

import _common as C  # noqa: E402
from vllm._shm_embeds import config, counters  # noqa: E402
from vllm._shm_embeds.hops import hop1  # noqa: E402
from vllm._shm_embeds.lifetime import process  # noqa: E402
from vllm._shm_embeds.sites.core_client import ArmingEncoder as _ArmingEncoder  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.network_utils import get_open_zmq_ipc_path, make_zmq_socket  # noqa: E402
from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

MODES = C.HOP1_MODES
ENGINE_IDENTITY = (0).to_bytes(2, "little")  # as MPClient names engine 0
CTL = b"ctl"
RESULT_TIMEOUT_S = 900.0


# --------------------------------------------------------------------------
# EngineCore process


def _frame_addr(frame: Any) -> tuple[int, int]:
    """(address, length) of a received zmq frame's bytes."""
    arr = np.frombuffer(frame.buffer, dtype=np.uint8)
    return arr.__array_interface__["data"][0], arr.size


def _engine(addr: str, results: Any) -> None:
    """Receive requests until a ``None`` control message; report per request."""
    decoders = {
        "stock": MsgpackDecoder(EngineCoreRequest),
        "shm-embeds": MsgpackDecoder(
            EngineCoreRequest, oob_tensor_provider=hop1.HandleOOBProvider(None)
        ),
    }
    ctx = zmq.Context()
    sock = make_zmq_socket(ctx, addr, zmq.DEALER, identity=ENGINE_IDENTITY, bind=False)
    sock.send(b"READY")
    mode, req = "stock", None
    try:
        while True:
            type_frame, *data_frames = sock.recv_multipart(copy=False)
            if type_frame.bytes == CTL:
                ctl = pickle.loads(data_frames[0].bytes)
                if ctl is None:
                    break
                mode, req = ctl["mode"], None  # drop the previous request
                gc.collect()
                results.put(("ready",))
                continue
            assert EngineCoreRequestType(type_frame.bytes) == EngineCoreRequestType.ADD
            adopted0 = counters.stats().get("hop1_adopted_tensors", 0)
            req = decoders[mode].decode(data_frames)
            t_done = time.monotonic()
            t = req.prompt_embeds
            ptr = t.data_ptr()
            aliases_frame = any(a <= ptr < a + n for a, n in map(_frame_addr, data_frames))
            adopted = counters.stats().get("hop1_adopted_tensors", 0) - adopted0
            t_r = time.monotonic()
            t.view(-1).view(torch.int16).max()  # first full read pass (any dtype)
            read_ms = (time.monotonic() - t_r) * 1e3
            results.put(("done", t_done, read_ms, float(t[-1, -1]), aliases_frame, adopted))
    finally:
        req = None
        sock.close(linger=0)
        ctx.term()
        process.shutdown()


# --------------------------------------------------------------------------
# client side


class Client:
    """The ROUTER socket, the two encoders, and the spawned EngineCore."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.addr = get_open_zmq_ipc_path()
        self.sock = make_zmq_socket(self.ctx, self.addr, zmq.ROUTER, bind=True)
        self.encoders = {"stock": MsgpackEncoder()}
        enc = MsgpackEncoder()
        consumer = hop1.HandleOOBConsumer(enc.oob_tensor_consumer)  # as the glue
        enc.oob_tensor_consumer = consumer
        self.encoders["shm-embeds"] = _ArmingEncoder(enc, consumer)
        mpctx = mp.get_context("spawn")
        self.results = mpctx.Queue()
        self.proc = mpctx.Process(target=_engine, args=(self.addr, self.results), daemon=True)
        self.proc.start()
        identity, payload = self.sock.recv_multipart()
        assert identity == ENGINE_IDENTITY and payload == b"READY"

    def ctl(self, obj: Any) -> None:
        self.sock.send_multipart([ENGINE_IDENTITY, CTL, pickle.dumps(obj)])

    def wait(self, kind: str) -> tuple:
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while True:
            try:
                msg = self.results.get(timeout=1.0)
            except queue.Empty:
                if not self.proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("EngineCore process died or hung") from None
                continue
            assert msg[0] == kind, msg
            return msg

    def close(self) -> bool:
        """Stop the EngineCore; True if it had to be killed."""
        killed = False
        try:
            self.ctl(None)
        except zmq.ZMQError:
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            killed = True
            self.proc.terminate()
            self.proc.join(timeout=10)
        self.sock.close(linger=0)
        self.ctx.term()
        self.results.close()
        # libzmq leaves the bound ipc:// file behind; we created it, remove it.
        path = self.addr.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)
        return killed


def make_request(embeds: torch.Tensor) -> EngineCoreRequest:
    """A minimal valid prompt-embeds ``EngineCoreRequest``."""
    return EngineCoreRequest(
        request_id="bench-hop1",
        prompt_token_ids=None,
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        prompt_embeds=embeds,
    )


def one_send(client: Client, mode: str, src: torch.Tensor, val: float,
             gap_s: float) -> dict[str, Any]:
    """Time one request (or one floor copy) in ``mode``."""
    nbytes = src.nbytes
    src[-1, -1] = val
    if mode == "floor":
        time.sleep(gap_s)
        return {"e2e_ms": C.floor_copy_ms(src), "client_ms": None, "read_ms": None,
                "copies": 1.0}
    client.ctl({"mode": mode})
    client.wait("ready")
    req = make_request(src)
    enc = client.encoders[mode]
    copied0 = counters.stats().get("copied_bytes", 0)
    time.sleep(gap_s)

    t0 = time.monotonic()
    frames = enc.encode(req)
    client.sock.send_multipart(
        (ENGINE_IDENTITY, EngineCoreRequestType.ADD.value, *frames), copy=False
    )
    t1 = time.monotonic()

    _, t_done, read_ms, got, aliases_frame, adopted = client.wait("done")
    if got != val:
        raise AssertionError(f"EngineCore got {got}, want {val}")
    socket_bytes = sum(memoryview(f).nbytes for f in frames)
    user_copy = counters.stats().get("copied_bytes", 0) - copied0
    if mode == "stock" and not aliases_frame:
        user_copy += nbytes  # the decoder copied out of the frame
    if mode == "shm-embeds" and adopted != 1:
        raise AssertionError("EngineCore did not adopt the segment")
    return {"e2e_ms": (t_done - t0) * 1e3, "client_ms": (t1 - t0) * 1e3,
            "read_ms": read_ms, "copies": (user_copy + 2 * socket_bytes) / nbytes,
            "socket_bytes": socket_bytes, "user_copy_bytes": user_copy}


# --------------------------------------------------------------------------
# driver


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    modes = [m for m in MODES if m in args.modes]
    total = len(args.sizes) * len(args.dtypes) * len(modes) * (1 + args.repeats)
    bar = tqdm(total=total, desc="hop1", unit="send", disable=total < 30,
               mininterval=2.0, file=sys.stderr)
    samples: list[dict[str, Any]] = []
    client = Client()
    engine_pid = client.proc.pid
    val = 0
    try:
        for mib in args.sizes:
            for dtype in args.dtypes:
                tdt = getattr(torch, C.DTYPES[dtype])
                src = torch.full(C.shape_for(mib * C.MIB, args.hidden, tdt.itemsize),
                                 0.5, dtype=tdt)  # warm, private
                for rep in range(1 + args.repeats):
                    for mode in modes:
                        val = val % 200 + 1
                        s = one_send(client, mode, src, float(val), args.gap)
                        bar.update()
                        if rep:
                            s.update(mode=mode, mib=mib, dtype=dtype, rep=rep)
                            samples.append(s)
                del src
    finally:
        killed = client.close()
        bar.close()
    ipc_file = client.addr.removeprefix("ipc://")
    return {
        "bench": "hop1",
        "machine": C.machine_info(),
        "config": {"sizes_mib": args.sizes, "dtypes": args.dtypes, "repeats": args.repeats,
                   "hidden": args.hidden, "gap_s": args.gap, "modes": modes,
                   "zmq_addr": client.addr},
        "rows": aggregate(samples),
        "samples": samples,
        "leftovers": {
            "engine_killed": killed,
            "segments": C.our_segments([os.getpid(), engine_pid], config.shm_dir()),
            "ipc_socket_file": os.path.exists(ipc_file),
        },
        "shm_embeds_counters": counters.stats(),
    }


def aggregate(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median per (mode, MiB, dtype) plus the ratio to ``floor``."""
    rows = []
    for (mode, mib, dtype), ss in C.group_samples(samples, ("mode", "mib", "dtype")):

        def med(k: str) -> float | None:
            xs = [s[k] for s in ss if s[k] is not None]
            return C.median(xs) if xs else None

        rows.append({"mode": mode, "mib": mib, "dtype": dtype, "n": len(ss),
                     "e2e_ms": med("e2e_ms"), "e2e_min_ms": min(s["e2e_ms"] for s in ss),
                     "client_ms": med("client_ms"), "read_ms": med("read_ms"),
                     "copies": max(s["copies"] for s in ss),
                     # Paired: each sample against the floor of its repeat round.
                     "x_floor": C.paired_ratio(ss, floor := {
                         (s["mib"], s["dtype"], s["rep"]): s["e2e_ms"]
                         for s in samples if s["mode"] == "floor"},
                         lambda s: (s["mib"], s["dtype"], s["rep"]))})
    del floor
    order = {m: i for i, m in enumerate(MODES)}
    rows.sort(key=lambda r: (r["dtype"], r["mib"], order[r["mode"]]))
    return rows


TABLE_COLS = [("mode", "mode", "s"), ("mib", "MiB", "d"), ("dtype", "dtype", "s"),
              ("e2e_ms", "encode->decoded ms", ".1f"), ("client_ms", "client ms", ".1f"),
              ("x_floor", "x floor", ".2f"), ("copies", "copies", ".2f"),
              ("read_ms", "1st read ms", ".1f")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(ap, quick_sizes="16,256")
    C.add_modes_arg(ap, MODES)
    args = ap.parse_args(argv)
    C.check_modes(ap, args, MODES)
    if args.quick:
        args.sizes, args.dtypes = [16, 256], ["fp32"]
    return C.run_and_finish(
        args, run, TABLE_COLS,
        lambda p: (f"segments left {len(p['leftovers']['segments'])}, EngineCore killed "
                   f"{p['leftovers']['engine_killed']}, ipc socket file left "
                   f"{p['leftovers']['ipc_socket_file']}"),
        C.plot_hop1)

if __name__ == "__main__":
    main()
