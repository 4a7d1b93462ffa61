# SPDX-License-Identifier: Apache-2.0
"""A segment written from a byte stream (a request body): :class:`StreamedFile`.

File I/O only, as ``segment.py`` (whose helpers it uses): no vLLM, no HTTP,
no ownership (``transfer.StreamedSegment`` adds that).
"""

from __future__ import annotations

import errno
import mmap
import os

from vllm._shm_embeds.handle import HEADER_BYTES, SharedTensorHandle, ShmEmbedsError
from vllm._shm_embeds.segment import HEADER, map_files, pwrite_all, unlink_quietly


class StreamedFile:
    """A one-file segment created empty at its final size and filled in order.

    ``ftruncate`` first (no memory is used until bytes arrive), then
    :meth:`write` appends with ``pwrite`` (one kernel copy from the caller's
    buffer into the tmpfs pages; ENOSPC is an ``OSError``, never a SIGBUS).
    :meth:`finish` maps it; :meth:`abort` closes and unlinks it.

    Args:
        directory: the segment directory.
        handle: name, dtype and shape of the segment (one file, no split).
    Raises:
        OSError: the file could not be created or sized (nothing is left).
    """

    def __init__(self, directory: str, handle: SharedTensorHandle) -> None:
        self.handle = handle
        self.nbytes = handle.nbytes
        self.filled = 0
        # Bytes the segment budget granted this file so far (its owner,
        # ``transfer.StreamedSegment``, renews it as the file fills).
        self.reserved = 0
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
        """Append ``data`` (at most the bytes still missing).

        Raises:
            ShmEmbedsError: already finished or aborted.
            ValueError: more bytes than the segment holds.
            OSError: e.g. ENOSPC (the caller aborts).
        """
        if self._fd is None:
            raise ShmEmbedsError("segment already finished or aborted")
        if self.filled + len(data) > self.nbytes:
            raise ValueError("more bytes than the segment holds")
        pwrite_all(self._fd, memoryview(data), HEADER_BYTES + self.filled)
        self.filled += len(data)

    def assume_filled(self) -> None:
        """Take the file as filled (the caller writes it through the mapping)."""
        self.filled = self.nbytes

    def finish(self, writable: bool) -> mmap.mmap:
        """Map the filled file and close it; the file stays linked.

        Raises:
            ShmEmbedsError: already closed, or not every byte was written.
            OSError: the mapping failed.
            On an error the file stays as it was: the caller aborts.
        """
        if self._fd is None or self.filled != self.nbytes:
            raise ShmEmbedsError(f"segment holds {self.filled} of {self.nbytes} bytes")
        mm = map_files([self._fd], [HEADER_BYTES + self.nbytes],
                       mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        os.close(self._fd)
        self._fd = None
        return mm

    def read_back(self, out: memoryview) -> None:
        """Copy the bytes written so far into ``out`` (at least :attr:`filled` bytes).

        Raises:
            ShmEmbedsError: already finished or aborted; OSError: the read failed.
        """
        if self._fd is None:
            raise ShmEmbedsError("segment already finished or aborted")
        done = 0
        while done < self.filled:
            n = os.preadv(self._fd, [out[done:self.filled]], HEADER_BYTES + done)
            if n <= 0:
                raise OSError(errno.EIO, "short read of a streamed segment")
            done += n

    def abort(self) -> bool:
        """Close and unlink (idempotent); True if this call unlinked the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        return unlink_quietly(self._path)
