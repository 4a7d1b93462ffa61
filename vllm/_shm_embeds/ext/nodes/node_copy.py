# SPDX-License-Identifier: Apache-2.0
"""One copy per node: the hop-2 bytes of readers on other nodes, sent inside the step.

The EngineCore asks every worker, then enables them (:func:`enable_workers`); its
remote readers then get a ``handle.StepEmbeds``. In each step that carries embeds,
every first-stage rank calls :func:`exchange` in the same order: TP rank 0 sends each
tensor once per remote node, to the node's first rank, over vLLM's TP CPU group
(gloo); that rank receives it into a segment of its node and sends its node's other
ranks the handle (or, with no segment, the bytes). The step's agreement follows
(``sites/multiproc_executor.py``), so a failure on one rank fails it on all.
May import: the core.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
from collections.abc import Callable
from typing import Any

import torch
from vllm.logger import init_logger

from vllm._shm_embeds.config import shm_dir
from vllm._shm_embeds.counters import count_many
from vllm._shm_embeds.ext.nodes import tp_group
from vllm._shm_embeds.ext.nodes.events import NodeEvent
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.handle import (
    HEADER_BYTES,
    SharedTensorHandle,
    ShmEmbedsError,
    StepEmbeds,
    dtype_name,
)
from vllm._shm_embeds.lifetime import process, transfer

logger = init_logger(__name__)

# Bump on any change of the exchange; a worker answering another number keeps the
# remote readers on the bytes in the broadcast.
NODE_WIRE = 1
# Our tag on vLLM's TP cpu_group (vLLM sends nothing point-to-point there, 0.32).
NODE_TAG = 0x4E4F4445
META_BYTES = 1024  # a handle's JSON, zero-padded: what a node's other ranks receive


@dataclasses.dataclass(frozen=True)
class Layout:
    """This worker's part in the exchange (global ranks of vLLM's TP group).

    Attributes:
        me: this rank.
        sender: TP rank 0 (on the head node: it maps the step's handles).
        leaders: the first TP rank of each other node.
        leader: this node's first TP rank (``me`` for a leader; the sender's node: -1).
        peers: a leader's node's other TP ranks.
    """

    me: int
    sender: int
    leaders: tuple[int, ...]
    leader: int
    peers: tuple[int, ...]


def layout_of(ranks: list[int], me: int, local_world_size: int) -> Layout:
    """The :class:`Layout` of ``me`` in a TP group of global ``ranks``; node of a rank =
    ``rank // local_world_size`` (``v1/executor/multiproc_executor.py`` 0.32: the head
    holds ranks ``[0, local_world_size)``, each node the next as many). Raises ValueError
    (``me`` not in ``ranks``, a size under 1)."""
    if me not in ranks or local_world_size < 1:
        raise ValueError(f"no layout for rank {me} in {ranks} ({local_world_size=})")
    nodes: dict[int, list[int]] = {}
    for r in ranks:
        nodes.setdefault(r // local_world_size, []).append(r)
    sender = ranks[0]
    remote = [sorted(rs) for n, rs in sorted(nodes.items()) if n != sender // local_world_size]
    mine = next((rs for rs in remote if me in rs), None)
    return Layout(me, sender, tuple(rs[0] for rs in remote),
                  -1 if mine is None else mine[0],
                  tuple(mine[1:]) if mine is not None and mine[0] == me else ())


class _Worker:
    """This worker process's state: ``layout`` once enabled (None: off)."""

    layout: Layout | None = None


WORKER = _Worker()


def worker_wire(ranks: list[int], rank_in_group: int, local_world_size: int) -> int | None:
    """Worker: :data:`NODE_WIRE` if this rank of the TP group of global ``ranks`` can take
    part (it has a :class:`Layout`), else None."""
    try:
        layout_of(ranks, ranks[rank_in_group], local_world_size)
    except (ValueError, IndexError):
        return None
    return NODE_WIRE


def worker_enable(ranks: list[int], rank_in_group: int, local_world_size: int,
                  on: bool = True) -> bool:
    """Worker: take part in every later exchange (``on``), or stop. Never raises."""
    try:
        WORKER.layout = layout_of(ranks, ranks[rank_in_group], local_world_size) if on else None
    except (ValueError, IndexError):
        WORKER.layout = None
    return WORKER.layout is not None or not on


def active() -> bool:
    """Worker: True once enabled (this rank takes part in every step's exchange)."""
    return WORKER.layout is not None


def enable_workers(parallel_config: Any, ask: Callable[..., Any]) -> str | None:
    """EngineCore, once per broadcast queue: ask every worker, then enable them all; None
    if on, else why not (all off). ``ask(fn, *args)``: every worker's answer of
    ``fn(tp_ranks, tp_rank, local_world_size, *args)`` of this module (:func:`enable`).
    Raises: what ``ask`` raises."""
    pc = parallel_config
    if getattr(pc, "data_parallel_size", 1) > 1:
        return "data parallelism is not covered"
    if any(getattr(pc, f, 1) > 1 for f in ("prefill_context_parallel_size",
                                           "decode_context_parallel_size")):
        return "context parallelism is not covered"
    answers = ask("worker_wire")
    if not isinstance(answers, list) or not answers or not all(
            type(a) is int and a == NODE_WIRE for a in answers):
        _disable(ask)  # any enabled before (an earlier queue's plan)
        return ("a worker does not run this version of the nodes extension (answers "
                f"{sorted(set(map(repr, answers or [])))})")
    try:
        enabled = ask("worker_enable", True)
    except BaseException:
        _disable(ask)
        raise
    if isinstance(enabled, list) and enabled and all(a is True for a in enabled):
        return None
    _disable(ask)
    return "a worker could not be enabled"


def _disable(ask: Callable[..., Any]) -> None:
    """Every worker out of the exchange, best effort (never raises)."""
    try:
        ask("worker_enable", False)
    except Exception:
        logger.warning("shm-embeds: could not tell every worker that one copy per node "
                       "is off", exc_info=True)


def worker_call(worker: Any, fn: str, *args: Any) -> Any:
    """Worker: ``fn(tp_ranks, tp_rank, local_world_size, *args)`` of this module
    (``worker``: vLLM's ``WorkerWrapperBase``; ``ParallelConfig.local_world_size``,
    ``vllm/config/parallel.py`` 0.32)."""
    tp = tp_group()
    local = worker.vllm_config.parallel_config.local_world_size
    return globals()[fn](list(tp.ranks), tp.rank_in_group, local, *args)


def _worker_call(fn: str, *args: Any) -> Callable:
    """The callable sent to every worker (by value) for :func:`worker_call`; None where
    that cannot run (no ``nodes`` extension there): it never raises (vLLM's reply
    queues stay in step)."""
    def call(worker: Any = None) -> Any:
        try:
            from vllm._shm_embeds import extensions

            nodes = extensions.get("nodes", "node_copy")
            return None if nodes is None else nodes.worker_call(worker, fn, *args)
        except Exception:
            import logging
            logging.getLogger("vllm._shm_embeds").warning(
                "shm-embeds: the nodes probe %s failed on this worker", fn, exc_info=True)
            return None

    return call


def enable(executor: Any, rpc: Callable) -> bool:
    """EngineCore (``sites/multiproc_executor.py``): True if the remote readers' bytes go
    inside the step (every worker asked and enabled through vLLM's unwrapped
    ``collective_rpc``, ``rpc``), else False (logged). Never raises."""
    def ask(fn: str, *args: Any) -> Any:
        return rpc(executor, _worker_call(fn, *args))

    try:
        why = enable_workers(executor.vllm_config.parallel_config, ask)
    except Exception:  # never into vLLM: the remote readers get the bytes (workers told)
        logger.warning("shm-embeds: one copy per node is off after an unexpected error",
                       exc_info=True)
        _disable(ask)
        return False
    if why is not None:
        logger.info("shm-embeds: one copy per node is off: %s", why)
    return why is None


def worker_step(carried: list[list[Any]]) -> Callable[[], tuple] | None:
    """Worker, first stage, before the step's forms are mapped: None when this rank takes
    no part, else what to call after mapping: :func:`exchange` over vLLM's TP group
    (``carried``: the step's ``scheduled_new_reqs`` lists). That call never raises."""
    if not active():
        return None
    forms = [(r, r.prompt_embeds) for reqs in carried for r in reqs]

    def run() -> tuple[Callable[[], None] | None, Exception | None]:
        try:
            tp = tp_group()
        except Exception as e:  # no TP group in a worker that runs a step: not vLLM's
            return None, e
        return exchange(forms, tp)

    return run


# -- the exchange (every first-stage worker, each step that carries embeds)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _allocated_segment(handle: SharedTensorHandle) -> tuple[mmap.mmap, str]:
    """A new one-file segment for ``handle`` with every page allocated (a full tmpfs is
    an OSError here, never a SIGBUS while receiving), mapped read/write: the mapping and
    its path. Raises OSError (nothing is left)."""
    path = os.path.join(shm_dir(), handle.name)
    size = HEADER_BYTES + handle.nbytes
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        seg.pwrite_all(fd, memoryview(seg.HEADER), 0)
        os.posix_fallocate(fd, 0, size)
        return seg.map_files([fd], [size], mmap.PROT_READ | mmap.PROT_WRITE), path
    except BaseException:
        seg.unlink_quietly(path)
        raise
    finally:
        os.close(fd)


class _Leader:
    """What a node's first rank made in one step: segments to unlink after it."""

    def __init__(self) -> None:
        self.files: list[tuple[str, int]] = []  # (path, bytes)

    def target(self, dtype: torch.dtype, shape: tuple[int, ...]
               ) -> tuple[torch.Tensor, SharedTensorHandle | None]:
        """A tensor to receive into: over a new segment of this node
        (:func:`_allocated_segment`), else in memory. Never raises but MemoryError."""
        try:
            state = process.current()
            handle = SharedTensorHandle(state.new_name(), dtype_name(dtype), shape)
            transfer.check_budget(handle.nbytes)
            mm, path = _allocated_segment(handle)
        except Exception as e:  # budget, ENOSPC, segment cap, ours: the bytes in memory
            logger.warning("shm-embeds: this node's copy is in memory: %s", e)
            return torch.empty(shape, dtype=dtype), None
        state.census(shm_dir()).wrote(handle.nbytes)
        self.files.append((path, handle.nbytes))
        return seg.tensor_view(mm, handle)[0], handle

    def finish(self) -> None:
        """Unlink the step's segments (mapped tensors stay valid). Never raises."""
        files, self.files = self.files, []
        for path, nbytes in files:
            try:
                if seg.unlink_quietly(path):
                    process.current().census(shm_dir()).unlinked(nbytes)
            except Exception:
                logger.debug("shm-embeds: could not unlink a node segment", exc_info=True)


def _meta_of(handle: SharedTensorHandle | None) -> torch.Tensor:
    """The 1 KiB slot a node's other ranks receive: the handle's JSON, or zeros (no
    segment: the bytes follow)."""
    buf = torch.zeros(META_BYTES, dtype=torch.uint8)
    raw = json.dumps(handle.to_meta()).encode() if handle is not None else b""
    if 0 < len(raw) <= META_BYTES:
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def _handle_in(buf: torch.Tensor) -> SharedTensorHandle | None:
    """The handle a slot holds; None if empty. Raises ShmEmbedsError (malformed)."""
    raw = bytes(buf.numpy()).rstrip(b"\0")
    if not raw:
        return None
    try:
        return SharedTensorHandle.from_meta(json.loads(raw))
    except (ValueError, RecursionError) as e:  # (RecursionError: nested too deep)
        raise ShmEmbedsError("malformed node segment handle") from e


class _Ops:
    """This rank's point-to-point operations of one step, in order. Each one is made
    whatever failed before (a peer waits for it: a gloo send needs its recv), but with a
    peer whose operation failed (its connection is gone); the first error is kept."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.error: BaseException | None = None
        self.dead: set[int] = set()

    def fail(self, e: BaseException) -> None:
        self.error = self.error or e

    def send(self, t: torch.Tensor, dst: int) -> bool:
        return self._op("send", t, dst)

    def recv(self, t: torch.Tensor, src: int) -> bool:
        return self._op("recv", t, src)

    def _op(self, what: str, t: torch.Tensor, peer: int) -> bool:
        import torch.distributed as dist

        if peer in self.dead:
            return False
        try:
            if what == "send":
                dist.send(t, dst=peer, group=self.group, tag=NODE_TAG)
            else:
                dist.recv(t, src=peer, group=self.group, tag=NODE_TAG)
            return True
        except Exception as e:  # a peer gone: gloo's own error; the step fails
            logger.error("shm-embeds: one copy per node: %s with rank %d failed: %s",
                         what, peer, e)
            self.fail(e)
            self.dead.add(peer)
            return False


def _send_all(ops: _Ops, layout: Layout, req: Any, nbytes: int) -> None:
    """TP rank 0: the tensor to every other node's first rank (zeros if not mapped)."""
    tensor = req.prompt_embeds
    if not (isinstance(tensor, torch.Tensor) and tensor.is_contiguous()
            and tensor.nbytes == nbytes):  # not mapped: the step fails anyway
        ops.fail(ShmEmbedsError("TP rank 0 has no tensor to send"))
        tensor = torch.zeros(nbytes, dtype=torch.uint8)
    sent = sum(ops.send(_as_bytes(tensor), dst) for dst in layout.leaders)
    count_many({NodeEvent.NODE_SENT_TENSORS: sent, NodeEvent.NODE_SENT_BYTES: nbytes * sent})


def _receive_and_hand_on(ops: _Ops, layout: Layout, leader: _Leader, req: Any,
                         dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> None:
    """A node's first rank: receive, then the handle (or the bytes) to the node's others."""
    tensor, handle = leader.target(dtype, shape)
    if ops.recv(_as_bytes(tensor), layout.sender):
        count_many({NodeEvent.NODE_RECEIVED_TENSORS: 1, NodeEvent.NODE_RECEIVED_BYTES: nbytes})
        if handle is not None:
            count_many({NodeEvent.NODE_SEGMENT_TENSORS: 1})
    req.prompt_embeds = tensor
    for peer in layout.peers:
        ops.send(_meta_of(handle), peer)
        if handle is None and ops.send(_as_bytes(tensor), peer):
            count_many({NodeEvent.NODE_PEER_BYTES: nbytes})


def _receive_from_leader(ops: _Ops, layout: Layout, req: Any, dtype: torch.dtype,
                         shape: tuple[int, ...]) -> None:
    """A node's other rank: map the first rank's segment, or receive the bytes."""
    buf = torch.zeros(META_BYTES, dtype=torch.uint8)
    if not ops.recv(buf, layout.leader):
        return
    if not buf.any():  # no segment there: the bytes follow
        tensor = torch.empty(shape, dtype=dtype)
        ops.recv(_as_bytes(tensor), layout.leader)
        req.prompt_embeds = tensor
        return
    try:
        handle = _handle_in(buf)
        if handle is None or (handle.torch_dtype, handle.shape) != (dtype, shape):
            raise ShmEmbedsError("the node segment is not the step's tensor")
        req.prompt_embeds = transfer.open_tensor(handle, 0)  # read-only
        count_many({NodeEvent.NODE_MAPPED_TENSORS: 1})
    except (ShmEmbedsError, OSError) as e:
        ops.fail(e)


def exchange(forms: list[tuple[Any, Any]], tp: Any
             ) -> tuple[Callable[[], None] | None, Exception | None]:
    """One step's exchange on this rank: ``forms`` are ``(request, prompt_embeds form)``
    of the step as broadcast (before mapping), in order; this rank's requests get their
    tensors. ``tp``: vLLM's TP ``GroupCoordinator`` (its ``cpu_group``, gloo).

    Returns what to call once every rank agreed (None: nothing; it unlinks this node's
    segments) and the first error (None: none). Never raises an Exception: every
    operation a peer waits for is made whatever failed before, but with a peer whose
    connection failed. On BaseException (e.g. SystemExit) the segments are unlinked
    first."""
    layout = WORKER.layout
    items = [(req, form) for req, form in forms
             if isinstance(form, (SharedTensorHandle, StepEmbeds))]
    if layout is None or not items or not layout.leaders:
        return None, None
    ops = _Ops(tp.cpu_group)
    leader = _Leader() if layout.leader == layout.me else None
    try:
        for req, form in items:
            dtype, shape = form.torch_dtype, tuple(form.shape)
            nbytes = SharedTensorHandle("x", form.dtype, shape).nbytes
            if layout.me == layout.sender:
                if nbytes:
                    _send_all(ops, layout, req, nbytes)
            elif layout.leader < 0:
                continue  # on the sender's node: nothing to do
            elif not nbytes:
                req.prompt_embeds = torch.empty(shape, dtype=dtype)
            elif leader is not None:
                _receive_and_hand_on(ops, layout, leader, req, dtype, shape, nbytes)
            else:
                _receive_from_leader(ops, layout, req, dtype, shape)
    except Exception as e:  # ours, unexpected (a bug): the step fails on every rank
        logger.error("shm-embeds: one copy per node failed in this step", exc_info=True)
        ops.fail(e)
    except BaseException:
        if leader is not None:
            leader.finish()
        raise
    error = ops.error
    if error is not None and not isinstance(error, Exception):
        error = ShmEmbedsError(str(error))
    return (leader.finish if leader is not None and leader.files else None), error
