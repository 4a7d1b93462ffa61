# SPDX-License-Identifier: Apache-2.0
"""Streamed segments: a request body written into a segment as it arrives
(:class:`StreamedFile`: the file I/O; :class:`StreamedSegment`: its name, books and
budget). The core's books own it once filled: ``transfer.hand_over`` sends it at hop 1
without a copy, ``transfer.release_streamed`` ends it.

May import: the core."""

from __future__ import annotations

import mmap
import os

import torch

from vllm._shm_embeds.config import shm_dir
from vllm._shm_embeds.counters import Event, count
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.files.segment import (HEADER, map_files, pread_all, pwrite_all,
                                             unlink_quietly)
from vllm._shm_embeds.handle import HEADER_BYTES, SharedTensorHandle, ShmEmbedsError, dtype_name
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.lifetime.lifecycle import Kind


class StreamedFile:
    """A one-file segment created at its final size and filled in order by ``pwrite``
    (ENOSPC is an OSError, never a SIGBUS). Raises OSError (nothing is left)."""

    def __init__(self, directory: str, handle: SharedTensorHandle) -> None:
        self.handle = handle
        self.nbytes = handle.nbytes
        self.filled = 0
        self.reserved = 0  # bytes the budget granted so far
        self._path = os.path.join(directory, handle.name)
        self._fd: int | None = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            pwrite_all(self._fd, memoryview(HEADER), 0)
            os.ftruncate(self._fd, HEADER_BYTES + self.nbytes)
        except BaseException:
            self.abort()
            raise

    @property
    def open(self) -> bool:
        return self._fd is not None

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data``. Raises ShmEmbedsError (finished or aborted), ValueError (too
        many bytes), OSError (e.g. ENOSPC)."""
        if self._fd is None:
            raise ShmEmbedsError("segment already finished or aborted")
        if self.filled + len(data) > self.nbytes:
            raise ValueError("more bytes than the segment holds")
        pwrite_all(self._fd, memoryview(data), HEADER_BYTES + self.filled)
        self.filled += len(data)

    def allocate(self) -> None:
        """Allocate every page now (a full tmpfs: OSError here, not SIGBUS on a write
        through a mapping). Raises ShmEmbedsError (closed), OSError."""
        if self._fd is None:
            raise ShmEmbedsError("segment already finished or aborted")
        os.posix_fallocate(self._fd, 0, HEADER_BYTES + self.nbytes)

    def assume_filled(self) -> None:
        """The caller fills it through the mapping."""
        self.filled = self.nbytes

    def finish(self, writable: bool) -> mmap.mmap:
        """Map the filled file and close it. Raises ShmEmbedsError (closed or not filled),
        OSError."""
        if self._fd is None or self.filled != self.nbytes:
            raise ShmEmbedsError(f"segment holds {self.filled} of {self.nbytes} bytes")
        mm = map_files([self._fd], [HEADER_BYTES + self.nbytes],
                       mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        os.close(self._fd)
        self._fd = None
        return mm

    def read_back(self, out: memoryview) -> None:
        """Copy the bytes written so far into ``out``. Raises ShmEmbedsError, OSError."""
        if self._fd is None:
            raise ShmEmbedsError("segment already finished or aborted")
        pread_all(self._fd, out[:self.filled], HEADER_BYTES)

    def abort(self) -> bool:
        """Close and unlink (idempotent); True if this call unlinked the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        return unlink_quietly(self._path)


STREAM_GRANT_BYTES = 64 << 20  # budget a body still arriving holds beyond what it wrote


class StreamedSegment:
    """A segment of ``shape`` (e.g. ``(num_tokens, hidden_size)``) and ``dtype`` (validated
    by the caller) written chunk by chunk. The whole must fit the budget at creation; it
    is charged by what it wrote plus a grant of up to :data:`STREAM_GRANT_BYTES` ahead.
    Raises ``segment.BudgetExceeded``, OSError."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        state = process.current()
        handle = SharedTensorHandle(state.new_name(), dtype_name(dtype), tuple(shape))
        transfer.check_budget(handle.nbytes)
        self._file = StreamedFile(shm_dir(), handle)
        self._file.reserved = min(handle.nbytes, STREAM_GRANT_BYTES)
        self.handle = handle
        self.nbytes = handle.nbytes
        state.owned.stream_started(self._file)
        count(Event.SEGMENTS_CREATED)

    @property
    def filled(self) -> int:
        return self._file.filled

    def write(self, data: bytes | memoryview) -> None:
        """:meth:`StreamedFile.write`; raises ``segment.BudgetExceeded`` if the next grant
        does not fit (nothing written)."""
        f = self._file
        end = f.filled + len(data)
        if end > f.reserved and f.open:
            grant = min(f.nbytes, max(end, f.reserved + STREAM_GRANT_BYTES)) - f.reserved
            transfer.check_budget(grant)
            f.reserved += grant
        f.write(data)
        process.current().census(shm_dir()).wrote(len(data))

    def read_back(self, out: memoryview) -> None:
        self._file.read_back(out)

    def finish(self, writable: bool = True) -> torch.Tensor:
        """The segment-backed tensor (read-only unless ``writable``). Raises ShmEmbedsError
        if not every byte was written (the segment is removed)."""
        try:
            mm = self._file.finish(writable)
        except BaseException:
            self.abort()
            raise
        process.current().owned.stream_ended(self._file)
        count(Event.COPIED_BYTES, self.nbytes)
        tensor, anchor = seg.tensor_view(mm, self.handle)
        state = process.current()
        state.owned.own(Kind.STREAMED, self.handle, mm, tensor, anchor)
        state.start_reaper()  # unlinks it soon if its storage dies unsent
        return tensor

    def abort(self) -> None:
        """Close and unlink (idempotent); counts the bytes written so far as copied."""
        if self._file.open and self._file.filled:
            count(Event.COPIED_BYTES, self._file.filled)
        process.current().owned.stream_ended(self._file)
        if self._file.abort():
            count(Event.SEGMENTS_UNLINKED)


def streamed_tensor_like(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A new writable streamed segment's tensor for the caller to fill. Raises OSError."""
    streamed = StreamedSegment(dtype, shape)
    streamed._file.assume_filled()  # filled by the caller through the mapping
    return streamed.finish()
