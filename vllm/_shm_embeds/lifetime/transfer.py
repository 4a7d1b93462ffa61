# SPDX-License-Identifier: Apache-2.0
"""Moving tensors into and out of segments: a hop-1 sender copies a tensor into a new
segment (:func:`share_tensor`), the EngineCore renames it to its own name and maps it
(:func:`adopt_tensor`), TP workers map it read-only (:func:`open_tensor`)."""

from __future__ import annotations

import errno
import os
from typing import Any

import torch

from vllm._shm_embeds.config import budget_bytes, min_bytes, shares_dev_shm, shm_dir, writers
from vllm._shm_embeds.counters import Event, count, count_many, count_reason
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.files import segment_dir
from vllm._shm_embeds.handle import (HEADER_BYTES, MAGIC, MAX_READERS, SharedTensorHandle,
                                     ShmEmbedsError, dtype_name, part_name, split_for)
from vllm._shm_embeds.lifetime import process
from vllm._shm_embeds.lifetime.lifecycle import Kind


def eligible(tensor: Any) -> str | None:
    """Why ``tensor`` must keep the stock path (the fallback reason), or None."""
    if not isinstance(tensor, torch.Tensor):
        return "not_a_tensor"
    if tensor.layout != torch.strided:
        return "sparse"
    if tensor.device.type != "cpu":
        return "not_cpu"
    if not tensor.is_contiguous():
        return "non_contiguous"
    if tensor.is_quantized:
        return "quantized"
    if tensor.nbytes < min_bytes():
        return "small"
    return None


def check_budget(nbytes: int) -> None:
    """Raise ``segment.BudgetExceeded`` if ``nbytes`` more would take our segments (and
    the grants of bodies still streaming) over ``config.budget_bytes()``."""
    budget = budget_bytes()
    directory = shm_dir()
    held = process.current().census(directory).held()  # never a walk on the caller's thread
    if not shares_dev_shm():
        held = max(held, segment_dir.used_bytes(directory))
    held += process.current().owned.pending_stream_bytes()
    if held + nbytes > budget:
        raise seg.BudgetExceeded(nbytes, held, budget)


def create_segment(tensor: torch.Tensor) -> tuple[SharedTensorHandle, list[int]]:
    """Copy ``tensor`` into a new segment: its handle and open fds (the caller closes
    them). Raises OSError (nothing is left behind)."""
    check_budget(tensor.nbytes)
    state = process.current()
    handle = SharedTensorHandle(
        state.new_name(),
        dtype_name(tensor.dtype),
        tuple(tensor.shape),
        split_for(tensor.nbytes, writers()),
    )
    data = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
    pool = state.writer_pool() if handle.split else None
    fds = seg.write_segment(shm_dir(), handle, data, pool)
    state.census(shm_dir()).wrote(tensor.nbytes)
    count_many({Event.SEGMENTS_CREATED: 1, Event.COPIED_BYTES: tensor.nbytes})
    return handle, fds


def share_tensor(tensor: torch.Tensor) -> SharedTensorHandle:
    """Hop 1 sender: copy ``tensor`` into a new segment, untracked here (the peer adopts
    it). Raises OSError (e.g. ENOSPC)."""
    handle, fds = create_segment(tensor)
    for fd in fds:
        os.close(fd)
    return handle


def discard_shared(handle: SharedTensorHandle) -> bool:
    """Remove a segment that will never be adopted. True if it was still there."""
    gone = seg.unlink_segment(shm_dir(), handle.name, len(handle.parts()))
    if gone:
        count(Event.SEGMENTS_UNLINKED)
    return gone


ADOPT_NAME_TRIES = 8  # names tried when something sits at the one drawn


def adopt_tensor(handle: SharedTensorHandle) -> torch.Tensor:
    """Take ownership of a peer's segment (renamed to a fresh name of ours) and map it,
    no copy; over ``config.MAX_SEGMENTS`` or if mapping fails, read it into memory.
    Raises ShmEmbedsError: missing segment, wrong size or header, not a regular file
    of ours, or any OSError (the peer's files are removed). Returns a ``handle.dtype``
    tensor of ``handle.shape``."""
    state = process.current()
    nparts = len(handle.parts())
    directory = shm_dir()
    try:
        state.check_segments()
    except seg.TooManySegments:
        count_reason(Event.FALLBACK, "segments", hop="1")
        return _adopt_by_copy(handle)
    mine = take_over(handle, nparts)
    try:
        mm = seg.map_segment(directory, mine)
    except OSError:  # e.g. ENOMEM at vm.max_map_count: read it instead
        count_reason(Event.FALLBACK, "map_failed", hop="1")
        return _adopt_by_copy(mine)
    except BaseException:
        seg.unlink_segment(directory, mine.name, nparts)
        raise
    tensor, anchor = seg.tensor_view(mm, mine)
    state.owned.own(Kind.ADOPTED, mine, mm, tensor, anchor)
    return tensor


def take_over(handle: SharedTensorHandle, nparts: int) -> SharedTensorHandle:
    """Rename a peer's first ``nparts`` files to a fresh name of ours: ``handle`` under it.
    Raises ShmEmbedsError (the peer's files and those taken are removed)."""
    directory = shm_dir()
    mine = handle.renamed(process.current().new_name(capped=False))
    for i in range(nparts):
        try:
            mine = _rename_part(directory, handle, mine, i)
        except BaseException as e:
            for j in range(i):  # the parts already taken (never what sits at a name)
                seg.unlink_quietly(os.path.join(directory, part_name(mine.name, j)))
            unlink_peer(handle.name, nparts)
            if isinstance(e, FileNotFoundError):
                raise ShmEmbedsError(f"shm-embeds segment {part_name(handle.name, i)!r} not "
                                     f"found in {directory}: the sender is on another host, "
                                     "or something removed it") from e
            if isinstance(e, OSError):
                raise ShmEmbedsError(f"shm-embeds segment could not be adopted: {e}") from e
            raise
    return mine


def _rename_part(directory: str, handle: SharedTensorHandle, mine: SharedTensorHandle,
                 i: int) -> SharedTensorHandle:
    """Rename part ``i`` of the peer's segment to ``mine``'s (part 0: drawing another name
    while something sits there); the handle under the name used. Raises OSError."""
    src = os.path.join(directory, part_name(handle.name, i))
    st = os.lstat(src)  # the peer's file: a regular file of our user, never a link
    if not segment_dir.our_file(st):
        raise OSError(errno.EPERM, "not a segment file of this user")
    for _ in range(ADOPT_NAME_TRIES if i == 0 else 1):
        try:
            seg.rename_noreplace(src, os.path.join(directory, part_name(mine.name, i)))
            return mine
        except FileExistsError:
            if i:
                raise
            count(Event.ADOPT_NAMES_TAKEN)
            mine = handle.renamed(process.current().new_name(capped=False))
    raise FileExistsError(errno.EEXIST, "every segment name drawn was taken")


def unlink_peer(name: str, nparts: int) -> None:
    """Remove a peer's segment that cannot be adopted (only our files); never raises."""
    for i in range(nparts):
        try:
            path = os.path.join(shm_dir(), part_name(name, i))
            if segment_dir.our_file(os.lstat(path)):
                seg.unlink_quietly(path)
        except OSError:
            pass


def _adopt_by_copy(handle: SharedTensorHandle) -> torch.Tensor:
    """Read a peer's segment into memory and remove its files. Raises ShmEmbedsError
    (the files go either way)."""
    parts = handle.parts()
    try:
        out = torch.empty(handle.shape, dtype=handle.torch_dtype)
        dst = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        for i, (part, start, length) in enumerate(parts):
            fd = os.open(os.path.join(shm_dir(), part),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                skip = HEADER_BYTES if i == 0 else 0  # part 0's data follows its header
                st = os.fstat(fd)
                if not segment_dir.our_file(st) or st.st_size != length + skip:
                    raise ShmEmbedsError("shm-embeds segment has the wrong size or owner")
                if i == 0 and os.pread(fd, len(MAGIC), 0) != MAGIC:
                    raise ShmEmbedsError("shm-embeds segment has no header")
                seg.pread_all(fd, dst[start:start + length], skip)
            finally:
                os.close(fd)
    except OSError as e:
        raise ShmEmbedsError(f"shm-embeds segment could not be read: {e}") from e
    finally:
        unlink_peer(handle.name, len(parts))
    count(Event.COPIED_BYTES, handle.nbytes)
    return out


def open_tensor(handle: SharedTensorHandle, reader_index: int | None = None) -> torch.Tensor:
    """Reader side: map a segment read-only (no copy), setting the flag of ``reader_index``
    (0-based; None: none). Raises ShmEmbedsError: missing segment, wrong size or header,
    bad index."""
    if reader_index is not None and not 0 <= handle.flag_base + reader_index < MAX_READERS:
        raise ShmEmbedsError(f"reader index {reader_index} out of range")
    mm = seg.map_segment(shm_dir(), handle, reader_index)
    return seg.tensor_view(mm, handle)[0]


def dense_nbytes(tensor: Any) -> int:
    """Dense size in bytes (also defined for sparse tensors, unlike ``nbytes``)."""
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def send_view(tensor: Any) -> Any:
    """A view of ``tensor`` with its own storage (``OwnedSegments.send_view``) if a mapping
    of ours or a holder's holds it; else ``tensor`` itself."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    state = process.current()
    view = state.owned.send_view(tensor)
    for holder in state.holders if view is None else ():  # a held file's (API server)
        if (view := holder.send_view(tensor)) is not None:
            break
    return tensor if view is None else view


def is_streamed(tensor: Any) -> bool:
    """True if ``tensor`` is exactly a streamed segment not yet handed over."""
    return isinstance(tensor, torch.Tensor) and process.current().owned.is_streamed(tensor)


def hand_over(tensor: Any) -> SharedTensorHandle | None:
    """Hop 1 sender, no copy: the handle of the streamed segment that is exactly ``tensor``
    (the peer adopts it), else None."""
    if not isinstance(tensor, torch.Tensor):
        return None
    handle = process.current().owned.hand_over(tensor)
    if handle is not None:
        count(Event.HOP1_HANDOVER_TENSORS)
    return handle


def release_streamed(tensor: Any) -> bool:
    """``tensor``'s request ended (``OwnedSegments.release_streamed``, or a holder's
    ``release``). True if it was one of ours (its pages dropped: later reads see zeros)."""
    if not isinstance(tensor, torch.Tensor):
        return False
    state = process.current()
    return state.owned.release_streamed(tensor) or any(
        getattr(holder, "release", None) is not None and holder.release(tensor)
        for holder in state.holders)


def release_adopted(tensor: Any) -> bool:
    """EngineCore: vLLM freed the request whose ``prompt_embeds`` is ``tensor``
    (``OwnedSegments.release_adopted``). True if pages were dropped now (later
    reads of ``tensor`` see zeros)."""
    if not (isinstance(tensor, torch.Tensor) and process.current().owned.release_adopted(tensor)):
        return False
    count(Event.ENGINE_PAGES_RELEASED)
    return True
