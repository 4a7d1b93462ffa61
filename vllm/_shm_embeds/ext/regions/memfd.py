# SPDX-License-Identifier: Apache-2.0
"""A producer's region file: what a registered memfd must be, and this
process's read-only mapping of it.

:func:`check_sealed` touches nothing a file system could block on (``fstat``
is GETATTR on FUSE) before the fd is known to be a memfd; :func:`map_readonly`
keeps no duplicate fd; :func:`unmap` drops the pages instead when a tensor
over the mapping is still alive. Raises :class:`RegionError`, the error of
every region operation (its ``reason`` labels ``region_refused``).

Knows files and tensors, not sockets, not vLLM, not HTTP.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import warnings

import torch
from vllm.logger import init_logger

from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.files.sockets import is_memfd

logger = init_logger(__name__)

REQUIRED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
NOT_MEMFD = "the file descriptor is not a memfd (os.memfd_create with MFD_ALLOW_SEALING)"


class RegionError(ValueError):
    """A refused registration, unregistration or region reference: a
    client-safe message (no path, no fd, no internal name); ``reason`` is its
    counter label (e.g. ``seals``, ``size``)."""

    def __init__(self, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


def check_sealed(fd: int, nbytes: int) -> int:
    """The inode of ``fd`` if it is a sealed memfd of ``nbytes`` bytes,
    written in full; else RegionError. Nothing a file system could block
    (``fstat`` is GETATTR on FUSE) before it is known to be a memfd."""
    try:
        if not is_memfd(fd):
            raise OSError
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)  # without MFD_ALLOW_SEALING: F_SEAL_SEAL
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError
    except OSError as e:
        raise RegionError(NOT_MEMFD, "not_memfd") from e
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise RegionError("the memfd must be sealed with F_SEAL_WRITE, F_SEAL_SHRINK, "
                          f"F_SEAL_GROW and F_SEAL_SEAL (it has seals {seals:#x}, needs "
                          f"{REQUIRED_SEALS:#x})", "seals")
    if st.st_size != nbytes:
        raise RegionError(f"the memfd holds {st.st_size} bytes; datatype and shape need "
                          f"{nbytes}", "size")
    if st.st_blocks * 512 < st.st_size:  # hashing it would allocate the holes here
        raise RegionError("the memfd must be written in full before it is sealed (it has "
                          "holes)", "sparse")
    return st.st_ino


def map_readonly(fd: int, dtype: torch.dtype,
                 shape: tuple[int, int]) -> tuple[mmap.mmap, torch.Tensor]:
    """Read-only shared mapping of ``fd`` (no dup kept) and the tensor over it."""
    mm = seg.map_files([fd], [shape[0] * shape[1] * dtype.itemsize], mmap.PROT_READ)
    with warnings.catch_warnings():  # mapped read-only on purpose; torch warns about that
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensor = torch.frombuffer(memoryview(mm), dtype=dtype, count=shape[0] * shape[1])
    return mm, tensor.view(shape)


def unmap(mm: mmap.mmap) -> None:
    """Unmap ``mm``; if a tensor over it is still alive, drop its pages instead
    (the tensor then reads zeros; the range goes with the last tensor)."""
    try:
        mm.close()
    except BufferError:
        try:
            seg.drop_pages(mm)
        except OSError as e:  # the file's pages then stay until the tensor dies
            logger.warning("shm-embeds: dropping a region's pages failed: %s", e)
