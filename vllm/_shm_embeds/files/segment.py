# SPDX-License-Identifier: Apache-2.0
"""All file I/O on segments: create, write, map, open, rename, unlink (no state besides
the ``libc`` handle)."""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import mmap
import os
import warnings
from typing import Any

import torch

from vllm._shm_embeds.handle import (HEADER_BYTES, MAGIC, READER_FLAGS_OFFSET,
                                     SharedTensorHandle, ShmEmbedsError, part_name)

# writers check for a peer's failure this often (Linux writes at most 0x7FFFF000 a call)
WRITE_CHUNK_BYTES = 64 << 20


class BudgetExceeded(OSError):
    """ENOSPC: a new segment would exceed ``VLLM_SHM_EMBEDS_MAX_BYTES``."""

    def __init__(self, nbytes: int, held: int, budget: int) -> None:
        super().__init__(errno.ENOSPC, f"{nbytes} more bytes would take shm-embeds' segments "
                         f"({held} bytes now) over their budget of {budget} bytes")


class TooManySegments(OSError):
    """This process owns ``config.MAX_SEGMENTS`` segments already."""

    def __init__(self, limit: int) -> None:
        super().__init__(errno.EMFILE, f"this process holds {limit} shm-embeds segments "
                         "already (the most allowed)")


def fallback_reason(e: OSError) -> str:
    """The counter reason: ``budget``, ``segments``, ``no_space`` or ``os_error``."""
    if isinstance(e, BudgetExceeded):
        return "budget"
    if isinstance(e, TooManySegments):
        return "segments"
    return "no_space" if e.errno == errno.ENOSPC else "os_error"


HEADER = MAGIC.ljust(HEADER_BYTES, b"\0")  # a new segment's first page


_ZEROS = bytes(1 << 20)


def write_zeros(write: Any, nbytes: int) -> None:
    """``write(chunk)`` of ``nbytes`` zero bytes in chunks of at most 1 MiB (a long gap
    never allocates its size)."""
    while nbytes > 0:
        n = min(nbytes, len(_ZEROS))
        write(memoryview(_ZEROS)[:n])
        nbytes -= n


def pwrite_all(fd: int, buf: memoryview, offset: int, failed: list | None = None) -> None:
    """Write all of ``buf`` at ``offset``; raises OSError. ``failed``, shared by one
    segment's writers: an error is appended, and the others stop."""
    done = 0
    try:
        while done < len(buf):
            if failed:
                return
            done += os.pwrite(fd, buf[done : done + WRITE_CHUNK_BYTES], offset + done)
    except BaseException as e:
        if failed is not None:
            failed.append(e)
        raise


def pread_all(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``fd`` at ``offset``. Raises OSError (EIO: the file ends first)."""
    done = 0
    while done < len(buf):
        if (n := os.preadv(fd, [buf[done:]], offset + done)) <= 0:
            raise OSError(errno.EIO, "the file ended before its stated size")
        done += n


def write_segment(directory: str, handle: SharedTensorHandle, data: memoryview,
                  pool: concurrent.futures.Executor | None) -> list[int]:
    """Create the files of ``handle`` and ``pwrite`` header and ``data`` (``handle.nbytes``
    bytes, C-contiguous); files 1.. are written by ``pool``. Returns the open fds (the
    caller closes them). Raises OSError (ENOSPC, never SIGBUS), after removing the files."""
    parts = handle.parts()
    fds: list[int] = []
    futures: list[concurrent.futures.Future] = []
    failed: list[BaseException] = []
    error: BaseException | None = None
    try:
        for part, _, _ in parts:
            path = os.path.join(directory, part)
            fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        pwrite_all(fds[0], memoryview(HEADER), 0)
        jobs = [(fd, data[start : start + length], HEADER_BYTES if i == 0 else 0)
                for i, (fd, (_, start, length)) in enumerate(zip(fds, parts))]
        assert pool is not None or len(jobs) == 1
        for job in jobs[1:]:
            futures.append(pool.submit(pwrite_all, *job, failed))
        if jobs[0][1].nbytes:
            pwrite_all(*jobs[0], failed)
    except BaseException as e:
        error = e
        failed.append(e)
    finally:
        # A closed fd number can be reused at once: a late pwrite would land there.
        concurrent.futures.wait(futures)
    for f in futures:
        if error is None and f.exception() is not None:
            error = f.exception()
    if error is not None:
        for fd in fds:
            os.close(fd)
        unlink_segment(directory, handle.name, len(parts))
        raise error
    return fds


_MAP_FIXED = 0x10  # Linux, every architecture vLLM runs on
_MAP_NORESERVE = 0x4000
_libc: Any = None


def _mmap_fixed(addr: int, length: int, prot: int, flags: int, fd: int) -> None:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
        _libc = libc
    got = _libc.mmap(addr, length, prot, flags | _MAP_FIXED, fd, 0)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a segment failed: {os.strerror(err)}")


def _base(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))  # no export of mm outlives this


def map_files(fds: list[int], sizes: list[int], prot: int | list[int]) -> mmap.mmap:
    """Map files back to back as one mapping (``MAP_FIXED`` over an anonymous reservation),
    ``prot`` one or one per file; all but the last are page multiples. Keeps no dup of an
    fd, so :func:`drop_pages` lets go of the pages."""
    prots = prot if isinstance(prot, list) else [prot] * len(fds)
    mm = mmap.mmap(-1, sum(sizes),
                   flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    try:
        base, offset = _base(mm), 0
        for fd, size, p in zip(fds, sizes, prots):
            _mmap_fixed(base + offset, size, p, mmap.MAP_SHARED, fd)
            offset += size
    except BaseException:
        mm.close()
        raise
    return mm


def drop_pages(mm: mmap.mmap) -> None:
    """Let go of the files' pages: zero pages mapped read-only over ``mm`` (its tensors
    stay valid, reading zeros). Raises OSError."""
    if not mm.closed:
        _mmap_fixed(_base(mm), len(mm), mmap.PROT_READ,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1)


def _open_by_owner_fd(handle: SharedTensorHandle, writable_first: bool) -> list[int] | None:
    """Open the files through ``/proc/<owner_pid>/fd``; None if that is not possible."""
    if not handle.owner_pid or len(handle.owner_files) != len(handle.parts()):
        return None
    fds: list[int] = []
    try:
        for i, (fd, inode) in enumerate(handle.owner_files):
            flags = os.O_RDWR if (i == 0 and writable_first) else os.O_RDONLY
            fds.append(os.open(f"/proc/{handle.owner_pid}/fd/{fd}", flags))
            if os.fstat(fds[-1]).st_ino != inode:
                raise OSError(errno.ESTALE, "owner fd reused")
    except OSError:
        for fd in fds:
            os.close(fd)
        return None
    return fds


def open_files(directory: str, handle: SharedTensorHandle, reader: bool) -> list[int]:
    """Open every file of ``handle``, by the owner's fds if given, else by name (file 0
    read/write). Raises ShmEmbedsError if a file is missing."""
    fds = _open_by_owner_fd(handle, writable_first=True) if reader else None
    if fds is not None:
        return fds
    if handle.unnamed_data:  # never open a data file someone planted at a name
        raise ShmEmbedsError("a segment with unnamed data can be opened only through "
                             "its owner's descriptors, which are gone")
    fds = []
    try:
        for i, (part, _, _) in enumerate(handle.parts()):
            flags = os.O_RDWR if i == 0 or not reader else os.O_RDONLY
            try:
                fds.append(os.open(os.path.join(directory, part), flags))
            except FileNotFoundError as e:
                raise ShmEmbedsError(f"shm-embeds segment {part!r} not found in {directory} "
                                     "(its owner released it, something else removed it, or "
                                     "the process is on another host)") from e
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def map_segment(directory: str, handle: SharedTensorHandle, reader_index: int | None = None,
                fds: list[int] | None = None) -> mmap.mmap:
    """Map a segment after checking sizes and magic: read-only with a ``reader_index``
    (its flag is set), else read/write (unnamed data: read-only). ``fds``: its files,
    kept open. Raises ShmEmbedsError: a file is missing, has the wrong size, or no header."""
    reader = reader_index is not None
    prot = mmap.PROT_READ if reader else mmap.PROT_READ | mmap.PROT_WRITE
    own = fds is None
    if own:
        fds = open_files(directory, handle, reader)
    try:
        sizes = []
        for i, (fd, (part, _, length)) in enumerate(zip(fds, handle.parts())):
            want = length + (HEADER_BYTES if i == 0 else 0)
            size = os.fstat(fd).st_size
            # unnamed data may have grown (a kept conversation's memfd): its start is mapped
            if size != want and not (i and handle.unnamed_data and size > want):
                raise ShmEmbedsError(f"segment {part!r} holds {size} bytes, handle expects {want}")
            sizes.append(want)
        mm = map_files(fds, sizes, [prot] + [mmap.PROT_READ] * (len(fds) - 1)
                       if handle.unnamed_data else prot)
        if mm[: len(MAGIC)] != MAGIC:
            mm.close()
            raise ShmEmbedsError(f"segment {handle.name!r} has no shm-embeds header")
        if reader:
            os.pwrite(fds[0], b"\x01", READER_FLAGS_OFFSET + handle.flag_base + reader_index)
    finally:
        if own:
            for fd in fds:
                os.close(fd)
    return mm


def tensor_view(mm: mmap.mmap, handle: SharedTensorHandle) -> tuple[torch.Tensor, Any]:
    """Zero-copy ``(tensor, anchor)`` over a mapped segment's data; ``anchor`` dies with
    the last tensor over that storage."""
    nbytes = handle.nbytes
    anchor = memoryview(mm)
    if nbytes == 0:
        return torch.empty(handle.shape, dtype=handle.torch_dtype), anchor
    with warnings.catch_warnings():
        # Readers map read-only on purpose; torch warns about such buffers.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(anchor, dtype=torch.uint8, count=nbytes, offset=HEADER_BYTES)
    return raw.view(handle.torch_dtype).view(handle.shape), anchor


def within(mm: mmap.mmap, tensor: torch.Tensor) -> bool:
    """True if all of ``tensor``'s storage lies in ``mm``."""
    if mm.closed:
        return False
    storage = tensor.untyped_storage()
    start = storage.data_ptr() - _base(mm)
    return 0 <= start and start + storage.nbytes() <= len(mm)


def view_within(mm: mmap.mmap, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``(view, anchor)``: ``view`` is ``tensor`` (same pages, dtype, shape, strides) with
    a storage and anchor of its own."""
    storage = tensor.untyped_storage()
    anchor = memoryview(mm)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(anchor, dtype=torch.uint8, count=storage.nbytes(),
                               offset=storage.data_ptr() - _base(mm))
    view = torch.empty(0, dtype=tensor.dtype).set_(
        raw.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
    return view, anchor


def unlink_quietly(path: str) -> bool:
    """False if ``path`` was not there."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def unlink_segment(directory: str, name: str, nparts: int) -> bool:
    """Unlink every file of segment ``name``; True if file 0 was still there."""
    first = unlink_quietly(os.path.join(directory, name))
    for i in range(1, nparts):
        unlink_quietly(os.path.join(directory, part_name(name, i)))
    return first


_RENAME_NOREPLACE = 1  # <linux/fs.h>
_AT_FDCWD = -100
_renameat2: Any = None  # the libc function, False where it is missing


def rename_noreplace(src: str, dst: str) -> None:
    """Rename unless ``dst`` exists (``FileExistsError``): ``renameat2(RENAME_NOREPLACE)``
    (glibc 2.28+, Linux 3.15+), else ``link`` + ``unlink``. Raises OSError."""
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                           ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (AttributeError, OSError):
            _renameat2 = False
    if _renameat2:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                      _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), src, None, dst)
    os.link(src, dst, follow_symlinks=False)
    unlink_quietly(src)
