# SPDX-License-Identifier: Apache-2.0
"""Held files at hop 1. The sender (:func:`share`) writes a header-only segment (hop 2's
reader flags) and names a holder's memfd by ``(pid, fd, inode)``; the EngineCore
(:func:`adopt`) renames the header, opens the memfd through ``/proc/<pid>/fd/<fd>`` and
owns both as one segment (``Kind.HELD_FILE``, ``split == (0,)``), kept open for hop 2.
Holders are ``process.current().holders`` that answer ``find`` and ``is_held``.
May import: the core.
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
import stat
from typing import Any

import torch

from vllm._shm_embeds.config import shm_dir
from vllm._shm_embeds.counters import Event, count, count_many, count_reason
from vllm._shm_embeds.ext.held.events import HeldEvent
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.handle import (SegmentName, SharedTensorHandle, ShmEmbedsError,
                                     dtype_name)
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.lifetime.lifecycle import Kind
from vllm._shm_embeds.procfs import pid_namespace

KEY = "held"  # in the hop-1 metadata: ``[pid, fd, inode]``


def held_by(tensor: Any) -> tuple[int, int, int] | None:
    """``(pid, fd, inode)`` of a holder's memfd that is exactly ``tensor``, or None."""
    return next((found for holder in process.current().holders
                 if (found := holder.find(tensor)) is not None), None)


def is_held(tensor: Any) -> bool:
    return any(holder.is_held(tensor) for holder in process.current().holders)


def share(tensor: torch.Tensor) -> tuple[SharedTensorHandle, dict] | None:
    """Hop 1 sender: for a tensor a holder maps, the header segment's handle (removed by
    the caller if the message is not sent) and the metadata to send; else None.
    Raises OSError (nothing is left behind)."""
    holder = held_by(tensor) if tensor.nbytes else None
    if holder is None:
        return None
    header = SharedTensorHandle(process.current().new_name(), "uint8", (0,))
    for fd in seg.write_segment(shm_dir(), header, memoryview(b""), None):
        os.close(fd)
    count_many({Event.SEGMENTS_CREATED: 1, HeldEvent.HOP1_REGION_TENSORS: 1,
                HeldEvent.HOP1_REGION_BYTES: tensor.nbytes})
    return header, {"name": header.name, "dtype": dtype_name(tensor.dtype),
                    "shape": list(tensor.shape), KEY: list(holder)}


def from_meta(meta: Any) -> tuple[SharedTensorHandle, tuple[int, int, int]]:
    """The segment :func:`share`'s metadata names (file 1 the memfd) and the memfd's
    ``(pid, fd, inode)``. Raises ShmEmbedsError (only) on malformed input."""
    try:
        held = meta[KEY]
        handle = SharedTensorHandle.from_meta({k: meta[k] for k in ("name", "dtype", "shape")})
        if not (isinstance(held, (list, tuple)) and len(held) == 3 and handle.nbytes
                and all(type(x) is int and x > 0 for x in held)):
            raise ValueError("held")
    except (KeyError, TypeError, ValueError) as e:
        raise ShmEmbedsError(f"malformed shm-embeds held file {reprlib.repr(meta)}") from e
    parsed = SegmentName.parse(handle.name)
    if held[0] != parsed.pid or parsed.pidns != pid_namespace():
        # the memfd is opened through the fd of the process that named the header
        raise ShmEmbedsError(f"malformed shm-embeds held file {reprlib.repr(held)}")
    return dataclasses.replace(handle, split=(0,)), tuple(held)


def open_memfd(pid: int, fd: int, inode: int, nbytes: int) -> int:
    """Open a holder's memfd read-only via ``/proc/<pid>/fd/<fd>``: only a memfd of that
    inode and at least ``nbytes`` (a kept conversation grows its file). Raises
    ShmEmbedsError."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(path).startswith("/memfd:"):
            raise ShmEmbedsError("the held file is gone (descriptor reused)")
        fd2 = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise ShmEmbedsError("the held file is gone") from e
    try:
        st = os.fstat(fd2)
    except OSError as e:
        os.close(fd2)
        raise ShmEmbedsError("the held file is gone") from e
    if not stat.S_ISREG(st.st_mode) or st.st_ino != inode or st.st_size < nbytes:
        os.close(fd2)
        raise ShmEmbedsError("the held file is gone (descriptor reused)")
    return fd2


def adopt(handle: SharedTensorHandle, held: tuple[int, int, int]) -> torch.Tensor:
    """EngineCore: take the header (renamed), open the memfd, map both; over
    ``config.MAX_SEGMENTS``, read the memfd into memory. Raises ShmEmbedsError (the
    header is removed). Returns a ``handle.dtype`` tensor of ``handle.shape``."""
    directory = shm_dir()
    mine = transfer.take_over(handle, 1)  # a header file of ours, whichever way it goes
    try:
        process.current().check_segments()
    except seg.TooManySegments:
        count_reason(Event.FALLBACK, "segments", hop="1")
        try:
            return _read(held, handle)
        finally:
            seg.unlink_segment(directory, mine.name, 1)
    fds: list[int] = []
    try:
        fds.append(os.open(os.path.join(directory, mine.name),
                           os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW))
        fds.append(open_memfd(*held, handle.nbytes))
        mm = seg.map_segment(directory, mine, fds=fds)
    except BaseException as e:
        for fd in fds:
            os.close(fd)
        seg.unlink_segment(directory, mine.name, 1)
        if isinstance(e, OSError):
            raise ShmEmbedsError(f"shm-embeds held file could not be mapped: {e}") from e
        raise
    tensor, anchor = seg.tensor_view(mm, mine)
    process.current().owned.own(Kind.HELD_FILE, mine, mm, tensor, anchor, fds=fds)
    count(HeldEvent.HOP1_REGION_ADOPTED)
    return tensor


def _read(held: tuple[int, int, int], handle: SharedTensorHandle) -> torch.Tensor:
    """The memfd's first ``handle.nbytes`` bytes, copied. Raises ShmEmbedsError."""
    fd = open_memfd(*held, handle.nbytes)
    try:
        out = torch.empty(handle.shape, dtype=handle.torch_dtype)
        dst = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        seg.pread_all(fd, dst, 0)
    except OSError as e:
        raise ShmEmbedsError(f"shm-embeds held file could not be read: {e}") from e
    finally:
        os.close(fd)
    count(Event.COPIED_BYTES, handle.nbytes)
    return out
