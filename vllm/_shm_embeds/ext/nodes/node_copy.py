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
from collections.abc import Callable
from typing import Any

import torch
from vllm.logger import init_logger

from vllm._shm_embeds.config import shm_dir
from vllm._shm_embeds.counters import count_many
from vllm._shm_embeds.ext.nodes.events import NodeEvent
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.handle import (
    SharedTensorHandle,
    ShmEmbedsError,
    StepEmbeds,
    dtype_name,
)
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.lifetime.streamed import StreamedFile

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
    ``fn(tp_ranks, tp_rank, local_world_size, *args)`` of this module (the core's
    ``sites/multiproc_executor.py``, through vLLM's ``collective_rpc``). Raises: what
    ``ask`` raises."""
    pc = parallel_config
    if getattr(pc, "data_parallel_size", 1) > 1:
        return "data parallelism is not covered"
    if any(getattr(pc, f, 1) > 1 for f in ("prefill_context_parallel_size",
                                           "decode_context_parallel_size")):
        return "context parallelism is not covered"
    answers = ask("worker_wire")
    if not isinstance(answers, list) or not all(a == NODE_WIRE for a in answers):
        return ("a worker does not run this version of the nodes extension (answers "
                f"{sorted(set(map(repr, answers or [])))})")
    enabled = ask("worker_enable", True)
    if isinstance(enabled, list) and enabled and all(a is True for a in enabled):
        return None
    ask("worker_enable", False)
    return "a worker could not be enabled"


# -- the exchange (every first-stage worker, each step that carries embeds)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class _Leader:
    """What a node's first rank made in one step: segments to unlink after it."""

    def __init__(self) -> None:
        self.files: list[StreamedFile] = []

    def target(self, dtype: torch.dtype, shape: tuple[int, ...]
               ) -> tuple[torch.Tensor, SharedTensorHandle | None]:
        """A tensor to receive into: over a new segment of this node, else in memory."""
        handle = SharedTensorHandle(process.current().new_name(), dtype_name(dtype), shape)
        try:
            transfer.check_budget(handle.nbytes)
            f = StreamedFile(shm_dir(), handle)
        except OSError as e:
            logger.warning("shm-embeds: this node's copy is in memory: %s", e)
            return torch.empty(shape, dtype=dtype), None
        self.files.append(f)
        try:
            f.assume_filled()
            mm = f.finish(writable=True)
        except (OSError, ShmEmbedsError) as e:
            logger.warning("shm-embeds: this node's copy is in memory: %s", e)
            f.abort()
            return torch.empty(shape, dtype=dtype), None
        return seg.tensor_view(mm, handle)[0], handle

    def finish(self) -> None:
        """Unlink the step's segments (mapped tensors stay valid). Never raises."""
        for f in self.files:
            try:
                f.abort()
            except Exception:
                logger.debug("shm-embeds: could not unlink a node segment", exc_info=True)
        self.files = []


def _send_meta(handle: SharedTensorHandle | None, dst: int, group: Any) -> None:
    import torch.distributed as dist

    raw = json.dumps(handle.to_meta()).encode() if handle is not None else b""
    if len(raw) > META_BYTES:
        raise ShmEmbedsError("a node segment's handle is over its slot")
    buf = torch.zeros(META_BYTES, dtype=torch.uint8)
    if raw:
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.send(buf, dst=dst, group=group, tag=NODE_TAG)


def _recv_meta(src: int, group: Any) -> SharedTensorHandle | None:
    import torch.distributed as dist

    buf = torch.zeros(META_BYTES, dtype=torch.uint8)
    dist.recv(buf, src=src, group=group, tag=NODE_TAG)
    raw = bytes(buf.numpy()).rstrip(b"\0")
    if not raw:
        return None
    try:
        return SharedTensorHandle.from_meta(json.loads(raw))
    except ValueError as e:
        raise ShmEmbedsError("malformed node segment handle") from e


def exchange(forms: list[tuple[Any, Any]], tp: Any
             ) -> tuple[Callable[[], None] | None, Exception | None]:
    """One step's exchange on this rank: ``forms`` are ``(request, prompt_embeds form)``
    of the step as broadcast (before mapping), in order; this rank's requests get their
    tensors. ``tp``: vLLM's TP ``GroupCoordinator`` (its ``cpu_group``, gloo). Returns what to call once every rank agreed (None: nothing) and the first
    error (None: none). Never raises; after an error it still takes part in every later
    tensor's sends unless the transport itself failed."""
    layout = WORKER.layout
    items = [(req, form) for req, form in forms
             if isinstance(form, (SharedTensorHandle, StepEmbeds))]
    if layout is None or not items or not layout.leaders:
        return None, None
    import torch.distributed as dist

    group = tp.cpu_group
    leader = _Leader() if layout.leader == layout.me else None
    error: Exception | None = None
    try:
        for req, form in items:
            dtype, shape = form.torch_dtype, tuple(form.shape)
            nbytes = SharedTensorHandle("x", form.dtype, shape).nbytes
            if layout.me == layout.sender:
                tensor = req.prompt_embeds
                if not (isinstance(tensor, torch.Tensor) and tensor.is_contiguous()
                        and tensor.nbytes == nbytes):  # not mapped: the step fails anyway
                    error = error or ShmEmbedsError("TP rank 0 has no tensor to send")
                    tensor = torch.zeros(nbytes, dtype=torch.uint8)
                if nbytes:
                    for dst in layout.leaders:
                        dist.send(_as_bytes(tensor), dst=dst, group=group, tag=NODE_TAG)
                    count_many({NodeEvent.NODE_SENT_TENSORS: len(layout.leaders),
                                NodeEvent.NODE_SENT_BYTES: nbytes * len(layout.leaders)})
            elif leader is not None:
                tensor, handle = (leader.target(dtype, shape) if nbytes
                                  else (torch.empty(shape, dtype=dtype), None))
                if nbytes:
                    dist.recv(_as_bytes(tensor), src=layout.sender, group=group, tag=NODE_TAG)
                    count_many({NodeEvent.NODE_RECEIVED_TENSORS: 1,
                                NodeEvent.NODE_RECEIVED_BYTES: nbytes})
                    if handle is not None:
                        count_many({NodeEvent.NODE_SEGMENT_TENSORS: 1})
                req.prompt_embeds = tensor
                for peer in layout.peers if nbytes else ():
                    _send_meta(handle, peer, group)
                    if handle is None:
                        dist.send(_as_bytes(tensor), dst=peer, group=group, tag=NODE_TAG)
                        count_many({NodeEvent.NODE_PEER_BYTES: nbytes})
            elif layout.leader >= 0:
                if not nbytes:
                    req.prompt_embeds = torch.empty(shape, dtype=dtype)
                    continue
                handle = _recv_meta(layout.leader, group)
                if handle is None:
                    tensor = torch.empty(shape, dtype=dtype)
                    dist.recv(_as_bytes(tensor), src=layout.leader, group=group, tag=NODE_TAG)
                    req.prompt_embeds = tensor
                    continue
                try:
                    if (handle.torch_dtype, handle.shape) != (dtype, shape):
                        raise ShmEmbedsError("the node segment is not the step's tensor")
                    req.prompt_embeds = transfer.open_tensor(handle, 0)  # read-only
                    count_many({NodeEvent.NODE_MAPPED_TENSORS: 1})
                except (ShmEmbedsError, OSError) as e:
                    error = error or e
    except Exception as e:  # the transport (a peer gone) or ours: the step fails
        logger.error("shm-embeds: one copy per node failed in this step: %s", e)
        error = error or e
    if leader is not None and error is not None:
        leader.finish()
        return None, error
    return (leader.finish if leader is not None and leader.files else None), error
