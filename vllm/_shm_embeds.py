# SPDX-License-Identifier: Apache-2.0
"""Shared-memory transport for large ``prompt_embeds`` tensors (shm-embeds).

This module is the *mechanism*: named shared-memory segments, the small
picklable :class:`SharedTensorHandle` that names one, their lifetime, and
per-process counters. It imports nothing from vLLM; the glue that wires it
into vLLM's IPC hops lives in ``vllm._shm_embeds_glue``.

Segment layout (files in :func:`shm_dir`, ``/dev/shm`` by default)::

    [0, 4096)          header: magic b"SHMEMB01", then one flag byte per
                       reader at offset 64 + reader_index (set to 1 when
                       that reader has mapped the segment)
    [4096, 4096 + N)   the tensor's bytes, C-contiguous, N = numel * itemsize

A large segment is *striped* over K files (``<name>``, ``<name>p1``, ...
``<name>p<K-1>``) so that K threads can write it at once: tmpfs serializes
writes to one file (per-inode lock), and one writer thread reaches only
0.6-0.8x of a two-core ``memcpy`` here (``benchmarks/proto_segment_io.py``).
File 0 holds the header and the first data bytes; file i the bytes from
``handle.split[i-1]`` on (page-aligned offsets). Readers map the files back
to back into one reserved address range, so the tensor is contiguous.

Segment names say who owns them: ``vllm-shm-embeds.<pidns>.<pid>.<start>.<seq>``,
where ``<pidns>`` is the owner's PID namespace and ``<start>`` its start time
in clock ticks since boot (``/proc/<pid>/stat`` field 22), so a start-up sweep
can tell a dead owner's segments from a live one's even after pid reuse, and
leaves other containers' segments alone.

Lifetime (one owner per segment):

* hop 1 (client -> EngineCore): the client creates the segment, copies the
  tensor in once and sends only the handle. The EngineCore *adopts* it by an
  atomic ``rename`` to its own name and maps it; no copy.
* hop 2 (EngineCore -> TP workers): a tensor that already lives in an owned
  segment is sent as its handle (no copy); any other tensor is copied into a
  new segment once. Every worker maps the same segment (no per-reader copy)
  and sets its reader flag.
* The owner unlinks the name as soon as every expected reader has set its
  flag, or when the owner's tensor is freed before any broadcast. The memory
  itself lives until the last mapping goes (kernel refcount), so nothing
  outlives the processes that use it. Owners also unlink their remaining
  segments at exit, and :func:`sweep_stale_segments` removes those of dead
  owners.

Environment variables (read at call time):

* ``VLLM_SHM_EMBEDS``: ``1`` enables the feature (default ``0``).
* ``VLLM_SHM_EMBEDS_MIN_BYTES``: tensors smaller than this many bytes keep the
  stock path (default 1 MiB).
* ``VLLM_SHM_EMBEDS_DIR``: directory for segments (default ``/dev/shm``); it
  should be a tmpfs.
* ``VLLM_SHM_EMBEDS_STATS_DIR``: if set, every process writes its counters to
  ``<dir>/<pid>.json`` whenever they change (for tests and benchmarks).
* ``VLLM_SHM_EMBEDS_WRITERS``: threads (and files) used to write one large
  tensor (default: usable CPUs, at most 4).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import dataclasses
import errno
import itertools
import json
import mmap
import os
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

SEGMENT_PREFIX = "vllm-shm-embeds"
HEADER_BYTES = 4096
MAGIC = b"SHMEMB01"
READER_FLAGS_OFFSET = 64
MAX_READERS = HEADER_BYTES - READER_FLAGS_OFFSET
DEFAULT_MIN_BYTES = 1 << 20
META_KEY = "shm_embeds"
PAGE_BYTES = mmap.PAGESIZE
PART_MIN_BYTES = 4 << 20  # a segment is striped only into files at least this big
MAX_WRITERS = 16


class ShmEmbedsError(RuntimeError):
    """A segment could not be created, found or mapped."""


# --------------------------------------------------------------------------
# configuration


def enabled() -> bool:
    """True when ``VLLM_SHM_EMBEDS`` is set to a true value (1/true/yes)."""
    return os.environ.get("VLLM_SHM_EMBEDS", "0").strip().lower() in (
        "1",
        "true",
        "yes",
    )


def min_bytes() -> int:
    """Smallest tensor (bytes) that takes the shm path; ``VLLM_SHM_EMBEDS_MIN_BYTES``.

    Never raises: a value that is not a non-negative integer gives the default
    (1 MiB); :func:`config_problems` reports it.
    """
    raw = os.environ.get("VLLM_SHM_EMBEDS_MIN_BYTES", "").strip()
    try:
        value = int(raw) if raw else DEFAULT_MIN_BYTES
    except ValueError:
        return DEFAULT_MIN_BYTES
    return value if value >= 0 else DEFAULT_MIN_BYTES


def config_problems() -> list[str]:
    """What is wrong with the environment for the shm path (empty: fine).

    Checks ``VLLM_SHM_EMBEDS_MIN_BYTES`` (defaulted when bad) and that
    :func:`shm_dir` is a writable directory (the feature stays off if not).
    """
    problems = []
    raw = os.environ.get("VLLM_SHM_EMBEDS_MIN_BYTES", "").strip()
    if raw and not raw.isdigit():
        problems.append(
            f"VLLM_SHM_EMBEDS_MIN_BYTES={raw!r} is not a byte count; using "
            f"{DEFAULT_MIN_BYTES}"
        )
    raw = os.environ.get("VLLM_SHM_EMBEDS_WRITERS", "").strip()
    if raw and not (raw.isdigit() and 0 < int(raw) <= MAX_WRITERS):
        problems.append(
            f"VLLM_SHM_EMBEDS_WRITERS={raw!r} is not a count in 1..{MAX_WRITERS}; "
            f"using {writers()}"
        )
    if not os.path.isdir(shm_dir()) or not os.access(shm_dir(), os.W_OK | os.X_OK):
        problems.append(f"segment directory {shm_dir()} is missing or not writable")
    return problems


def writers() -> int:
    """Threads (and files) that write one tensor into a segment; ``VLLM_SHM_EMBEDS_WRITERS``.

    Default: the CPUs this process may run on, at most 4 (measured on 2
    cores: 2 writers reach 0.75-0.9x of a torch ``memcpy``, 1 writer
    1.3-1.6x). Never raises: a bad value gives the default, clamped to
    1..16.
    """
    try:
        default = min(4, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        default = min(4, os.cpu_count() or 1)
    raw = os.environ.get("VLLM_SHM_EMBEDS_WRITERS", "").strip()
    try:
        value = int(raw) if raw else default
    except ValueError:
        value = default
    return max(1, min(MAX_WRITERS, value if value > 0 else default))


def shm_dir() -> str:
    """Directory holding the segments; ``VLLM_SHM_EMBEDS_DIR`` or ``/dev/shm``."""
    return os.environ.get("VLLM_SHM_EMBEDS_DIR", "/dev/shm")


# --------------------------------------------------------------------------
# counters


_counters: Counter[str] = Counter()
_counters_lock = threading.Lock()
_role: set[str] = set()


def set_role(role: str) -> None:
    """Record what this process is (``client``, ``engine``, ``worker``) for stats."""
    _role.add(role)


def count(**deltas: int) -> None:
    """Add to this process's counters, e.g. ``count(hop2_shm_tensors=1)``.

    Counter names used: ``hop{1,2}_{shm,stock}_{tensors,bytes}``,
    ``hop1_adopted_tensors``, ``hop2_reused_tensors`` (sent without a copy),
    ``copied_bytes`` (bytes copied into segments), ``segments_created``,
    ``segments_unlinked``, ``fallback.<reason>``.
    """
    with _counters_lock:
        _counters.update(deltas)
        snapshot = dict(_counters)
    stats_dir = os.environ.get("VLLM_SHM_EMBEDS_STATS_DIR")
    if stats_dir:
        _write_stats(stats_dir, snapshot)


def stats() -> dict[str, int]:
    """A copy of this process's counters (name -> count; bytes in bytes)."""
    with _counters_lock:
        return dict(_counters)


def _write_stats(stats_dir: str, snapshot: dict[str, int]) -> None:
    pid = os.getpid()
    path = os.path.join(stats_dir, f"{pid}.json")
    tmp = f"{path}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"pid": pid, "roles": sorted(_role), "counters": snapshot}, f)
        os.replace(tmp, path)
    except OSError as e:  # stats are best effort, never fail a request
        logger.debug("shm-embeds: could not write stats to %s: %s", path, e)


def read_stats_dir(stats_dir: str) -> list[dict[str, Any]]:
    """All per-process stats files in ``stats_dir`` (for tests/benchmarks).

    Returns a list of ``{"pid": int, "roles": [str], "counters": {str: int}}``.
    """
    out = []
    for name in sorted(os.listdir(stats_dir)):
        if name.endswith(".json"):
            with open(os.path.join(stats_dir, name)) as f:
                out.append(json.load(f))
    return out


# --------------------------------------------------------------------------
# handles and segments


@dataclasses.dataclass(frozen=True)
class SharedTensorHandle:
    """Names a tensor stored in a shared-memory segment; a few hundred bytes pickled.

    Attributes:
        name: segment file name inside :func:`shm_dir` (no directory part);
            the name of file 0 when the segment is striped.
        dtype: torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``.
        shape: tensor shape, e.g. ``(num_tokens, hidden_size)``.
        split: data byte offsets where files 1, 2, ... of a striped segment
            begin (increasing multiples of the page size, inside the data);
            empty for a one-file segment.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    split: tuple[int, ...] = ()

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
        return n * torch.empty((), dtype=self.torch_dtype).element_size()

    def parts(self) -> list[tuple[str, int, int]]:
        """``(file name, first data byte, data bytes)`` for each file of the segment."""
        bounds = [0, *self.split, self.nbytes]
        return [
            (_part_name(self.name, i), bounds[i], bounds[i + 1] - bounds[i])
            for i in range(len(bounds) - 1)
        ]

    def renamed(self, name: str) -> SharedTensorHandle:
        """The same tensor under another segment name."""
        return dataclasses.replace(self, name=name)

    def to_meta(self) -> dict[str, Any]:
        """Plain-dict form for msgpack metadata (hop 1)."""
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
        if "/" in handle.name or not handle.name.startswith(SEGMENT_PREFIX + "."):
            raise ShmEmbedsError(f"not a shm-embeds segment name: {handle.name!r}")
        bounds = [0, *split, nbytes]
        if len(split) >= MAX_WRITERS or any(
            b % PAGE_BYTES or b <= a for a, b in zip(bounds, bounds[1:-1])
        ) or (split and split[-1] >= nbytes):
            raise ShmEmbedsError(f"malformed shm-embeds handle split {split!r}")
        return handle


def _part_name(name: str, index: int) -> str:
    """File name of part ``index`` of segment ``name`` (part 0 is ``name`` itself)."""
    return name if index == 0 else f"{name}p{index}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _proc_start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it is gone.

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
    return fields[19].decode()


_seq = itertools.count()
_owner_tag: tuple[int, str] | None = None  # (pid, '<pidns>.<pid>.<start>')


def _pid_ns() -> str:
    """This process's PID namespace id (inode of ``/proc/self/ns/pid``), or ``0``.

    Pids only mean something inside one PID namespace: two containers sharing
    a ``/dev/shm`` must not judge each other's segments by pid.
    """
    try:
        return "".join(c for c in os.readlink("/proc/self/ns/pid") if c.isdigit()) or "0"
    except OSError:
        return "0"


def _owner_prefix() -> str:
    """``vllm-shm-embeds.<pidns>.<pid>.<start>.`` for this process (redone after fork)."""
    global _owner_tag
    pid = os.getpid()
    if _owner_tag is None or _owner_tag[0] != pid:
        _owner_tag = (pid, f"{_pid_ns()}.{pid}.{_proc_start_time(pid) or '0'}")
    return f"{SEGMENT_PREFIX}.{_owner_tag[1]}."


def _path(name: str) -> str:
    return os.path.join(shm_dir(), name)


def eligible(tensor: Any) -> str | None:
    """Why ``tensor`` must keep the stock path, or None if it can use shm.

    Only dense (strided), CPU, C-contiguous tensors of at least
    :func:`min_bytes` bytes qualify.
    """
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


def _view(mm: mmap.mmap, handle: SharedTensorHandle) -> torch.Tensor:
    """Zero-copy tensor over the data part of a mapped segment."""
    nbytes = handle.nbytes
    if nbytes == 0:
        return torch.empty(handle.shape, dtype=handle.torch_dtype)
    with warnings.catch_warnings():
        # Readers map read-only on purpose; torch warns about such buffers.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=HEADER_BYTES)
    return raw.view(handle.torch_dtype).view(handle.shape)


_HEADER = MAGIC.ljust(HEADER_BYTES, b"\0")
_MAX_IO = 0x7FFFF000  # Linux moves at most this many bytes per write call


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done : done + _MAX_IO], offset + done)


_writer_pool: concurrent.futures.ThreadPoolExecutor | None = None
_writer_pool_lock = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _writer_pool
    with _writer_pool_lock:
        if _writer_pool is None:
            _writer_pool = concurrent.futures.ThreadPoolExecutor(
                MAX_WRITERS - 1, thread_name_prefix="shm-embeds-writer"
            )
        return _writer_pool


def _split_for(nbytes: int) -> tuple[int, ...]:
    """Page-aligned data offsets at which to stripe ``nbytes`` over the writers."""
    k = min(writers(), nbytes // PART_MIN_BYTES)
    if k <= 1:
        return ()
    step = nbytes // k // PAGE_BYTES * PAGE_BYTES
    return tuple(step * i for i in range(1, k))


def _create_segment(
    tensor: torch.Tensor, map_header: bool
) -> tuple[SharedTensorHandle, mmap.mmap | None]:
    """Create an owned segment holding a copy of ``tensor`` (one copy).

    The bytes go in with ``pwrite`` (one kernel copy into the tmpfs pages, no
    page faults in this process; measured faster than copying through a
    mapping in ``benchmarks/proto_segment_io.py``), striped over
    :func:`writers` files written by as many threads when the tensor is
    large. A full ``/dev/shm`` surfaces as ``OSError(ENOSPC)`` from the
    write, never as a SIGBUS.

    Args:
        tensor: dense, CPU, C-contiguous.
        map_header: also return a mapping of the 4096-byte header (the owner
            reads the reader flags there); otherwise None.
    Raises:
        OSError: the partial files are removed first.
    """
    handle = SharedTensorHandle(
        f"{_owner_prefix()}{next(_seq)}",
        _dtype_name(tensor.dtype),
        tuple(tensor.shape),
        _split_for(tensor.nbytes),
    )
    data = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
    fds: list[int] = []
    mm = None
    try:
        for part, _, _ in handle.parts():
            fds.append(os.open(_path(part), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        _pwrite_all(fds[0], memoryview(_HEADER), 0)
        jobs = [
            (fd, data[start : start + length], HEADER_BYTES if i == 0 else 0)
            for i, (fd, (_, start, length)) in enumerate(zip(fds, handle.parts()))
        ]
        futures = [_pool().submit(_pwrite_all, *job) for job in jobs[1:]]
        try:
            if jobs[0][1].nbytes:
                _pwrite_all(*jobs[0])
        finally:
            for f in concurrent.futures.as_completed(futures):
                f.result()  # raises the first writer's OSError
        if map_header:
            mm = mmap.mmap(fds[0], HEADER_BYTES, flags=mmap.MAP_SHARED)
    except BaseException:
        _unlink_segment(handle.name, len(handle.parts()))
        raise
    finally:
        for fd in fds:
            os.close(fd)
    count(segments_created=1, copied_bytes=tensor.nbytes)
    return handle, mm


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


def _map_parts(fds: list[int], sizes: list[int], prot: int) -> mmap.mmap:
    """Map the files of a striped segment back to back as one mapping.

    An anonymous reservation of the whole size is made with Python's ``mmap``
    (so that its lifetime, and ``munmap`` of the whole range, follow the
    Python object as usual), then each file is mapped over its slice of the
    range with ``MAP_FIXED``. Every file but the last has a page-multiple size.
    """
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


def _open_segment(handle: SharedTensorHandle, reader_index: int | None = None) -> mmap.mmap:
    """Map an existing segment (all its files) after checking sizes and magic.

    With ``reader_index`` (a reader, not the owner) the reader's flag is set
    with ``pwrite`` and the mapping is read-only: a stray in-place write in
    one TP rank faults in that rank instead of silently changing what the
    others read. (A private copy-on-write mapping would also protect them,
    but cost ~45 ms per 0.5 MiB request in the model runner here.) The owner
    maps it read/write.
    """
    reader = reader_index is not None
    prot = mmap.PROT_READ if reader else mmap.PROT_READ | mmap.PROT_WRITE
    fds: list[int] = []
    sizes: list[int] = []
    try:
        for i, (part, _, length) in enumerate(handle.parts()):
            try:
                fds.append(os.open(_path(part), os.O_RDWR if i == 0 or not reader
                                   else os.O_RDONLY))
            except FileNotFoundError as e:
                raise ShmEmbedsError(
                    f"shm-embeds segment {part!r} not found in {shm_dir()} (its owner "
                    "released it, or the process is on another host)"
                ) from e
            want = length + (HEADER_BYTES if i == 0 else 0)
            size = os.fstat(fds[-1]).st_size
            if size != want:
                raise ShmEmbedsError(
                    f"segment {part!r} holds {size} bytes, handle expects {want}"
                )
            sizes.append(size)
        if len(fds) == 1:
            mm = mmap.mmap(fds[0], sizes[0], flags=mmap.MAP_SHARED, prot=prot)
        else:
            mm = _map_parts(fds, sizes, prot)
        if mm[: len(MAGIC)] != MAGIC:
            mm.close()
            raise ShmEmbedsError(f"segment {handle.name!r} has no shm-embeds header")
        if reader:
            os.pwrite(fds[0], b"\x01", READER_FLAGS_OFFSET + reader_index)
    finally:
        for fd in fds:
            os.close(fd)
    return mm


def _unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _unlink_segment(name: str, nparts: int) -> bool:
    """Unlink every file of segment ``name``; True if file 0 was still there."""
    first = _unlink_quietly(_path(name))
    for i in range(1, nparts):
        _unlink_quietly(_path(_part_name(name, i)))
    return first


# --------------------------------------------------------------------------
# owner-side bookkeeping


@dataclasses.dataclass
class _Owned:
    handle: SharedTensorHandle
    mm: mmap.mmap | None
    readers: int | None = None  # expected readers once broadcast
    released: bool = False  # the owner's own tensor is gone


class _OwnedSegments:
    """Segments this process owns, and when to unlink their names."""

    def __init__(self) -> None:
        self._segs: dict[str, _Owned] = {}
        # id(tensor) -> (weakref to tensor, segment name): tensors backed by,
        # or already copied into, one of our segments.
        self._by_tensor: dict[int, tuple[weakref.ref, str]] = {}
        self._lock = threading.Lock()

    def add(
        self, handle: SharedTensorHandle, mm: mmap.mmap, tensor: torch.Tensor | None
    ) -> None:
        with self._lock:
            self._segs[handle.name] = _Owned(handle, mm, released=tensor is None)
        if tensor is not None:
            self.track(tensor, handle.name, release_on_free=True)

    def track(self, tensor: torch.Tensor, name: str, release_on_free: bool) -> None:
        key = id(tensor)
        with self._lock:
            self._by_tensor[key] = (weakref.ref(tensor), name)
        weakref.finalize(tensor, self._forget, key, name, release_on_free)

    def _forget(self, key: int, name: str, release: bool) -> None:
        with self._lock:
            entry = self._by_tensor.get(key)
            if entry is not None and entry[1] == name:
                del self._by_tensor[key]
            seg = self._segs.get(name)
            if not release or seg is None:
                return
            seg.released = True
            if seg.readers is not None:
                return  # readers may still need the name; collect() decides
            del self._segs[name]
        # Freed before any broadcast (e.g. aborted while waiting): no reader
        # will ever look for it.
        if _unlink_segment(name, len(seg.handle.parts())):
            count(segments_unlinked=1)

    def lookup(self, tensor: torch.Tensor) -> SharedTensorHandle | None:
        """Handle of a still-tracked segment already holding ``tensor``'s bytes."""
        with self._lock:
            entry = self._by_tensor.get(id(tensor))
            if entry is None or entry[0]() is not tensor or entry[1] not in self._segs:
                return None
            return self._segs[entry[1]].handle

    def drop(self, name: str) -> None:
        """Forget a segment whose name is already (partly) gone; unlink the rest."""
        with self._lock:
            seg = self._segs.pop(name, None)
        if seg is not None:
            _unlink_segment(name, len(seg.handle.parts()))

    def mark_broadcast(self, name: str, readers: int) -> None:
        with self._lock:
            self._segs[name].readers = readers

    def pending(self) -> int:
        with self._lock:
            return len(self._segs)

    def collect(self) -> int:
        """Unlink names no reader needs any more; returns how many were unlinked.

        A name is done when every expected reader has set its flag, or when
        the owner's tensor was freed before the segment was ever broadcast.
        """
        if not self._segs:
            return 0
        done = []
        with self._lock:
            for name, seg in self._segs.items():
                if seg.readers is not None:
                    assert seg.mm is not None
                    flags = seg.mm[READER_FLAGS_OFFSET : READER_FLAGS_OFFSET + seg.readers]
                    if b"\x00" not in flags:
                        done.append(name)
                elif seg.released:
                    done.append(name)
            gone = [self._segs.pop(name) for name in done]
        for seg in gone:
            _unlink_segment(seg.handle.name, len(seg.handle.parts()))
        if done:
            count(segments_unlinked=len(done))
        return len(done)

    def unlink_all(self) -> int:
        """Unlink every name this process still owns (shutdown)."""
        with self._lock:
            segs = list(self._segs.values())
            self._segs.clear()
        n = sum(_unlink_segment(seg.handle.name, len(seg.handle.parts())) for seg in segs)
        # Segments created here but never adopted by a peer (hop 1 sends).
        prefix = _owner_prefix()
        try:
            for name in os.listdir(shm_dir()):
                # Count segments, not their extra files (``<name>p<i>``).
                if name.startswith(prefix) and _unlink_quietly(_path(name)):
                    n += name[len(prefix) :].isdigit()
        except OSError:
            pass
        if n:
            count(segments_unlinked=n)
        return n


_owned = _OwnedSegments()


# --------------------------------------------------------------------------
# public operations


def share_tensor(tensor: torch.Tensor) -> SharedTensorHandle:
    """Copy ``tensor`` into a new segment and hand its ownership to the caller's peer.

    Used by hop 1 senders: the segment is *not* tracked by this process's
    lifetime rules (the receiver adopts it with :func:`adopt_tensor`); if no
    peer adopts it, :func:`shutdown` or a later :func:`sweep_stale_segments`
    removes it. One copy of ``tensor.nbytes`` bytes.

    Args:
        tensor: dense, CPU, C-contiguous tensor of any dtype and shape.
    Raises:
        OSError: the segment could not be created (e.g. ENOSPC).
    """
    handle, _ = _create_segment(tensor, map_header=False)
    return handle


def adopt_tensor(handle: SharedTensorHandle) -> torch.Tensor:
    """Take ownership of a peer's segment and map it as a tensor (no copy).

    The segment is atomically renamed to this process's name, so a crash of
    either side leaves it attributable. The returned tensor is remembered, so
    :func:`externalize` sends it onwards (hop 2) without copying it again.

    Returns:
        tensor of ``handle.dtype`` and ``handle.shape`` backed by the segment.
    Raises:
        ShmEmbedsError: missing segment, wrong size or header.
    """
    mine = handle.renamed(f"{_owner_prefix()}{next(_seq)}")
    nparts = len(handle.parts())
    for i in range(nparts):
        try:
            os.rename(_path(_part_name(handle.name, i)), _path(_part_name(mine.name, i)))
        except FileNotFoundError as e:
            _unlink_segment(mine.name, i)  # the parts already taken
            _unlink_segment(handle.name, nparts)
            raise ShmEmbedsError(
                f"shm-embeds segment {_part_name(handle.name, i)!r} not found in "
                f"{shm_dir()}: the sender is on another host or already released it"
            ) from e
    try:
        mm = _open_segment(mine)
    except BaseException:
        _unlink_segment(mine.name, nparts)
        raise
    tensor = _view(mm, mine)
    _owned.add(mine, mm, tensor)
    return tensor


def open_tensor(handle: SharedTensorHandle, reader_index: int | None = None) -> torch.Tensor:
    """Map a segment as a tensor (reader side, no copy) and set the reader's flag.

    The mapping is read-only: an in-place write to the tensor faults.

    Args:
        handle: from the owner.
        reader_index: 0-based index of this reader among the owner's expected
            readers (``< MAX_READERS``), or None not to mark.
    Returns:
        tensor of ``handle.dtype``/``handle.shape``; it stays valid after the
        owner unlinks the name, until the tensor is freed.
    Raises:
        ShmEmbedsError: missing segment, wrong size or header.
    """
    if reader_index is not None and not 0 <= reader_index < MAX_READERS:
        raise ShmEmbedsError(f"reader index {reader_index} out of range")
    return _view(_open_segment(handle, reader_index), handle)


def externalize(tensor: torch.Tensor, readers: int) -> SharedTensorHandle:
    """Handle for ``tensor`` to broadcast to ``readers`` local readers (hop 2).

    A tensor that already lives in a segment this process owns (adopted at
    hop 1, or sent before and still linked) is sent without a copy; any other
    tensor is copied once into a new segment. The name is unlinked once all
    ``readers`` have mapped it (see :func:`collect`).

    Raises:
        OSError: a new segment could not be created; the caller keeps the
            stock path.
        ValueError: ``readers`` exceeds :data:`MAX_READERS`.
    """
    if not 0 < readers <= MAX_READERS:
        raise ValueError(f"readers must be in 1..{MAX_READERS}, got {readers}")
    handle = _owned.lookup(tensor)
    if handle is not None and not all(
        os.path.exists(_path(part)) for part, _, _ in handle.parts()
    ):
        # Removed behind our back (e.g. a tmp cleaner): readers could not
        # open it, so send a fresh copy instead.
        logger.warning("shm-embeds: segment %s vanished; copying again", handle.name)
        count(**{"fallback.hop2.vanished": 1})
        _owned.drop(handle.name)
        handle = None
    if handle is not None:
        count(hop2_reused_tensors=1)
    else:
        handle, mm = _create_segment(tensor, map_header=True)
        assert mm is not None
        _owned.add(handle, mm, None)
        _owned.track(tensor, handle.name, release_on_free=False)
    _owned.mark_broadcast(handle.name, readers)
    return handle


def collect() -> int:
    """Unlink the names of owned segments that no reader needs any more.

    Cheap when nothing is pending; called once per broadcast. Returns the
    number of names unlinked.
    """
    return _owned.collect()


def pending_segments() -> int:
    """Number of segment names this process owns and has not unlinked yet."""
    return _owned.pending()


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
                reason = _placement_failed("hop 2", tensor, e)
        if reason is not None:
            count(hop2_stock_tensors=1, hop2_stock_bytes=_nbytes(tensor))
            count(**{f"fallback.hop2.{reason}": 1})
            continue
        req.prompt_embeds = handle
        swapped.append((req, tensor))
        count(hop2_shm_tensors=1, hop2_shm_bytes=tensor.nbytes)
    return swapped


def restore_prompt_embeds(swapped: list[tuple[Any, torch.Tensor]]) -> None:
    """Put back the tensors that :func:`externalize_prompt_embeds` swapped out."""
    for req, tensor in swapped:
        req.prompt_embeds = tensor


def internalize_prompt_embeds(new_reqs: Iterable[Any], reader_index: int) -> int:
    """Replace each ``SharedTensorHandle`` in ``new_reqs[i].prompt_embeds`` by its tensor.

    Runs in each TP worker before the model runner sees the step. Returns the
    number of tensors mapped. Raises ShmEmbedsError if a segment is missing.
    """
    n = 0
    for req in new_reqs:
        handle = getattr(req, "prompt_embeds", None)
        if isinstance(handle, SharedTensorHandle):
            req.prompt_embeds = open_tensor(handle, reader_index)
            count(hop2_shm_tensors=1, hop2_shm_bytes=handle.nbytes)
            n += 1
    return n


_placement_warned = False


def _placement_failed(hop: str, tensor: torch.Tensor, e: OSError) -> str:
    """Log why a segment could not be created (a warning once per process).

    Returns the fallback reason: ``no_space`` (ENOSPC: /dev/shm full or too
    small) or ``os_error``.
    """
    global _placement_warned
    log = logger.debug if _placement_warned else logger.warning
    _placement_warned = True
    log(
        "shm-embeds: could not place %d bytes of prompt_embeds in %s (%s); %s uses "
        "the stock path for such tensors (further failures are logged at debug level)",
        tensor.nbytes,
        shm_dir(),
        e,
        hop,
    )
    return "no_space" if e.errno == errno.ENOSPC else "os_error"


def _nbytes(tensor: Any) -> int:
    """Dense size in bytes (also defined for sparse tensors, unlike ``nbytes``)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.numel() * tensor.element_size()
    return 0


# --------------------------------------------------------------------------
# hop 1 adapters (duck-typed to vLLM's OOB tensor consumer/provider protocol)


class HandleOOBConsumer:
    """Sender side of hop 1: sends the *armed* tensor as a segment handle.

    Duck-types the out-of-band tensor consumer of vLLM's ``MsgpackEncoder``
    (``vllm/v1/serial_utils.py``, 0.32/0.33: ``__call__(tensor) -> dict | None``
    and ``new_message()``). Only the tensor passed to :meth:`arm` (the
    request's ``prompt_embeds``) is taken; every other tensor goes to
    ``inner`` (e.g. vLLM's multimodal ``TensorIpcSender``) or inline.
    """

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self._armed: torch.Tensor | None = None

    def arm(self, tensor: torch.Tensor | None) -> None:
        """Mark the tensor to send through shm in the next encoded message."""
        self._armed = tensor

    def new_message(self) -> None:
        if self.inner is not None:
            self.inner.new_message()

    def __call__(self, tensor: torch.Tensor) -> dict | None:
        if tensor is self._armed:
            self._armed = None
            reason = eligible(tensor)
            if reason is None:
                try:
                    handle = take_handover(tensor) or share_tensor(tensor)
                except OSError as e:
                    reason = _placement_failed("hop 1", tensor, e)
                else:
                    count(hop1_shm_tensors=1, hop1_shm_bytes=tensor.nbytes)
                    return {META_KEY: handle.to_meta()}
            count(hop1_stock_tensors=1, hop1_stock_bytes=_nbytes(tensor))
            count(**{f"fallback.hop1.{reason}": 1})
        return self.inner(tensor) if self.inner is not None else None


class HandleOOBProvider:
    """Receiver side of hop 1: adopts segments named in OOB tensor metadata.

    Duck-types vLLM's ``OOBTensorProvider`` (``(dtype, shape, meta) ->
    tensor``). Metadata without our key goes to ``inner``. A handle that cannot
    be adopted yields an empty tensor that :func:`is_failed` recognizes, so the
    caller can reject the request instead of crashing its input thread.
    """

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self._failed: dict[int, tuple[weakref.ref, str]] = {}

    def __call__(self, dtype: str, shape: tuple[int, ...], meta: dict) -> torch.Tensor:
        if META_KEY not in meta:
            if self.inner is None:
                raise ShmEmbedsError("out-of-band tensor without a provider")
            return self.inner(dtype, shape, meta)
        try:
            handle = SharedTensorHandle.from_meta(meta[META_KEY])
            if handle.dtype != dtype or handle.shape != tuple(shape):
                raise ShmEmbedsError(
                    f"handle {handle} does not match tensor {dtype}{tuple(shape)}"
                )
            tensor = adopt_tensor(handle)
        except ShmEmbedsError as e:
            logger.error("shm-embeds: rejecting prompt_embeds: %s", e)
            count(**{"fallback.hop1.adopt_failed": 1})
            tensor = torch.empty(0)
            self._failed[id(tensor)] = (weakref.ref(tensor), str(e))
            weakref.finalize(tensor, self._failed.pop, id(tensor), None)
            return tensor
        count(
            hop1_shm_tensors=1, hop1_shm_bytes=handle.nbytes, hop1_adopted_tensors=1
        )
        return tensor

    def is_failed(self, tensor: Any) -> str | None:
        """The error message if ``tensor`` stands for a handle that failed."""
        entry = self._failed.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        return entry[1]


# --------------------------------------------------------------------------
# streamed segments: tensors written from a byte stream, handed over by handle
# (issue 8: binary request bodies). Additive section; nothing above depends
# on it except HandleOOBConsumer, which offers each tensor to take_handover()
# before copying it with share_tensor().


class StreamedSegment:
    """A one-file segment that an HTTP body is written into, chunk by chunk.

    Created empty at its final size (``ftruncate``: no memory is used until
    bytes arrive), then filled in order with :meth:`write` (``pwrite`` at
    increasing offsets: one kernel copy from the caller's buffer into the
    tmpfs pages; ENOSPC is an ``OSError``, never a SIGBUS). :meth:`finish`
    maps it and returns the tensor; the segment stays owned by this process
    until :func:`take_handover` passes it to a peer (hop 1, by handle, no
    copy), and is unlinked when the tensor is freed before that, or by
    :meth:`abort`. The caller must have validated ``shape`` and ``dtype``
    against its own limits before creating one.

    Args:
        dtype: element type of the bytes that will be written.
        shape: tensor shape, e.g. ``(num_tokens, hidden_size)``.
    Raises:
        OSError: the file could not be created or sized (nothing is left).
    """

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.handle = SharedTensorHandle(
            f"{_owner_prefix()}{next(_seq)}", _dtype_name(dtype), tuple(shape)
        )
        self.nbytes = self.handle.nbytes
        self.filled = 0
        self._fd: int | None = os.open(
            _path(self.handle.name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600
        )
        try:
            _pwrite_all(self._fd, memoryview(_HEADER), 0)
            os.ftruncate(self._fd, HEADER_BYTES + self.nbytes)
        except BaseException:
            self.abort()
            raise
        count(segments_created=1)

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data`` (at most the bytes still missing); raises ValueError on overflow."""
        if self._fd is None:
            raise ShmEmbedsError("segment already finished or aborted")
        if self.filled + len(data) > self.nbytes:
            raise ValueError("more bytes than the segment holds")
        _pwrite_all(self._fd, memoryview(data), HEADER_BYTES + self.filled)
        self.filled += len(data)

    def finish(self) -> torch.Tensor:
        """Map the filled segment; returns the tensor (``dtype``/``shape``), segment-backed.

        Counts the bytes written as ``copied_bytes`` (the one copy).
        Raises:
            ShmEmbedsError: not every byte was written.
        """
        if self._fd is None or self.filled != self.nbytes:
            self.abort()
            raise ShmEmbedsError(f"segment holds {self.filled} of {self.nbytes} bytes")
        try:
            mm = mmap.mmap(self._fd, HEADER_BYTES + self.nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            self.abort()
            raise
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        count(copied_bytes=self.nbytes)
        return _register_streamed(self.handle, mm)

    def abort(self) -> None:
        """Close and unlink (idempotent); counts the bytes written so far as copied."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if self.filled:
                count(copied_bytes=self.filled)
        if _unlink_quietly(_path(self.handle.name)):
            count(segments_unlinked=1)


# segment name -> (handle, data_ptr, nbytes) of streamed tensors not yet handed over
_streamed: dict[str, tuple[SharedTensorHandle, int, int]] = {}
_streamed_lock = threading.Lock()


def _register_streamed(handle: SharedTensorHandle, mm: mmap.mmap) -> torch.Tensor:
    tensor = _view(mm, handle)
    with _streamed_lock:
        _streamed[handle.name] = (handle, tensor.data_ptr(), handle.nbytes)
    # The mapping lives as long as any tensor or view over it: when it goes
    # without a hand-over, so does the name.
    weakref.finalize(mm, release_streamed, handle.name)
    return tensor


def streamed_tensor_like(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A new writable segment-backed tensor (for a dtype conversion into shm).

    The caller fills it (e.g. ``out.copy_(src)``, counted here as
    ``copied_bytes``); it is handed over or unlinked like a streamed one.
    Raises OSError (nothing left) if the segment cannot be created.
    """
    seg = StreamedSegment(dtype, shape)
    seg.filled = seg.nbytes  # filled by the caller through the mapping
    return seg.finish()


def is_streamed(tensor: Any) -> bool:
    """True if ``tensor`` covers exactly a streamed segment not yet handed over."""
    return _streamed_entry(tensor) is not None


def _streamed_entry(tensor: Any) -> SharedTensorHandle | None:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        return None
    if tensor.layout != torch.strided or not tensor.is_contiguous():
        return None
    with _streamed_lock:
        for handle, ptr, nbytes in _streamed.values():
            if (ptr == tensor.data_ptr() and nbytes == tensor.nbytes
                    and handle.dtype == _dtype_name(tensor.dtype)
                    and handle.shape == tuple(tensor.shape)):
                return handle
    return None


def take_handover(tensor: Any) -> SharedTensorHandle | None:
    """Hop 1 sender: the handle of ``tensor``'s streamed segment, ownership passed on.

    If ``tensor`` (same data pointer, size, dtype and shape) is a streamed
    segment this process owns, it is removed from this process's books (its
    name is no longer unlinked when the tensor is freed: the peer adopts it
    by ``rename``, exactly as a :func:`share_tensor` segment) and its handle
    is returned: no copy. Otherwise None (the caller copies as usual).
    """
    handle = _streamed_entry(tensor)
    if handle is None:
        return None
    with _streamed_lock:
        if _streamed.pop(handle.name, None) is None:
            return None
    count(hop1_handover_tensors=1)
    return handle


def release_streamed(name: str) -> bool:
    """Unlink a streamed segment not handed over; True if this call unlinked it.

    Safe to call for a name already handed over (then nothing happens): a
    peer owns it now.
    """
    with _streamed_lock:
        if _streamed.pop(name, None) is None:
            return False
    if _unlink_quietly(_path(name)):
        count(segments_unlinked=1)
        return True
    return False


def streamed_pending() -> int:
    """Streamed segments this process still owns (not handed over, not released)."""
    with _streamed_lock:
        return len(_streamed)


def _streamed_after_fork_in_child() -> None:
    global _streamed_lock
    _streamed.clear()  # the parent's, not ours to unlink
    _streamed_lock = threading.Lock()


os.register_at_fork(after_in_child=_streamed_after_fork_in_child)


# --------------------------------------------------------------------------
# process lifetime


def sweep_stale_segments(expected: bool = False) -> int:
    """Unlink segments in :func:`shm_dir` whose owner process is gone.

    Only names with our prefix whose ``<pid>.<start>`` no longer matches a
    running process are removed; live owners' segments are left alone.
    ``expected=True`` (a parent cleaning up after children it just stopped)
    logs at info instead of warning level. Returns the number removed.
    """
    removed = 0
    try:
        names = os.listdir(shm_dir())
    except OSError:
        return 0
    ns = _pid_ns()
    for name in names:
        parts = name.split(".")
        if len(parts) != 5 or parts[0] != SEGMENT_PREFIX or not parts[2].isdigit():
            continue
        if parts[1] != ns:
            continue  # another PID namespace (container): not ours to judge
        if _proc_start_time(int(parts[2])) != parts[3] and _unlink_quietly(_path(name)):
            removed += parts[4].isdigit()  # file 0 of a segment, not ``<seq>p<i>``
    if removed:
        (logger.info if expected else logger.warning)(
            "shm-embeds: removed %d stale segment(s) of dead processes from %s",
            removed,
            shm_dir(),
        )
    return removed


_shutdown_done = False


def shutdown() -> None:
    """Unlink this process's remaining segments and log its counters once."""
    global _shutdown_done
    n = _owned.unlink_all()
    if _shutdown_done:
        return
    _shutdown_done = True
    snapshot = stats()
    if snapshot:
        logger.info(
            "shm-embeds summary (pid %d, %s): %s%s",
            os.getpid(),
            "/".join(sorted(_role)) or "?",
            ", ".join(f"{k}={v}" for k, v in sorted(snapshot.items())),
            f"; unlinked {n} segment(s) at exit" if n else "",
        )


def _after_fork_in_child() -> None:
    # A forked child (e.g. a TP worker under the fork start method) owns
    # none of its parent's segments and starts with fresh counters.
    global _owned, _shutdown_done, _counters_lock, _placement_warned
    global _writer_pool, _writer_pool_lock
    _owned = _OwnedSegments()
    _writer_pool, _writer_pool_lock = None, threading.Lock()  # threads do not fork
    _shutdown_done = _placement_warned = False
    _role.clear()
    _counters_lock = threading.Lock()  # the parent's may have been held
    _counters.clear()


atexit.register(shutdown)
os.register_at_fork(after_in_child=_after_fork_in_child)
