# SPDX-License-Identifier: Apache-2.0
"""Segments for shm-embeds: names, handles, file I/O and the stale sweep.

This module knows files, not vLLM and not who owns what (that is
``vllm._shm_embeds``). Everything here takes the segment directory as an
argument and keeps no process state besides the ``libc`` handle.

Layout of one segment (files in the segment directory, a tmpfs)::

    [0, 4096)          header: magic b"SHMEMB01", then one flag byte per
                       reader and broadcast at offset 64 + flag_base + reader
                       (set to 1 when that reader has mapped the segment)
    [4096, 4096 + N)   the tensor's bytes, C-contiguous, N = numel * itemsize

A large segment is *striped* over K files (``<name>``, ``<name>p1``, ...
``<name>p<K-1>``): tmpfs serializes writes to one file (per-inode lock), so K
threads writing K files at once are K times faster than one. File 0 holds the
header and the first data bytes, file i the bytes from ``handle.split[i-1]``
on (page-aligned). Readers map the files back to back into one reserved
address range, so the tensor is one contiguous view.

Names (:class:`SegmentName`) say who owns a segment:
``vllm-shm-embeds.<pidns>.<pid>.<start>.<seq>[p<part>]``, ``<pidns>`` the
owner's PID namespace, ``<start>`` its start time in clock ticks since boot
(``/proc/<pid>/stat`` field 22, ``0`` when it could not be read). A sweep can
then tell a dead owner's segments from a live one's even after pid reuse,
and leaves other containers' segments alone.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import errno
import mmap
import os
import re
import warnings
from typing import Any

import torch

SEGMENT_PREFIX = "vllm-shm-embeds"
HEADER_BYTES = 4096
MAGIC = b"SHMEMB01"
READER_FLAGS_OFFSET = 64
MAX_READERS = HEADER_BYTES - READER_FLAGS_OFFSET  # flag bytes per segment
PAGE_BYTES = mmap.PAGESIZE
PART_MIN_BYTES = 4 << 20  # a segment is striped only into files at least this big
MAX_WRITERS = 16
WRITE_CHUNK_BYTES = 64 << 20  # writers check for a peer's failure this often


class ShmEmbedsError(RuntimeError):
    """A segment could not be created, found or mapped."""


# --------------------------------------------------------------------------
# names

_NAME_RE = re.compile(
    rf"^{re.escape(SEGMENT_PREFIX)}\.(\d+)\.(\d+)\.(\d+)\.(\d+)(?:p(\d+))?$"
)


@dataclasses.dataclass(frozen=True)
class SegmentName:
    """The parts of a segment file name; the only place names are built and parsed.

    Attributes:
        pidns: owner's PID namespace id (inode of ``/proc/<pid>/ns/pid``), or 0.
        pid: owner's pid inside that namespace.
        start: owner's start time in clock ticks since boot; 0 if unknown.
        seq: per-owner sequence number.
        part: file index of a striped segment (0: the segment's own name).
    """

    pidns: int
    pid: int
    start: int
    seq: int
    part: int = 0

    def __str__(self) -> str:
        base = f"{SEGMENT_PREFIX}.{self.pidns}.{self.pid}.{self.start}.{self.seq}"
        return base if self.part == 0 else f"{base}p{self.part}"

    @classmethod
    def parse(cls, name: str) -> SegmentName | None:
        """The parts of ``name``, or None if it is not a segment file name of ours."""
        m = _NAME_RE.match(name)
        if m is None:
            return None
        pidns, pid, start, seq, part = m.groups()
        return cls(int(pidns), int(pid), int(start), int(seq), int(part or 0))

    def base(self) -> SegmentName:
        """The segment's own name (file 0)."""
        return dataclasses.replace(self, part=0)


def part_name(name: str, index: int) -> str:
    """File name of part ``index`` of segment ``name`` (part 0 is ``name`` itself)."""
    return name if index == 0 else f"{name}p{index}"


def pid_namespace() -> int:
    """This process's PID namespace id (inode of ``/proc/self/ns/pid``), or 0."""
    try:
        return int("".join(c for c in os.readlink("/proc/self/ns/pid") if c.isdigit()) or 0)
    except OSError:
        return 0


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None if gone or unreadable.

    A zombie (killed, not yet reaped by its parent) counts as gone.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 2 (comm) may contain spaces; fields after the last ')' are fixed:
    # [0] is the state (field 3), [19] the start time (field 22).
    fields = stat.rsplit(b")", 1)[1].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def owner_is_dead(name: SegmentName) -> bool:
    """True only when the owner of ``name`` is certainly gone (a sweep may unlink).

    Gone means: no such pid (``kill(pid, 0)`` says ESRCH), or ``/proc`` shows
    a zombie or a different start time. When ``/proc`` cannot be read, or the
    name's start time is unknown (0), a pid that exists counts as alive: a
    sweep must never remove a live owner's segment.
    """
    try:
        os.kill(name.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        with open(f"/proc/{name.pid}/stat", "rb"):
            pass
    except OSError:
        return False  # /proc unreadable here: cannot tell, keep it
    start = proc_start_time(name.pid)
    if start is None:
        return True  # zombie, or exited between the two reads
    return name.start != 0 and start != name.start


# --------------------------------------------------------------------------
# handles


@dataclasses.dataclass(frozen=True)
class SharedTensorHandle:
    """Names a tensor stored in a shared-memory segment; a few hundred bytes pickled.

    Attributes:
        name: segment file name (no directory part); file 0 when striped.
        dtype: torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``.
        shape: tensor shape, e.g. ``(num_tokens, hidden_size)``.
        split: data byte offsets where files 1, 2, ... of a striped segment
            begin (increasing multiples of the page size, inside the data);
            empty for a one-file segment.
        flag_base: hop 2: where this broadcast's reader flags start (reader
            ``i`` sets byte ``64 + flag_base + i``); every broadcast of a
            segment gets flags of its own.
        owner_pid: hop 2: pid of the owner that holds ``owner_files`` open
            until every reader of this broadcast has set its flag (0: none).
        owner_files: hop 2: ``(fd, inode)`` per file, so that readers open
            ``/proc/<owner_pid>/fd/<fd>``: that works even if something else
            unlinked the name, and the inode check rules out a reused fd.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    split: tuple[int, ...] = ()
    flag_base: int = 0
    owner_pid: int = 0
    owner_files: tuple[tuple[int, int], ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ShmEmbedsError(f"handle names an unknown dtype {self.dtype!r}")
        return dt

    @property
    def nbytes(self) -> int:
        """Size of the tensor data in bytes (the segment is 4096 bytes larger)."""
        n = 1
        for s in self.shape:
            n *= s
        return n * self.torch_dtype.itemsize

    def parts(self) -> list[tuple[str, int, int]]:
        """``(file name, first data byte, data bytes)`` for each file of the segment."""
        bounds = [0, *self.split, self.nbytes]
        return [
            (part_name(self.name, i), bounds[i], bounds[i + 1] - bounds[i])
            for i in range(len(bounds) - 1)
        ]

    def renamed(self, name: str) -> SharedTensorHandle:
        """The same tensor under another segment name."""
        return dataclasses.replace(self, name=name)

    def to_meta(self) -> dict[str, Any]:
        """Plain-dict form for msgpack metadata (hop 1: name, dtype, shape, split)."""
        meta = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.split:
            meta["split"] = list(self.split)
        return meta

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> SharedTensorHandle:
        """Inverse of :meth:`to_meta`; raises ``ShmEmbedsError`` on malformed input."""
        try:
            name, dtype, shape = meta["name"], meta["dtype"], meta["shape"]
            split = tuple(int(b) for b in meta.get("split", ()))
            handle = cls(str(name), str(dtype), tuple(int(s) for s in shape), split)
            nbytes = handle.nbytes
        except (KeyError, TypeError, ValueError, AttributeError, ShmEmbedsError) as e:
            raise ShmEmbedsError(f"malformed shm-embeds handle {meta!r}") from e
        parsed = SegmentName.parse(handle.name)
        if parsed is None or parsed.part != 0:
            raise ShmEmbedsError(f"not a shm-embeds segment name: {handle.name!r}")
        bounds = [0, *split, nbytes]
        if len(split) >= MAX_WRITERS or any(
            b % PAGE_BYTES or b <= a for a, b in zip(bounds, bounds[1:-1])
        ) or (split and split[-1] >= nbytes):
            raise ShmEmbedsError(f"malformed shm-embeds handle split {split!r}")
        return handle


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def split_for(nbytes: int, writers: int) -> tuple[int, ...]:
    """Page-aligned data offsets at which to stripe ``nbytes`` over ``writers`` files."""
    k = min(writers, nbytes // PART_MIN_BYTES)
    if k <= 1:
        return ()
    step = nbytes // k // PAGE_BYTES * PAGE_BYTES
    return tuple(step * i for i in range(1, k))


# --------------------------------------------------------------------------
# writing

_HEADER = MAGIC.ljust(HEADER_BYTES, b"\0")
_MAX_IO = 0x7FFFF000  # Linux moves at most this many bytes per write call


def pwrite_all(fd: int, buf: memoryview, offset: int, failed: list | None = None) -> None:
    """Write all of ``buf`` at ``offset``; stop early once ``failed`` is non-empty.

    ``failed`` is shared by the writers of one segment: a writer that raises
    appends to it so that the others stop at their next chunk
    (:data:`WRITE_CHUNK_BYTES`). Raises OSError (e.g. ENOSPC).
    """
    done = 0
    step = min(_MAX_IO, WRITE_CHUNK_BYTES)
    try:
        while done < len(buf):
            if failed:
                return
            done += os.pwrite(fd, buf[done : done + step], offset + done)
    except BaseException as e:
        if failed is not None:
            failed.append(e)
        raise


def write_segment(
    directory: str,
    handle: SharedTensorHandle,
    data: memoryview,
    pool: concurrent.futures.Executor | None,
) -> list[int]:
    """Create the files of ``handle`` in ``directory`` and write header and data.

    The data goes in with ``pwrite`` (one kernel copy into the tmpfs pages, no
    page faults in this process; a full tmpfs is ``OSError(ENOSPC)``, never a
    SIGBUS). File 0 is written by the calling thread, files 1.. by ``pool``.
    Every writer has returned before any descriptor is closed or any file
    unlinked, also when one of them fails.

    Args:
        handle: name, shape, dtype and ``split`` of the segment to create.
        data: ``handle.nbytes`` bytes, C-contiguous.
        pool: runs the writers of files 1..; may be None for a one-file segment.
    Returns:
        the open descriptors of the files, in order (the caller closes them).
    Raises:
        OSError: the files created so far are removed first.
    """
    parts = handle.parts()
    fds: list[int] = []
    futures: list[concurrent.futures.Future] = []
    failed: list[BaseException] = []
    error: BaseException | None = None
    try:
        for part, _, _ in parts:
            path = os.path.join(directory, part)
            fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        pwrite_all(fds[0], memoryview(_HEADER), 0)
        jobs = [
            (fd, data[start : start + length], HEADER_BYTES if i == 0 else 0)
            for i, (fd, (_, start, length)) in enumerate(zip(fds, parts))
        ]
        if len(jobs) > 1:
            assert pool is not None
            for job in jobs[1:]:
                futures.append(pool.submit(pwrite_all, *job, failed))
        if jobs[0][1].nbytes:
            pwrite_all(*jobs[0], failed)
    except BaseException as e:
        error = e
        failed.append(e)
    finally:
        # Every writer must be done before a descriptor is closed: a closed
        # fd number can be reused at once, and a late pwrite would land there.
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


# --------------------------------------------------------------------------
# mapping

_MAP_FIXED = 0x10  # Linux, every architecture vLLM runs on
_MAP_NORESERVE = 0x4000
_libc: Any = None


def _map_fixed(addr: int, length: int, prot: int, fd: int) -> None:
    """``mmap(addr, length, prot, MAP_SHARED | MAP_FIXED, fd, 0)``; raises OSError."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
        _libc = libc
    got = _libc.mmap(addr, length, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a segment part failed: {os.strerror(err)}")


def map_files(fds: list[int], sizes: list[int], prot: int) -> mmap.mmap:
    """Map the files of a segment back to back as one mapping.

    One file: a plain shared mapping. Several: an anonymous reservation of
    the whole size (Python's ``mmap``, so ``munmap`` of the whole range
    follows the Python object), then each file over its slice with
    ``MAP_FIXED``. Every file but the last has a page-multiple size.
    """
    if len(fds) == 1:
        return mmap.mmap(fds[0], sizes[0], flags=mmap.MAP_SHARED, prot=prot)
    total = sum(sizes)
    mm = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    try:
        anchor = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(anchor)
        del anchor
        offset = 0
        for fd, size in zip(fds, sizes):
            _map_fixed(base + offset, size, prot, fd)
            offset += size
    except BaseException:
        mm.close()
        raise
    return mm


def _open_by_owner_fd(handle: SharedTensorHandle, writable_first: bool) -> list[int] | None:
    """Open the files through ``/proc/<owner_pid>/fd``; None if that is not possible."""
    if not handle.owner_pid or len(handle.owner_files) != len(handle.split) + 1:
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


def open_files(
    directory: str, handle: SharedTensorHandle, reader: bool
) -> list[int]:
    """Open every file of ``handle``: by the owner's fds when given, else by name.

    File 0 is opened read/write (readers set their flag in it), the others
    read-only for a reader. Raises ShmEmbedsError if a file is missing.
    """
    fds = _open_by_owner_fd(handle, writable_first=True) if reader else None
    if fds is not None:
        return fds
    fds = []
    try:
        for i, (part, _, _) in enumerate(handle.parts()):
            flags = os.O_RDWR if i == 0 or not reader else os.O_RDONLY
            try:
                fds.append(os.open(os.path.join(directory, part), flags))
            except FileNotFoundError as e:
                raise ShmEmbedsError(
                    f"shm-embeds segment {part!r} not found in {directory} (its owner "
                    "released it, something else removed it, or the process is on "
                    "another host)"
                ) from e
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def map_segment(
    directory: str,
    handle: SharedTensorHandle,
    reader_index: int | None = None,
    fds: list[int] | None = None,
) -> mmap.mmap:
    """Map an existing segment (all its files) after checking sizes and magic.

    With ``reader_index`` (a reader, not the owner) the mapping is read-only
    and the reader's flag ``64 + handle.flag_base + reader_index`` is set with
    ``pwrite``: a stray in-place write in one TP rank faults there instead of
    changing what the others read. The owner maps read/write.

    Args:
        fds: already open descriptors of the files (kept open); else the
            files are opened (:func:`open_files`) and closed again.
    Raises:
        ShmEmbedsError: a file is missing, has the wrong size, or no header.
    """
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
            if size != want:
                raise ShmEmbedsError(
                    f"segment {part!r} holds {size} bytes, handle expects {want}"
                )
            sizes.append(size)
        mm = map_files(fds, sizes, prot)
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
    """Zero-copy tensor over the data part of a mapped segment.

    Returns ``(tensor, anchor)``: ``anchor`` is the buffer object the tensor's
    storage keeps alive; it dies (weakref callbacks run) exactly when the
    last tensor or view over that storage is gone.
    """
    nbytes = handle.nbytes
    anchor = memoryview(mm)
    if nbytes == 0:
        return torch.empty(handle.shape, dtype=handle.torch_dtype), anchor
    with warnings.catch_warnings():
        # Readers map read-only on purpose; torch warns about such buffers.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(anchor, dtype=torch.uint8, count=nbytes, offset=HEADER_BYTES)
    return raw.view(handle.torch_dtype).view(handle.shape), anchor


def read_flags(mm: mmap.mmap, flag_base: int, readers: int) -> bytes:
    """The ``readers`` flag bytes of one broadcast."""
    start = READER_FLAGS_OFFSET + flag_base
    return mm[start : start + readers]


# --------------------------------------------------------------------------
# unlinking and sweeping


def unlink_quietly(path: str) -> bool:
    """Unlink ``path``; False if it was not there."""
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


def list_segments(directory: str) -> list[tuple[str, SegmentName]]:
    """Every file of ours in ``directory`` with its parsed name (parts included)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    out = []
    for n in names:
        parsed = SegmentName.parse(n)
        if parsed is not None:
            out.append((n, parsed))
    return out


def sweep(directory: str, pidns: int) -> int:
    """Unlink the files of segments in ``directory`` whose owner is certainly dead.

    Only names in PID namespace ``pidns`` are judged (another container's
    pids mean nothing here); see :func:`owner_is_dead`. Returns the number of
    segments (file 0s) removed.
    """
    removed = 0
    verdict: dict[tuple[int, int], bool] = {}
    for n, parsed in list_segments(directory):
        if parsed.pidns != pidns:
            continue
        key = (parsed.pid, parsed.start)
        if key not in verdict:
            verdict[key] = owner_is_dead(parsed)
        if verdict[key] and unlink_quietly(os.path.join(directory, n)):
            removed += parsed.part == 0
    return removed
