# SPDX-License-Identifier: Apache-2.0
"""Kept rows in memfds that grow in place: a conversation's tip is never copied.

A :class:`Tip` is an anonymous memfd of ``(rows, hidden)`` rows of one dtype that
is only ever appended to: rows once claimed (``store.Store.claim``) are written
once and never change, so every request and kept id over its first rows reads
fixed bytes while a later turn appends. A request's tensor over a tip is handed
to hop 1 as a held file (:class:`Tips`, one of ``process.current().holders``):
the EngineCore opens the memfd through this process's descriptor, no copy.
A memfd has no name: nothing to sweep, gone with the process.
May import: the core.
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
from typing import Any

import torch
from vllm.logger import init_logger

from vllm._shm_embeds.files.segment import drop_pages, map_files, pread_all, pwrite_all
from vllm._shm_embeds.lifetime import process

logger = init_logger(__name__)


class Tip:
    """One memfd of rows of ``dtype`` and ``hidden`` columns. ``rows`` (claimed),
    ``refs`` and ``charged`` are the store's books (its lock). Raises OSError."""

    remote: Any = None  # a sibling's tip (``remote.Remote``): its books are the sibling's

    def __init__(self, dtype: torch.dtype, hidden: int, fd: int | None = None) -> None:
        """A new memfd, or ``fd`` (owned from here: a sibling's tip, received)."""
        self.dtype, self.hidden = dtype, hidden
        self.row_bytes = hidden * dtype.itemsize
        self.fd: int | None = (os.memfd_create("shm-embeds-kept", os.MFD_CLOEXEC)
                               if fd is None else fd)
        self.inode = os.fstat(self.fd).st_ino
        self.rows = 0
        self.refs = 0
        self.charged = 0
        self._size_lock = threading.Lock()

    def ensure(self, rows: int) -> None:
        """Make the file hold at least ``rows`` rows. ``fallocate``, never ``ftruncate``:
        a sibling API server may grow the same memfd, and the file never shrinks
        under the rows another process claimed. Raises OSError."""
        with self._size_lock:
            size = os.fstat(self.fd).st_size
            if size < rows * self.row_bytes:
                os.posix_fallocate(self.fd, size, rows * self.row_bytes - size)

    def file_bytes(self) -> int:
        """Bytes the file holds (0 once closed, or if it cannot be told)."""
        try:
            return os.fstat(self.fd).st_size if self.fd is not None else 0
        except OSError:
            return 0

    def write(self, data: memoryview, offset: int) -> None:
        """``data`` at byte ``offset`` (rows this caller claimed). Raises OSError."""
        pwrite_all(self.fd, data, offset)

    def read(self, out: memoryview, offset: int = 0) -> None:
        """``len(out)`` bytes from ``offset``. Raises OSError."""
        pread_all(self.fd, out, offset)

    def view(self, rows: int) -> tuple[torch.Tensor, mmap.mmap | None]:
        """The first ``rows`` rows, mapped read-only: ``(tensor (rows, hidden), mm)``.
        Raises OSError."""
        nbytes = rows * self.row_bytes
        if nbytes == 0:
            return torch.empty((rows, self.hidden), dtype=self.dtype), None
        mm = map_files([self.fd], [nbytes], mmap.PROT_READ)  # (no dup of the fd kept)
        with warnings.catch_warnings():  # read-only on purpose: rows never change
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(memoryview(mm), dtype=torch.uint8, count=nbytes)
        return raw.view(self.dtype).view(rows, self.hidden), mm

    def close(self) -> None:
        """Close the memfd (mappings keep their pages until they go). Idempotent."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


class Tips:
    """The request tensors over tips of this API server (a ``process`` holder):
    hop 1 sends each by the tip's descriptor; ``release`` at the request's end."""

    holds = "conversations"

    def __init__(self, let_go: Any) -> None:
        self._let_go = let_go  # (tip) -> None: the store's use ref is dropped
        self._lock = threading.Lock()
        self._live: dict[int, tuple[torch.Tensor, Tip, int, mmap.mmap]] = {}

    def register(self, tip: Tip, rows: int) -> torch.Tensor:
        """A read-only tensor of the first ``rows`` rows of ``tip`` for one request,
        which holds the caller's use of ``tip`` until :meth:`release`. Raises OSError."""
        tensor, mm = tip.view(rows)
        if tensor.numel():
            with self._lock:
                self._live[tensor.data_ptr()] = (tensor, tip, rows, mm)
        return tensor

    def lookup(self, tensor: Any) -> tuple[Tip, int] | None:
        """``(tip, rows)`` if ``tensor`` is exactly a live request tensor here."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return None
        with self._lock:
            found = self._live.get(tensor.data_ptr())
        if (found is None or tensor.dtype != found[0].dtype
                or tensor.shape != found[0].shape or tensor.stride() != found[0].stride()):
            return None
        return found[1], found[2]

    def find(self, tensor: Any) -> tuple[int, int, int] | None:
        """``(pid, fd, inode)`` for hop 1 (``ext/held``), or None."""
        found = self.lookup(tensor)
        if found is None or found[0].fd is None:
            return None
        return os.getpid(), found[0].fd, found[0].inode

    def is_held(self, tensor: Any) -> bool:
        return self.find(tensor) is not None

    def send_view(self, tensor: Any) -> None:
        """None: a tensor sent the stock way keeps its own mapping alive."""
        return None

    def settle(self) -> int:
        return 0

    def release(self, tensor: Any) -> bool:
        """``tensor``'s request ended: its use of the tip ends and its pages here go
        (it reads zeros from now on, as a released segment's). True if it was ours."""
        if not isinstance(tensor, torch.Tensor):
            return False
        with self._lock:
            found = self._live.get(tensor.data_ptr())
            if found is None or found[0] is not tensor:
                return False
            del self._live[tensor.data_ptr()]
        try:
            drop_pages(found[3])
        except OSError:  # the pages stay until the tensor goes; the use ends anyway
            logger.debug("shm-embeds: dropping a kept tensor's pages failed", exc_info=True)
        finally:
            self._let_go(found[1])
        return True

    def __len__(self) -> int:
        return len(self._live)


_tips: Tips | None = None
_tips_lock = threading.Lock()


def holder(let_go: Any) -> Tips:
    """This process's :class:`Tips`, among ``process.current().holders``."""
    global _tips
    state = process.current()
    with _tips_lock:
        if _tips is None or _tips not in state.holders:
            _tips = Tips(let_go)
            state.holders.append(_tips)
        return _tips


def _after_fork_in_child() -> None:
    global _tips, _tips_lock
    _tips, _tips_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
