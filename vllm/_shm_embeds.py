# SPDX-License-Identifier: Apache-2.0
"""Shared-memory transport for large ``prompt_embeds`` tensors (shm-embeds).

The problem: vLLM V1 copies a request's ``prompt_embeds`` (``(num_tokens,
hidden_size)``, hundreds of MB for long prompts) across two process hops
before the model sees it: API server -> EngineCore (hop 1, msgpack + ZMQ
frames) and EngineCore -> every TP worker (hop 2, the ``SchedulerOutput``
broadcast). This module is the *mechanism* that replaces those bytes by a
small picklable :class:`SharedTensorHandle` naming a shared-memory segment.
It imports nothing of vLLM's classes; ``vllm._shm_embeds_glue`` wires it in,
and ``vllm._shm_embeds_segments`` does the file I/O.

Fast path and lifecycle (one owner per segment, one copy in total):

* hop 1: the client copies the tensor once into a new segment
  (:func:`share_tensor`) and sends only the handle; ownership passes with
  it. The EngineCore *adopts* the segment (:func:`adopt_tensor`): an atomic
  ``rename`` to its own name, then ``mmap``; no copy.
* hop 2: :func:`externalize` sends a tensor that lives in an owned segment
  as its handle (no copy; any other tensor is copied into a new segment
  once). Each broadcast gets reader flags of its own, and the owner holds
  the segment's files open until every reader of that broadcast has set its
  flag: readers open them through ``/proc/<owner>/fd``, so a name that
  something else unlinked (a cleanup job, systemd's ``RemoveIPC``) does not
  fail the step.
* The owner unlinks the name once every reader of every broadcast has
  mapped it, or when its tensor's storage is freed before any broadcast
  (abort, rejection). The memory lives on in the mappings until the last
  one goes. Owners unlink what is left at exit; the EngineCore also sweeps
  the segments of dead owners (e.g. a SIGKILLed API server's un-adopted
  one) every :data:`SWEEP_INTERVAL_S` seconds, and every process does at
  start-up.

Process state (counters, owned segments, the writer pool, the release
queue) lives in one :class:`_Process` object that a forked child replaces
as a whole: a child owns and unlinks nothing of its parent's. Finalizers
only append to that object's release queue (they can run from garbage
collection on any thread, inside any lock); the work happens at the next
safe point (:func:`collect`, every hop-2 send, and the reaper thread).

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
import collections
import concurrent.futures
import dataclasses
import errno
import itertools
import json
import mmap
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from vllm import _shm_embeds_segments as seg
from vllm._shm_embeds_segments import (  # noqa: F401  (re-exported public names)
    HEADER_BYTES,
    MAGIC,
    MAX_READERS,
    MAX_WRITERS,
    SEGMENT_PREFIX,
    SegmentName,
    SharedTensorHandle,
    ShmEmbedsError,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

DEFAULT_MIN_BYTES = 1 << 20
META_KEY = "shm_embeds"
NO_SPACE_MARKER = "no_space.warned"  # in the stats dir: the server warned of ENOSPC
SWEEP_INTERVAL_S = 10.0  # EngineCore: sweep dead owners' segments this often
REAP_INTERVAL_S = 0.1  # reaper thread: safe point this often


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


def writers() -> int:
    """Threads (and files) that write one tensor into a segment; ``VLLM_SHM_EMBEDS_WRITERS``.

    Default: the CPUs this process may run on, at most 4 (on 2 cores, 2
    writers beat one ``memcpy``; 1 writer does not: README, hop 1). Never
    raises: a bad value gives the default, clamped to 1..16.
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


@dataclasses.dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with the environment.

    Attributes:
        message: what to log.
        fatal: True when the feature must stay off (no usable segment
            directory); False when a default replaced a bad value.
    """

    message: str
    fatal: bool = False


def config_problems() -> list[ConfigProblem]:
    """What is wrong with the environment for the shm path (empty: fine)."""
    problems = []
    raw = os.environ.get("VLLM_SHM_EMBEDS_MIN_BYTES", "").strip()
    if raw and not raw.isdigit():
        problems.append(ConfigProblem(
            f"VLLM_SHM_EMBEDS_MIN_BYTES={raw!r} is not a byte count; using "
            f"{DEFAULT_MIN_BYTES}"
        ))
    raw = os.environ.get("VLLM_SHM_EMBEDS_WRITERS", "").strip()
    if raw and not (raw.isdigit() and 0 < int(raw) <= MAX_WRITERS):
        problems.append(ConfigProblem(
            f"VLLM_SHM_EMBEDS_WRITERS={raw!r} is not a count in 1..{MAX_WRITERS}; "
            f"using {writers()}"
        ))
    if not os.path.isdir(shm_dir()) or not os.access(shm_dir(), os.W_OK | os.X_OK):
        problems.append(ConfigProblem(
            f"segment directory {shm_dir()} is missing or not writable", fatal=True
        ))
    return problems


# --------------------------------------------------------------------------
# process state


class _Process:
    """Everything this process knows about shm-embeds; a forked child gets a new one.

    Attributes:
        pid: the process this state belongs to (finalizers check it).
        counters: name -> count (bytes in bytes), guarded by ``counters_lock``.
        roles: ``client``, ``engine``, ``worker``.
        owned: segments this process owns.
        released: keys appended by finalizers; drained at safe points.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.counters: Counter[str] = Counter()
        self.counters_lock = threading.Lock()
        self.roles: set[str] = set()
        self.released: collections.deque = collections.deque()
        self.owned = _OwnedSegments(self)
        self.seq = itertools.count()
        self.tag: SegmentName | None = None
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.pool_lock = threading.Lock()
        self.reaper: threading.Thread | None = None
        self.sweep_interval: float | None = None
        self.placement_warned = False
        self.shutdown_done = False
        # stats files: a snapshot is written only if newer than the last one
        self.stats_version = 0
        self.stats_written = 0
        self.stats_lock = threading.Lock()

    def new_name(self) -> str:
        """A fresh segment name owned by this process."""
        if self.tag is None:
            start = seg.proc_start_time(self.pid)
            self.tag = SegmentName(seg.pid_namespace(), self.pid, start or 0, 0)
        return str(dataclasses.replace(self.tag, seq=next(self.seq)))

    def owns_name(self, name: SegmentName) -> bool:
        """True if ``name`` was made by :meth:`new_name` in this process."""
        return self.tag is not None and name.base() == dataclasses.replace(
            self.tag, seq=name.seq
        )

    def writer_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self.pool_lock:
            if self.pool is None:
                self.pool = concurrent.futures.ThreadPoolExecutor(
                    MAX_WRITERS - 1, thread_name_prefix="shm-embeds-writer"
                )
            return self.pool

    def start_reaper(self, sweep_interval: float | None = None) -> None:
        """Start the thread that runs safe points (and sweeps, if asked) when idle."""
        if sweep_interval is not None:
            self.sweep_interval = sweep_interval
        if self.reaper is None:
            self.reaper = threading.Thread(
                target=_reaper_loop, args=(self,), name="shm-embeds-reaper", daemon=True
            )
            self.reaper.start()


def _on_release(state: _Process, key: tuple) -> None:
    """Finalizer: record that a tracked object died. Only records.

    Runs from garbage collection, on whatever thread dropped the last
    reference, possibly inside one of our locks: it must take no lock and
    do no I/O. ``deque.append`` is atomic. In a forked child the state is
    not the child's, so nothing is recorded there.
    """
    if state.pid == os.getpid():
        state.released.append(key)


def _reaper_loop(state: _Process) -> None:
    last_sweep = time.monotonic()
    while state.pid == os.getpid() and not state.shutdown_done:
        time.sleep(REAP_INTERVAL_S)
        try:
            state.owned.collect()
            if state.sweep_interval and time.monotonic() - last_sweep >= state.sweep_interval:
                last_sweep = time.monotonic()
                sweep_stale_segments(expected=True)
        except Exception:  # never let the reaper die on a transient error
            logger.debug("shm-embeds: reaper pass failed", exc_info=True)


# --------------------------------------------------------------------------
# counters


def set_role(role: str) -> None:
    """Record what this process is (``client``, ``engine``, ``worker``) for stats."""
    _state.roles.add(role)


def count(**deltas: int) -> None:
    """Add to this process's counters, e.g. ``count(hop2_shm_tensors=1)``.

    Counter names used: ``hop{1,2}_{shm,stock}_{tensors,bytes}``,
    ``hop1_adopted_tensors``, ``hop2_reused_tensors`` (sent without a copy),
    ``copied_bytes`` (bytes copied into segments), ``segments_created``,
    ``segments_unlinked``, ``fallback.<hop>.<reason>``. Never call it from a
    finalizer (it locks and writes a file).
    """
    state = _state
    with state.counters_lock:
        state.counters.update(deltas)
        snapshot = dict(state.counters)
        state.stats_version += 1
        version = state.stats_version
    stats_dir = os.environ.get("VLLM_SHM_EMBEDS_STATS_DIR")
    if stats_dir:
        # Threads race here; an older snapshot must never replace a newer one
        # (the file feeds /metrics, whose counters must not go down).
        with state.stats_lock:
            if version > state.stats_written:
                _write_stats(stats_dir, snapshot, sorted(state.roles))
                state.stats_written = version


def stats() -> dict[str, int]:
    """A copy of this process's counters (name -> count; bytes in bytes)."""
    state = _state
    with state.counters_lock:
        return dict(state.counters)


def _write_stats(stats_dir: str, snapshot: dict[str, int], roles: list[str]) -> None:
    pid = os.getpid()
    path = os.path.join(stats_dir, f"{pid}.json")
    tmp = f"{path}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"pid": pid, "roles": roles, "counters": snapshot}, f)
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
# owned segments


@dataclasses.dataclass
class _Owned:
    """One segment this process owns.

    Attributes:
        handle: its base handle (no broadcast fields).
        mm: a mapping whose first page is the header (reader flags).
        data_ptr: address of the data in this process's mapping of it
            (adopted segments), else None.
        source: the tensor that was copied into it (hop 2 copies), else None.
        fds: the files, held open while broadcasts are pending.
        broadcasts: ``(flag_base, readers)`` of broadcasts whose readers have
            not all set their flags.
        next_flag: first unused flag byte.
        released: the owner's tensor is gone; no new broadcast will come.
        handover: a streamed segment (binary body) that hop 1 may hand over
            to a peer by handle; never broadcast from here.
    """

    handle: SharedTensorHandle
    mm: mmap.mmap | None
    data_ptr: int | None = None
    source: weakref.ref | None = None
    fds: list[int] | None = None
    broadcasts: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    next_flag: int = 0
    released: bool = False
    handover: bool = False

    def close_fds(self) -> None:
        for fd in self.fds or ():
            os.close(fd)
        self.fds = None


class _OwnedSegments:
    """Segments this process owns, and when to unlink their names.

    A name is unlinked when every reader of every broadcast of it has set its
    flag (after at least one broadcast), or when the owner's tensor storage
    is freed and no broadcast is pending. All bookkeeping happens under
    ``_lock`` in ordinary code; finalizers only queue (:func:`_on_release`).
    """

    def __init__(self, state: _Process) -> None:
        self._state = state
        self._segs: dict[str, _Owned] = {}
        self._by_ptr: dict[int, str] = {}  # data address -> segment name
        self._lock = threading.Lock()

    # -- adding

    def add_mapped(self, handle: SharedTensorHandle, mm: mmap.mmap, tensor: torch.Tensor,
                   anchor: Any, handover: bool = False) -> None:
        """Own a segment mapped here as ``tensor``; released when its storage dies.

        ``anchor``: the buffer object the storage keeps alive
        (:func:`~vllm._shm_embeds_segments.tensor_view`). ``handover``: a
        streamed segment, for :meth:`hand_over`.
        """
        with self._lock:
            self._segs[handle.name] = _Owned(handle, mm, data_ptr=tensor.data_ptr(),
                                             handover=handover)
            self._by_ptr[tensor.data_ptr()] = handle.name
        weakref.finalize(anchor, _on_release, self._state, ("storage", handle.name))

    def add_copy(self, handle: SharedTensorHandle, mm: mmap.mmap, fds: list[int],
                 source: torch.Tensor) -> None:
        """Own a segment holding a copy of ``source`` (hop 2), fds held open."""
        with self._lock:
            self._segs[handle.name] = _Owned(
                handle, mm, source=weakref.ref(source), fds=fds, released=True
            )
            self._by_ptr[source.data_ptr()] = handle.name
        weakref.finalize(source, _on_release, self._state,
                         ("source", handle.name, source.data_ptr()))

    # -- safe points

    def _drain(self) -> list[_Owned]:
        """Apply the finalizers' records; return segments to unlink (lock held)."""
        gone = []
        released = self._state.released
        while released:
            key = released.popleft()
            name = key[1]
            entry = self._segs.get(name)
            if key[0] == "source":
                if self._by_ptr.get(key[2]) == name:
                    del self._by_ptr[key[2]]
                if entry is not None:
                    entry.source = None
                continue
            if entry is None:
                continue
            if entry.data_ptr is not None and self._by_ptr.get(entry.data_ptr) == name:
                del self._by_ptr[entry.data_ptr]
            entry.data_ptr = None
            entry.released = True
            if not entry.broadcasts:
                gone.append(self._pop(name))
        return gone

    def _pop(self, name: str) -> _Owned:
        entry = self._segs.pop(name)
        for ptr in [p for p, n in self._by_ptr.items() if n == name]:
            del self._by_ptr[ptr]
        return entry

    def _unlink(self, gone: list[_Owned]) -> None:
        """Close and unlink (outside the lock), then count."""
        n = 0
        for entry in gone:
            entry.close_fds()
            n += seg.unlink_segment(shm_dir(), entry.handle.name, len(entry.handle.parts()))
        if n:
            count(segments_unlinked=n)

    def collect(self) -> int:
        """Unlink names no reader needs any more; returns how many segments went."""
        if not self._segs and not self._state.released:
            return 0
        with self._lock:
            gone = self._drain()
            for name, entry in list(self._segs.items()):
                if not entry.broadcasts:
                    continue
                entry.broadcasts = [
                    (base, readers) for base, readers in entry.broadcasts
                    if b"\x00" in seg.read_flags(entry.mm, base, readers)
                ]
                if not entry.broadcasts:
                    gone.append(self._pop(name))
        self._unlink(gone)
        return len(gone)

    # -- hop 2

    def lookup(self, tensor: torch.Tensor) -> _Owned | None:
        """The segment already holding exactly ``tensor``'s bytes, if any."""
        with self._lock:
            gone = self._drain()
            name = self._by_ptr.get(tensor.data_ptr())
            entry = self._segs.get(name) if name is not None else None
            if entry is not None:
                h = entry.handle
                same = (
                    not entry.handover
                    and tensor.dtype == h.torch_dtype and tuple(tensor.shape) == h.shape
                    and (entry.data_ptr == tensor.data_ptr()
                         or (entry.source is not None and entry.source() is tensor))
                )
                if not same:
                    entry = None
        self._unlink(gone)
        return entry

    def begin_broadcast(self, entry: _Owned, readers: int) -> SharedTensorHandle | None:
        """Reserve flags and hold the files for one more broadcast of ``entry``.

        Returns the handle to send, or None if the segment cannot be reused
        (its name vanished, or its flag bytes are used up): the caller copies.
        """
        with self._lock:
            if self._segs.get(entry.handle.name) is not entry:
                return None
            if entry.next_flag + readers > MAX_READERS:
                return None
            if entry.fds is None:
                try:
                    entry.fds = seg.open_files(shm_dir(), entry.handle, reader=False)
                except ShmEmbedsError:
                    self._pop(entry.handle.name)
                    gone = [entry]
                else:
                    gone = None
                if gone:
                    logger.warning(
                        "shm-embeds: a prompt_embeds segment was removed by another "
                        "process before hop 2; copying it again"
                    )
                    count(**{"fallback.hop2.vanished": 1})
                    self._unlink(gone)
                    return None
            base = entry.next_flag
            entry.next_flag += readers
            entry.broadcasts.append((base, readers))
            files = tuple((fd, os.fstat(fd).st_ino) for fd in entry.fds)
        return dataclasses.replace(
            entry.handle, flag_base=base, owner_pid=os.getpid(), owner_files=files
        )

    # -- hop 1 (streamed segments)

    def handover_entry(self, tensor: torch.Tensor) -> _Owned | None:
        """The streamed segment that is exactly ``tensor`` (lock held by caller or not)."""
        name = self._by_ptr.get(tensor.data_ptr())
        entry = self._segs.get(name) if name is not None else None
        if (entry is None or not entry.handover or entry.data_ptr != tensor.data_ptr()
                or tensor.dtype != entry.handle.torch_dtype
                or tuple(tensor.shape) != entry.handle.shape or not tensor.is_contiguous()):
            return None
        return entry

    def hand_over(self, tensor: torch.Tensor) -> SharedTensorHandle | None:
        """Give up a streamed segment to a peer; its handle, or None if not one."""
        with self._lock:
            gone = self._drain()
            entry = self.handover_entry(tensor)
            if entry is not None:
                self._pop(entry.handle.name)
        self._unlink(gone)
        return entry.handle if entry is not None else None

    def release(self, tensor: torch.Tensor) -> bool:
        """Unlink the streamed segment that is ``tensor`` now (not handed over)."""
        with self._lock:
            entry = self.handover_entry(tensor)
            if entry is not None:
                self._pop(entry.handle.name)
        if entry is None:
            return False
        self._unlink([entry])
        return True

    # -- whole process

    def pending(self, handover_only: bool = False) -> int:
        with self._lock:
            return sum(1 for e in self._segs.values() if e.handover or not handover_only)

    def unlink_all(self) -> int:
        """Unlink every name this process still owns (shutdown), also un-adopted
        hop-1 segments it created. Returns how many segments went."""
        with self._lock:
            gone = list(self._segs.values())
            self._segs.clear()
            self._by_ptr.clear()
        n = 0
        for entry in gone:
            entry.close_fds()
            n += seg.unlink_segment(shm_dir(), entry.handle.name, len(entry.handle.parts()))
        for name, parsed in seg.list_segments(shm_dir()):
            if self._state.owns_name(parsed) and seg.unlink_quietly(os.path.join(shm_dir(), name)):
                n += parsed.part == 0
        if n:
            count(segments_unlinked=n)
        return n


_state = _Process()  # replaced as a whole in a forked child


def _after_fork_in_child() -> None:
    # A forked child (e.g. a TP worker under the fork start method) owns
    # none of its parent's segments: fresh state, no threads, no counters.
    global _state
    _state = _Process()  # replaced as a whole in a forked child


# --------------------------------------------------------------------------
# public operations


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


def _create_segment(tensor: torch.Tensor) -> tuple[SharedTensorHandle, list[int]]:
    """Copy ``tensor`` into a new segment of this process (one copy, counted).

    Returns the handle and the open descriptors of its files (the caller
    closes them). Raises OSError (e.g. ENOSPC); nothing is left behind then.
    """
    state = _state
    handle = SharedTensorHandle(
        state.new_name(),
        seg.dtype_name(tensor.dtype),
        tuple(tensor.shape),
        seg.split_for(tensor.nbytes, writers()),
    )
    data = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
    pool = state.writer_pool() if handle.split else None
    fds = seg.write_segment(shm_dir(), handle, data, pool)
    count(segments_created=1, copied_bytes=tensor.nbytes)
    return handle, fds


def share_tensor(tensor: torch.Tensor) -> SharedTensorHandle:
    """Copy ``tensor`` into a new segment and hand its ownership to the caller's peer.

    Used by hop 1 senders: the segment is *not* tracked here (the receiver
    adopts it with :func:`adopt_tensor`); if no peer adopts it,
    :func:`discard_shared`, :func:`shutdown` or a later sweep removes it.
    One copy of ``tensor.nbytes`` bytes.

    Args:
        tensor: dense, CPU, C-contiguous tensor of any dtype and shape.
    Raises:
        OSError: the segment could not be created (e.g. ENOSPC).
    """
    handle, fds = _create_segment(tensor)
    for fd in fds:
        os.close(fd)
    return handle


def discard_shared(handle: SharedTensorHandle) -> bool:
    """Remove a segment made by :func:`share_tensor` that will never be adopted
    (encode or send failed). True if it was still there."""
    gone = seg.unlink_segment(shm_dir(), handle.name, len(handle.parts()))
    if gone:
        count(segments_unlinked=1)
    return gone


def adopt_tensor(handle: SharedTensorHandle) -> torch.Tensor:
    """Take ownership of a peer's segment and map it as a tensor (no copy).

    The segment is atomically renamed to this process's name, so a crash of
    either side leaves it attributable. The returned tensor is remembered, so
    :func:`externalize` sends it onwards (hop 2) without copying it again;
    the name is unlinked when its storage is freed before any broadcast.

    Returns:
        tensor of ``handle.dtype`` and ``handle.shape`` backed by the segment.
    Raises:
        ShmEmbedsError: missing segment, wrong size or header.
    """
    state = _state
    mine = handle.renamed(state.new_name())
    nparts = len(handle.parts())
    directory = shm_dir()
    for i in range(nparts):
        try:
            os.rename(os.path.join(directory, seg.part_name(handle.name, i)),
                      os.path.join(directory, seg.part_name(mine.name, i)))
        except FileNotFoundError as e:
            seg.unlink_segment(directory, mine.name, i)  # the parts already taken
            seg.unlink_segment(directory, handle.name, nparts)
            raise ShmEmbedsError(
                f"shm-embeds segment {seg.part_name(handle.name, i)!r} not found in "
                f"{directory}: the sender is on another host, or something removed it"
            ) from e
    try:
        mm = seg.map_segment(directory, mine)
    except BaseException:
        seg.unlink_segment(directory, mine.name, nparts)
        raise
    tensor, anchor = seg.tensor_view(mm, mine)
    state.owned.add_mapped(mine, mm, tensor, anchor)
    return tensor


def open_tensor(handle: SharedTensorHandle, reader_index: int | None = None) -> torch.Tensor:
    """Map a segment as a tensor (reader side, no copy) and set the reader's flag.

    The mapping is read-only: an in-place write to the tensor faults. The
    files are opened through the owner's descriptors when the handle carries
    them (hop 2), else by name.

    Args:
        handle: from the owner.
        reader_index: 0-based index of this reader among the broadcast's
            readers, or None not to mark.
    Returns:
        tensor of ``handle.dtype``/``handle.shape``; it stays valid after the
        owner unlinks the name, until the tensor is freed.
    Raises:
        ShmEmbedsError: missing segment, wrong size or header, bad index.
    """
    if reader_index is not None and not 0 <= handle.flag_base + reader_index < MAX_READERS:
        raise ShmEmbedsError(f"reader index {reader_index} out of range")
    mm = seg.map_segment(shm_dir(), handle, reader_index)
    return seg.tensor_view(mm, handle)[0]


def externalize(tensor: torch.Tensor, readers: int) -> SharedTensorHandle:
    """Handle for ``tensor`` to broadcast to ``readers`` local readers (hop 2).

    A tensor that already lives in a segment this process owns (adopted at
    hop 1, or sent before and still linked) is sent without a copy; any other
    tensor is copied once into a new segment. This broadcast gets reader
    flags of its own, and the name is unlinked once all its readers (and
    those of any other pending broadcast of it) have mapped it
    (:func:`collect`).

    Raises:
        OSError: a new segment could not be created; the caller keeps the
            stock path.
        ValueError: ``readers`` exceeds :data:`MAX_READERS`.
    """
    if not 0 < readers <= MAX_READERS:
        raise ValueError(f"readers must be in 1..{MAX_READERS}, got {readers}")
    owned = _state.owned
    entry = owned.lookup(tensor)
    handle = owned.begin_broadcast(entry, readers) if entry is not None else None
    if handle is not None:
        count(hop2_reused_tensors=1)
        return handle
    new, fds = _create_segment(tensor)
    try:
        mm = mmap.mmap(fds[0], HEADER_BYTES, flags=mmap.MAP_SHARED)
    except BaseException:
        for fd in fds:
            os.close(fd)
        seg.unlink_segment(shm_dir(), new.name, len(new.parts()))
        raise
    owned.add_copy(new, mm, fds, tensor)
    entry = owned.lookup(tensor)
    assert entry is not None
    handle = owned.begin_broadcast(entry, readers)
    assert handle is not None
    return handle


def collect() -> int:
    """Safe point: apply finalizer records and unlink the names no reader needs.

    Cheap when nothing is pending; called once per broadcast and by the
    reaper thread. Returns the number of segments unlinked.
    """
    return _state.owned.collect()


def pending_segments() -> int:
    """Number of segment names this process owns and has not unlinked yet."""
    return _state.owned.pending()


def start_engine_reaper() -> None:
    """EngineCore: run safe points when idle, and sweep dead owners' segments
    every :data:`SWEEP_INTERVAL_S` seconds (e.g. a SIGKILLed API server's
    un-adopted one), so that memory comes back without a restart."""
    _state.start_reaper(sweep_interval=SWEEP_INTERVAL_S)


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
                count(**{"fallback.hop2.map_failed": 1})
                if first is None:
                    first = e if isinstance(e, ShmEmbedsError) else ShmEmbedsError(str(e))
                continue
            count(hop2_shm_tensors=1, hop2_shm_bytes=handle.nbytes)
            n += 1
    if first is not None:
        raise first
    return n


def _placement_failed(hop: str, tensor: torch.Tensor, e: OSError) -> str:
    """Log why a segment could not be created; returns the fallback reason.

    ``no_space`` (ENOSPC: the segment directory is full or too small) is
    logged as a warning once per server: the first process that hits it
    creates :data:`NO_SPACE_MARKER` in ``VLLM_SHM_EMBEDS_STATS_DIR`` (once per
    process when that is unset). Other errors (``os_error``) warn once per
    process. Later ones are logged at debug level.
    """
    state = _state
    no_space = e.errno == errno.ENOSPC
    first = not state.placement_warned
    state.placement_warned = True
    if first and no_space:
        first = _first_in_server(NO_SPACE_MARKER)
    (logger.warning if first else logger.debug)(
        "shm-embeds: could not place %d bytes of prompt_embeds in %s (%s); %s uses "
        "the stock path for such tensors%s (further failures are logged at debug "
        "level and counted in vllm:shm_embeds_fallbacks_total)",
        tensor.nbytes,
        shm_dir(),
        e,
        hop,
        f" while they do not fit ({_free_bytes()} bytes free now): make the directory "
        "larger (Docker: --shm-size); the start-up log says how large" if no_space else "",
    )
    return "no_space" if no_space else "os_error"


def _first_in_server(marker: str) -> bool:
    """True for the first process of this server to claim ``marker`` (a file in
    ``VLLM_SHM_EMBEDS_STATS_DIR``); True when that is unset or unusable."""
    stats_dir = os.environ.get("VLLM_SHM_EMBEDS_STATS_DIR")
    if not stats_dir:
        return True
    try:
        os.close(os.open(os.path.join(stats_dir, marker), os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def _free_bytes() -> int:
    """Free bytes of the segment directory's file system (-1 if unknown)."""
    try:
        st = os.statvfs(shm_dir())
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


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
    Segments made for a message are remembered until :meth:`take_created`,
    so that the caller can remove them if encoding or sending fails.
    """

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self._armed: torch.Tensor | None = None
        self._created: list[SharedTensorHandle] = []

    def arm(self, tensor: torch.Tensor | None) -> None:
        """Mark the tensor to send through shm in the next encoded message."""
        self._armed = tensor

    def take_created(self) -> list[SharedTensorHandle]:
        """Handles of the segments created since the last call (and forget them)."""
        created, self._created = self._created, []
        return created

    def new_message(self) -> None:
        if self.inner is not None:
            self.inner.new_message()

    def __call__(self, tensor: torch.Tensor) -> dict | None:
        if tensor is self._armed:
            self._armed = None
            # A streamed segment (binary body) goes as it is, whatever its size.
            handover = take_handover(tensor)
            reason = None if handover is not None else eligible(tensor)
            if reason is None:
                try:
                    handle = handover or share_tensor(tensor)
                except OSError as e:
                    reason = _placement_failed("hop 1", tensor, e)
                else:
                    self._created.append(handle)
                    count(hop1_shm_tensors=1, hop1_shm_bytes=tensor.nbytes)
                    meta = handle.to_meta()
                    if handover is not None:  # digests our own code computed
                        from vllm._shm_embeds_hashing import handover_meta
                        meta.update(handover_meta(tensor))
                    return {META_KEY: meta}
            count(hop1_stock_tensors=1, hop1_stock_bytes=_nbytes(tensor))
            count(**{f"fallback.hop1.{reason}": 1})
        return self.inner(tensor) if self.inner is not None else None


ADOPT_FAILED_MESSAGE = (
    "prompt_embeds could not be read from shared memory (the segment was removed "
    "before the engine received the request); please retry"
)


class HandleOOBProvider:
    """Receiver side of hop 1: adopts segments named in OOB tensor metadata.

    Duck-types vLLM's ``OOBTensorProvider`` (``(dtype, shape, meta) ->
    tensor``). Metadata without our key goes to ``inner``. A handle that cannot
    be adopted yields an empty tensor that :func:`is_failed` recognizes, so the
    caller can reject the request instead of crashing its input thread.
    """

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self._failed: dict[int, weakref.ref] = {}

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
            logger.warning("shm-embeds: rejecting a request's prompt_embeds: %s", e)
            count(**{"fallback.hop1.adopt_failed": 1})
            tensor = torch.empty(0)
            self._failed[id(tensor)] = weakref.ref(tensor)
            # dict.pop takes no lock: safe in a finalizer.
            weakref.finalize(tensor, self._failed.pop, id(tensor), None)
            return tensor
        count(
            hop1_shm_tensors=1, hop1_shm_bytes=handle.nbytes, hop1_adopted_tensors=1
        )
        from vllm._shm_embeds_hashing import adopt_meta  # prefix-cache digests
        adopt_meta(tensor, meta[META_KEY])
        return tensor

    def is_failed(self, tensor: Any) -> str | None:
        """A client-safe error message if ``tensor`` stands for a handle that
        could not be adopted (no segment name or path in it), else None."""
        ref = self._failed.get(id(tensor))
        if ref is None or ref() is not tensor:
            return None
        return ADOPT_FAILED_MESSAGE


# --------------------------------------------------------------------------
# streamed segments: tensors written from a byte stream (binary request
# bodies, vllm._shm_embeds_binary), handed over at hop 1 by handle


class StreamedSegment:
    """A one-file segment that an HTTP body is written into, chunk by chunk.

    Created empty at its final size (``ftruncate``: no memory is used until
    bytes arrive), then filled in order with :meth:`write` (``pwrite`` at
    increasing offsets: one kernel copy from the caller's buffer into the
    tmpfs pages; ENOSPC is an ``OSError``, never a SIGBUS). :meth:`finish`
    maps it and returns the tensor; the segment stays owned by this process
    until :func:`take_handover` passes it to a peer (hop 1, by handle, no
    copy). It is unlinked when the tensor's storage is freed before that
    (next safe point), by :func:`release_streamed`, or by :meth:`abort`.
    The caller must have validated ``shape`` and ``dtype`` against its own
    limits before creating one.

    Args:
        dtype: element type of the bytes that will be written.
        shape: tensor shape, e.g. ``(num_tokens, hidden_size)``.
    Raises:
        OSError: the file could not be created or sized (nothing is left).
    """

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.handle = SharedTensorHandle(_state.new_name(), seg.dtype_name(dtype), tuple(shape))
        self.nbytes = self.handle.nbytes
        self.filled = 0
        self._path = os.path.join(shm_dir(), self.handle.name)
        self._fd: int | None = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            seg.pwrite_all(self._fd, memoryview(seg.MAGIC.ljust(HEADER_BYTES, b"\0")), 0)
            os.ftruncate(self._fd, HEADER_BYTES + self.nbytes)
        except BaseException:
            self.abort()
            raise
        count(segments_created=1)

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data`` (at most the bytes still missing).

        Raises:
            ValueError: more bytes than the segment holds.
            OSError: e.g. ENOSPC (the caller aborts).
        """
        if self._fd is None:
            raise ShmEmbedsError("segment already finished or aborted")
        if self.filled + len(data) > self.nbytes:
            raise ValueError("more bytes than the segment holds")
        seg.pwrite_all(self._fd, memoryview(data), HEADER_BYTES + self.filled)
        self.filled += len(data)

    def finish(self, writable: bool = True) -> torch.Tensor:
        """Map the filled segment; returns the segment-backed tensor.

        Counts the bytes written as ``copied_bytes`` (the one copy).
        ``writable=False`` maps it read-only (a write through the tensor
        faults): for bytes that were hashed as they were written.
        Raises:
            ShmEmbedsError: not every byte was written (the segment is removed).
        """
        if self._fd is None or self.filled != self.nbytes:
            self.abort()
            raise ShmEmbedsError(f"segment holds {self.filled} of {self.nbytes} bytes")
        try:
            mm = seg.map_files([self._fd], [HEADER_BYTES + self.nbytes],
                               mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        except BaseException:
            self.abort()
            raise
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        count(copied_bytes=self.nbytes)
        tensor, anchor = seg.tensor_view(mm, self.handle)
        _state.owned.add_mapped(self.handle, mm, tensor, anchor, handover=True)
        _state.start_reaper()  # unlinks it soon if its storage dies unsent
        return tensor

    def abort(self) -> None:
        """Close and unlink (idempotent); counts the bytes written so far as copied."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if self.filled:
                count(copied_bytes=self.filled)
        if seg.unlink_quietly(self._path):
            count(segments_unlinked=1)


def streamed_tensor_like(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A new writable segment-backed tensor (for a dtype conversion into shm).

    The caller fills it (e.g. ``out.copy_(src)``; counted here as
    ``copied_bytes``); it is handed over or unlinked like a streamed one.
    Raises OSError (nothing left) if the segment cannot be created.
    """
    streamed = StreamedSegment(dtype, shape)
    streamed.filled = streamed.nbytes  # filled by the caller through the mapping
    return streamed.finish()


def is_streamed(tensor: Any) -> bool:
    """True if ``tensor`` covers exactly a streamed segment not yet handed over."""
    return isinstance(tensor, torch.Tensor) and _state.owned.handover_entry(tensor) is not None


def take_handover(tensor: Any) -> SharedTensorHandle | None:
    """Hop 1 sender: the handle of ``tensor``'s streamed segment, ownership passed on.

    If ``tensor`` (same data pointer, dtype and shape) is a streamed segment
    this process owns, it leaves this process's books (the peer adopts it by
    ``rename``, exactly as a :func:`share_tensor` segment) and its handle is
    returned: no copy. Otherwise None (the caller copies as usual).
    """
    if not isinstance(tensor, torch.Tensor):
        return None
    handle = _state.owned.hand_over(tensor)
    if handle is not None:
        count(hop1_handover_tensors=1)
    return handle


def release_streamed(tensor: Any) -> bool:
    """Unlink the streamed segment behind ``tensor`` now, if not handed over.

    For a request that ends (rejected, failed, disconnected) before hop 1
    took its segment; True if this call unlinked it.
    """
    if not isinstance(tensor, torch.Tensor):
        return False
    return _state.owned.release(tensor)


def streamed_pending() -> int:
    """Streamed segments this process still owns (not handed over, not released)."""
    return _state.owned.pending(handover_only=True)


# --------------------------------------------------------------------------
# process lifetime


def sweep_stale_segments(expected: bool = False) -> int:
    """Unlink segments in :func:`shm_dir` whose owner process is certainly gone.

    Only names of this PID namespace whose owner no longer exists (or is a
    zombie, or has another start time) are removed; an owner that may be
    alive keeps its segments (:func:`~vllm._shm_embeds_segments.owner_is_dead`).
    ``expected=True`` (a parent cleaning up after children it just stopped,
    the EngineCore's periodic sweep) logs at info instead of warning level.
    Returns the number removed.
    """
    removed = seg.sweep(shm_dir(), seg.pid_namespace())
    if removed:
        (logger.info if expected else logger.warning)(
            "shm-embeds: removed %d stale segment(s) of dead processes from %s",
            removed,
            shm_dir(),
        )
        count(segments_swept=removed)
    return removed


def shutdown() -> None:
    """Unlink this process's remaining segments and log its counters once."""
    state = _state
    n = state.owned.unlink_all()
    if state.shutdown_done:
        return
    state.shutdown_done = True
    snapshot = stats()
    if snapshot:
        logger.info(
            "shm-embeds summary (pid %d, %s): %s%s",
            os.getpid(),
            "/".join(sorted(state.roles)) or "?",
            ", ".join(f"{k}={v}" for k, v in sorted(snapshot.items())),
            f"; unlinked {n} segment(s) at exit" if n else "",
        )


atexit.register(shutdown)
os.register_at_fork(after_in_child=_after_fork_in_child)
