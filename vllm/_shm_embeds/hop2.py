# SPDX-License-Identifier: Apache-2.0
"""Hop 2, EngineCore -> every TP worker: handles instead of tensors in the broadcast.

Around the ``SchedulerOutput`` broadcast (``sites/multiproc_executor.py``),
:func:`externalize_prompt_embeds` swaps each eligible
``NewRequestData.prompt_embeds`` for a :class:`SharedTensorHandle` while the
message is enqueued (:func:`restore_prompt_embeds` puts the tensors back);
each worker maps them again with :func:`internalize_prompt_embeds` before
its model runner sees the step. :func:`externalize` sends a tensor that
already lives in a segment this process owns (adopted at hop 1) without a
copy; any other tensor is copied once. Each broadcast gets reader flags of
its own and the owner holds the files open until every reader of it has
mapped them (readers open them through ``/proc/<owner>/fd``).
:func:`all_ranks_ok` makes every rank end a step the same way when one
rank could not map.

Works on any objects with a ``prompt_embeds`` attribute; knows nothing of
vLLM's classes or of HTTP.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from typing import Any

import torch
from vllm.logger import init_logger

from vllm._shm_embeds import process
from vllm._shm_embeds import segment as seg
from vllm._shm_embeds.config import shm_dir
from vllm._shm_embeds.counters import Event, count, count_many, count_reason
from vllm._shm_embeds.handle import HEADER_BYTES, MAX_READERS, SharedTensorHandle, ShmEmbedsError
from vllm._shm_embeds.lifecycle import Kind
from vllm._shm_embeds.transfer import create_segment, dense_nbytes, eligible, open_tensor

logger = init_logger(__name__)


def externalize(tensor: torch.Tensor, readers: int) -> SharedTensorHandle:
    """Handle for ``tensor`` to broadcast to ``readers`` local readers (hop 2).

    A tensor that already lives in a segment this process owns (adopted at
    hop 1, or sent before and still linked) is sent without a copy; any other
    tensor is copied once into a new segment. This broadcast gets reader
    flags of its own, and the name is unlinked once all its readers (and
    those of any other pending broadcast of it) have mapped it and the
    request is done with ``tensor`` (``owned.OwnedSegments.collect``,
    ``transfer.release_adopted``).

    Raises:
        OSError: a new segment could not be created; the caller keeps the
            stock path.
        ValueError: ``readers`` exceeds :data:`MAX_READERS`.
    """
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
        # (no dup of the fd, unlike mmap.mmap(fd): the fds close once the
        # broadcasts settle, while the request keeps the name)
        mm = seg.map_files(fds[:1], [HEADER_BYTES], mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        for fd in fds:
            os.close(fd)
        seg.unlink_segment(shm_dir(), new.name, len(new.parts()))
        raise
    owned.own(Kind.COPY, new, mm, tensor, fds=fds)
    entry = owned.lookup(tensor)
    assert entry is not None
    handle = owned.broadcast(entry, readers)
    assert handle is not None
    return handle



def externalize_prompt_embeds(
    new_reqs: Iterable[Any], readers: int
) -> list[tuple[Any, torch.Tensor]]:
    """Swap each eligible ``prompt_embeds`` tensor on ``new_reqs`` for a handle.

    ``new_reqs`` are objects with a ``prompt_embeds`` attribute (vLLM's
    ``NewRequestData`` in ``SchedulerOutput.scheduled_new_reqs``). Ineligible
    tensors, or any that cannot be placed in shared memory, stay in place
    (stock path) and are counted as ``hop2_stock_*``.

    Returns:
        ``(obj, tensor)`` pairs to give to :func:`restore_prompt_embeds` once
        the message has been serialized.
    """
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


def restore_prompt_embeds(swapped: list[tuple[Any, torch.Tensor]]) -> None:
    """Put back the tensors that :func:`externalize_prompt_embeds` swapped out."""
    for req, tensor in swapped:
        req.prompt_embeds = tensor


def internalize_prompt_embeds(new_reqs: Iterable[Any], reader_index: int | None) -> int:
    """Replace each ``SharedTensorHandle`` in ``new_reqs[i].prompt_embeds`` by its tensor.

    Runs in each TP worker before the model runner sees the step. Every
    handle is tried; returns the number of tensors mapped.

    Raises:
        ShmEmbedsError: a segment could not be mapped (the first error);
            the other handles were still mapped and flagged, so the owner's
            bookkeeping stays consistent.
    """
    n = 0
    first: ShmEmbedsError | None = None
    for req in new_reqs:
        handle = getattr(req, "prompt_embeds", None)
        if isinstance(handle, SharedTensorHandle):
            try:
                req.prompt_embeds = open_tensor(handle, reader_index)
            except (ShmEmbedsError, OSError) as e:
                count_reason(Event.FALLBACK, "map_failed", hop="2")
                if first is None:
                    first = e if isinstance(e, ShmEmbedsError) else ShmEmbedsError(str(e))
                continue
            count_many({Event.HOP2_SHM_TENSORS: 1, Event.HOP2_SHM_BYTES: handle.nbytes})
            n += 1
    if first is not None:
        raise first
    return n



def internalize(handle: SharedTensorHandle, reader_index: int | None = None) -> torch.Tensor:
    """The tensor a hop-2 handle names, mapped read-only (no copy); see
    ``transfer.open_tensor``. Raises ShmEmbedsError."""
    return open_tensor(handle, reader_index)


def all_ranks_ok(ok: bool, groups: Iterable[Any]) -> bool:
    """True if every rank of every group in ``groups`` says ``ok``.

    One ``all_reduce`` of a flag per group (vLLM's ``GroupCoordinator``
    objects: ``world_size`` and ``cpu_group``, ``vllm/distributed/
    parallel_state.py`` 0.32/0.33); groups of one rank are skipped. Every
    rank must call it in the same order (once per step carrying handles).
    """
    import torch.distributed as dist

    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    for group in groups:
        if group.world_size > 1:
            dist.all_reduce(flag, group=group.cpu_group)
    return int(flag.item()) == 0
