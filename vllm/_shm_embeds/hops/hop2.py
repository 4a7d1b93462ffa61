# SPDX-License-Identifier: Apache-2.0
"""Hop 2, EngineCore -> every TP worker: handles instead of tensors in the broadcast. Works
on any objects with a ``prompt_embeds`` attribute; knows nothing of vLLM's classes."""

from __future__ import annotations

import collections
import dataclasses
import mmap
import os
from collections.abc import Iterable
from typing import Any

import torch
from vllm.logger import init_logger

from vllm._shm_embeds.config import shm_dir
from vllm._shm_embeds.counters import Event, count, count_many, count_reason
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.handle import (HEADER_BYTES, MAX_READERS, EmbedsPlaceholder, InlineEmbeds,
                                     SharedTensorHandle, ShmEmbedsError, StepEmbeds, dtype_name,
                                     placeholder_tensor)
from vllm._shm_embeds.lifetime import process
from vllm._shm_embeds.lifetime.lifecycle import Kind
from vllm._shm_embeds.lifetime.transfer import (create_segment, dense_nbytes, eligible,
                                                 open_tensor, send_view)

logger = init_logger(__name__)


def externalize(tensor: torch.Tensor, readers: int) -> SharedTensorHandle:
    """Handle for ``tensor`` to broadcast to ``readers`` local readers, with reader flags of
    its own. Raises OSError (no new segment) or ValueError (``readers`` not in
    1..:data:`MAX_READERS`)."""
    if not 0 < readers <= MAX_READERS:
        raise ValueError(f"readers must be in 1..{MAX_READERS}, got {readers}")
    owned = process.current().owned
    entry = owned.lookup(tensor)
    handle = owned.broadcast(entry, readers) if entry is not None else None
    if handle is not None:
        count(Event.HOP2_REUSED_TENSORS)
        return handle
    new, fds = create_segment(tensor)
    try:
        # (no dup of the fd, unlike mmap.mmap(fd): the fds close once the broadcasts settle)
        mm = seg.map_files(fds[:1], [HEADER_BYTES], mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        for fd in fds:
            os.close(fd)
        seg.unlink_segment(shm_dir(), new.name, len(new.parts()))
        raise
    owned.own(Kind.COPY, new, mm, tensor, fds=fds)
    entry = owned.lookup(tensor)
    handle = owned.broadcast(entry, readers) if entry is not None else None
    assert handle is not None  # just owned: found, every flag free
    return handle


@dataclasses.dataclass(frozen=True)
class ReaderPlan:
    """What each reader of one engine's broadcast gets.

    Attributes:
        handle_readers: local first-stage readers, which map the handles (and have flags).
        local_later: local later-stage readers: the same handles, mapped by none.
        remote: readers on other nodes.
        remote_bytes: remote readers get :class:`InlineEmbeds` (some is on the first
            stage), else an :class:`EmbedsPlaceholder`.
        in_step: with ``remote_bytes``, remote readers get a :class:`StepEmbeds` instead
            (an extension carries the bytes inside the step, ``ext/nodes``).
    """

    handle_readers: int
    local_later: int
    remote: int
    remote_bytes: bool
    in_step: bool = False

    def reader_kinds(self) -> dict[str, int]:
        """Readers per kind (the ``reason`` label of ``hop2_reader_tensors``)."""
        remote = ("remote_in_step" if self.in_step else "remote_bytes") if self.remote_bytes \
            else "remote_placeholder"
        kinds = {"local_handle": self.handle_readers, "local_placeholder": self.local_later,
                 remote: self.remote}
        return {k: n for k, n in kinds.items() if n}


def reader_plan(first_stage: int, n_local: int, n_remote: int) -> ReaderPlan:
    """The :class:`ReaderPlan` of a broadcast queue.

    Args:
        first_stage: ranks ``[0, first_stage)``, the first pipeline stage (TP x PCP;
            ``rank = pp_rank * tp * pcp + ...``, ``vllm/distributed/parallel_state.py`` 0.32).
        n_local: local readers, ranks ``[0, n_local)`` (index = rank: ``MessageQueue(
            world_size, local_world_size)``, ``v1/executor/multiproc_executor.py`` 0.32).
        n_remote: readers on other nodes (all other ranks).
    Raises:
        ValueError: no local reader, or over :data:`MAX_READERS` first-stage readers.
    """
    if n_local < 1 or first_stage < 1 or n_remote < 0:
        raise ValueError(f"no reader plan for {first_stage=} {n_local=} {n_remote=}")
    handle_readers = min(first_stage, n_local)
    if handle_readers > MAX_READERS:
        raise ValueError(f"{handle_readers} readers is over {MAX_READERS}")
    return ReaderPlan(handle_readers, n_local - handle_readers, n_remote,
                      n_remote > 0 and first_stage > n_local)


def remote_form(tensor: torch.Tensor, plan: ReaderPlan) -> EmbedsPlaceholder | InlineEmbeds:
    """What ``plan``'s remote readers get instead of the handle (:attr:`ReaderPlan.in_step`)."""
    if plan.in_step:
        return StepEmbeds(dtype_name(tensor.dtype), tuple(tensor.shape))
    if plan.remote_bytes:
        return InlineEmbeds(send_view(tensor))
    return EmbedsPlaceholder(dtype_name(tensor.dtype), tuple(tensor.shape))


def count_readers(plan: ReaderPlan, swapped: list[tuple[Any, torch.Tensor]]) -> None:
    """Count each broadcast tensor of ``swapped`` once per reader kind (EngineCore)."""
    for kind, n in plan.reader_kinds().items():
        count_reason(Event.HOP2_READER_TENSORS, kind, hop="2", n=n * len(swapped))
    if plan.remote_bytes and not plan.in_step:
        count(Event.HOP2_REMOTE_BYTES, sum(t.nbytes for _, t in swapped) * plan.remote)


EMBEDS_FORMS = (SharedTensorHandle, EmbedsPlaceholder, InlineEmbeds)


def carries_embeds(new_reqs: Iterable[Any] | None) -> bool:
    """True if some ``prompt_embeds`` of ``new_reqs`` is one of :data:`EMBEDS_FORMS`."""
    return any(isinstance(getattr(r, "prompt_embeds", None), EMBEDS_FORMS)
               for r in new_reqs or ())


def externalize_prompt_embeds(new_reqs: Iterable[Any],
                              readers: int) -> list[tuple[Any, torch.Tensor]]:
    """Swap each eligible ``prompt_embeds`` tensor on ``new_reqs`` (``NewRequestData``) for
    a handle; ``(obj, tensor)`` pairs for :func:`restore_prompt_embeds`."""
    swapped: list[tuple[Any, torch.Tensor]] = []
    for req in new_reqs:
        tensor = getattr(req, "prompt_embeds", None)
        if tensor is None or isinstance(tensor, SharedTensorHandle):
            continue
        reason = eligible(tensor)
        if reason is None:
            try:
                handle = externalize(tensor, readers)
            except OSError as e:
                reason = process.placement_failed("hop 2", tensor.nbytes, e)
            except Exception:  # ours, unexpected: the stock path for this tensor
                logger.warning("shm-embeds: hop 2 sends a tensor the stock way after an "
                               "unexpected error", exc_info=True)
                reason = "error"
        if reason is not None:
            count_many({Event.HOP2_STOCK_TENSORS: 1, Event.HOP2_STOCK_BYTES: dense_nbytes(tensor)})
            count_reason(Event.FALLBACK, reason, hop="2")
            continue
        req.prompt_embeds = handle
        swapped.append((req, tensor))
        count_many({Event.HOP2_SHM_TENSORS: 1, Event.HOP2_SHM_BYTES: tensor.nbytes})
    return swapped


def send_views(new_reqs: Iterable[Any]) -> list[tuple[Any, torch.Tensor]]:
    """Swap each ``prompt_embeds`` tensor on ``new_reqs`` that a mapping of ours holds for
    its ``transfer.send_view``; ``(obj, tensor)`` pairs for :func:`restore_prompt_embeds`."""
    swapped: list[tuple[Any, torch.Tensor]] = []
    for req in new_reqs:
        tensor = getattr(req, "prompt_embeds", None)
        view = send_view(tensor)  # ``tensor`` itself if not a tensor
        if view is not tensor:
            req.prompt_embeds = view
            swapped.append((req, tensor))
    return swapped


def restore_prompt_embeds(swapped: list[tuple[Any, torch.Tensor]]) -> None:
    """Put back the tensors swapped out (``(obj, tensor)`` pairs)."""
    for req, tensor in swapped:
        req.prompt_embeds = tensor


def internalize_prompt_embeds(new_reqs: Iterable[Any], reader_index: int | None,
                              first_stage: bool = True) -> int:
    """Replace each of our forms in ``new_reqs[i].prompt_embeds`` by a tensor (worker; a
    later stage: a ``handle.placeholder_tensor``; a :class:`StepEmbeds` is left for the
    step's extension); returns the number mapped. Raises ShmEmbedsError: the first error
    (segment not mapped, reader index out of range, placeholder on the first stage), after
    every form was tried."""
    n = placeholders = 0
    first: ShmEmbedsError | None = None
    for req in new_reqs:
        form = getattr(req, "prompt_embeds", None)
        if not isinstance(form, EMBEDS_FORMS):
            continue
        if not first_stage:
            tensor = form.tensor if isinstance(form, InlineEmbeds) else None
            dtype = tensor.dtype if tensor is not None else form.torch_dtype
            shape = tuple(tensor.shape) if tensor is not None else form.shape
            req.prompt_embeds = placeholder_tensor(dtype, shape)
            placeholders += 1
            continue
        if isinstance(form, InlineEmbeds):
            req.prompt_embeds = form.tensor
            continue
        if isinstance(form, StepEmbeds):
            continue
        try:
            if isinstance(form, EmbedsPlaceholder):
                raise ShmEmbedsError("a first-stage reader got a placeholder")
            if (reader_index is not None and form.readers
                    and not 0 <= reader_index < form.readers):
                raise ShmEmbedsError(f"reader index {reader_index} is beyond the "
                                     f"{form.readers} readers of this broadcast")
            req.prompt_embeds = open_tensor(form, reader_index)
        except (ShmEmbedsError, OSError) as e:
            count_reason(Event.FALLBACK, "map_failed", hop="2")
            if first is None:
                first = e if isinstance(e, ShmEmbedsError) else ShmEmbedsError(str(e))
            continue
        count_many({Event.HOP2_SHM_TENSORS: 1, Event.HOP2_SHM_BYTES: form.nbytes})
        n += 1
    if placeholders:
        count(Event.HOP2_PLACEHOLDER_TENSORS, placeholders)
    if first is not None:
        raise first
    return n


def internalize(handle: SharedTensorHandle, reader_index: int | None = None) -> torch.Tensor:
    """The tensor a hop-2 handle names, mapped read-only. Raises ShmEmbedsError."""
    return open_tensor(handle, reader_index)


# The tag of our messages on vLLM's PP ``cpu_group`` (vLLM's own point-to-point
# sends there use tag 0: ``GroupCoordinator.send_object``, 0.32).
STAGE_TAG = 0x53484D45


class StageChain:
    """Carries each embeds step's outcome down the pipeline stages; every rank calls
    :meth:`agree` once per embeds step, in the same order. ``pp``: vLLM's PP
    ``GroupCoordinator`` (``vllm/distributed/parallel_state.py`` 0.32/0.33)."""

    def __init__(self) -> None:
        self._sent: collections.deque = collections.deque()  # (work, tensor)

    def agree(self, ok: bool, pp: Any) -> bool:
        """True if this stage's ranks and every earlier stage's say ``ok``."""
        import torch.distributed as dist

        if pp.world_size <= 1:
            return ok
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
        if not pp.is_first_rank:
            upstream = torch.zeros(1, dtype=torch.int32)
            dist.recv(upstream, src=pp.prev_rank, group=pp.cpu_group, tag=STAGE_TAG)
            flag = torch.maximum(flag, upstream)
        if not pp.is_last_rank:
            while self._sent and self._sent[0][0].is_completed():
                self._sent.popleft()
            self._sent.append((dist.isend(flag, dst=pp.next_rank, group=pp.cpu_group,
                                          tag=STAGE_TAG), flag))
        return int(flag.item()) == 0


def all_ranks_ok(ok: bool, groups: Iterable[Any]) -> bool:
    """True if every rank of every ``GroupCoordinator`` says ``ok`` (all call in order)."""
    import torch.distributed as dist

    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    for group in groups:
        if group.world_size > 1:
            dist.all_reduce(flag, group=group.cpu_group)
    return int(flag.item()) == 0
