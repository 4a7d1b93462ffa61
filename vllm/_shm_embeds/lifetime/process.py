# SPDX-License-Identifier: Apache-2.0
"""Per-process state (:class:`Process`, replaced in a forked child), exit, the reaper
thread, the sweep of dead owners' segments (:func:`sweep_stale_segments`)."""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import os
import secrets
import threading
import time
import weakref
from typing import Any

from vllm.logger import init_logger

from vllm._shm_embeds import counters, private_dir
from vllm._shm_embeds.config import MAX_WRITERS, enabled, max_segments, shm_dir, stats_dir
from vllm._shm_embeds.counters import Event, count
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.files import segment_dir
from vllm._shm_embeds.files.census import Census
from vllm._shm_embeds.handle import SegmentName
from vllm._shm_embeds.lifetime.owned import OwnedSegments
from vllm._shm_embeds.procfs import pid_namespace, proc_start_time, proc_stat

logger = init_logger(__name__)

NO_SPACE_MARKER = "no_space.warned"  # in the stats dir: the server warned of ENOSPC
EXIT_WAIT_S = 2.0  # at exit: how long to wait for force-killed children before sweeping
SWEEP_INTERVAL_S = 10.0  # EngineCore: sweep dead owners' segments this often
REAP_INTERVAL_S = 0.1  # reaper thread: safe point this often


class Process:
    """Everything this process knows about shm-embeds.

    Attributes:
        released: finalizers' records, applied at safe points.
        holders: extensions' registries of memfds whose mapped bytes never change
            (regions, kept conversations): ``send_view``, ``settle``, ``release``
            (optional); ``ext/held`` asks them ``find`` and ``is_held``.
        release_known: vLLM tells when a request is freed (group ``release`` on).
        stats_dir_made: the metrics directory this process made (removed at exit).
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.released: collections.deque = collections.deque()
        self.owned = OwnedSegments(self)
        self.censuses: dict[str, Census] = {}
        self.tag: SegmentName | None = None
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.pool_lock = threading.Lock()
        self.reaper: threading.Thread | None = None
        self.sweep_interval: float | None = None
        self.placement_warned = False
        self.shutdown_done = False
        self.holders: list[Any] = []
        self.release_known = True
        self.model_name = ""
        self.stats_dir_made: str | None = None

    def forked(self) -> Process:
        """A forked child's state: new, but for what describes the server."""
        child = Process()
        child.release_known = self.release_known
        child.model_name = self.model_name
        return child

    def census(self, directory: str) -> Census:
        with self.pool_lock:
            if directory not in self.censuses:
                self.censuses[directory] = Census(directory)
            return self.censuses[directory]

    def new_name(self, capped: bool = True) -> str:
        """A fresh segment name, with a random 64-bit sequence number so that no other user
        can plant a file at it. ``capped``: :meth:`check_segments` first."""
        if capped:
            self.check_segments()
        if self.tag is None:
            try:
                start = proc_start_time(self.pid)
            except ValueError:  # 0: "unknown", a sweep then judges by the pid alone
                start = None
            self.tag = SegmentName(pid_namespace(), self.pid, start or 0, 0)
        return str(dataclasses.replace(self.tag, seq=secrets.randbits(64)))

    def check_segments(self) -> None:
        """Raise ``segment.TooManySegments`` at ``config.MAX_SEGMENTS`` live segments."""
        limit = max_segments()
        if self.owned.live() >= limit:
            raise seg.TooManySegments(limit)

    def owns_name(self, name: SegmentName) -> bool:
        return self.tag is not None and name.base() == dataclasses.replace(self.tag,
                                                                           seq=name.seq)

    def writer_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self.pool_lock:
            if self.pool is None:
                self.pool = concurrent.futures.ThreadPoolExecutor(
                    MAX_WRITERS - 1, thread_name_prefix="shm-embeds-writer")
            return self.pool

    def start_reaper(self, sweep_interval: float | None = None) -> None:
        if sweep_interval is not None:
            self.sweep_interval = sweep_interval
        if self.reaper is None:
            self.reaper = threading.Thread(target=_reaper_loop, args=(self,),
                                           name="shm-embeds-reaper", daemon=True)
            self.reaper.start()


def _reaper_loop(state: Process) -> None:
    last_sweep = time.monotonic()
    while state.pid == os.getpid() and not state.shutdown_done:
        time.sleep(REAP_INTERVAL_S)
        try:
            state.owned.collect()
            for holder in state.holders:  # held files freed once their sends are done
                holder.settle()
            if state.sweep_interval and time.monotonic() - last_sweep >= state.sweep_interval:
                last_sweep = time.monotonic()
                sweep_stale_segments(expected=True)
        except Exception:  # never let the reaper die on a transient error
            logger.debug("shm-embeds: reaper pass failed", exc_info=True)


_state = Process()  # replaced as a whole in a forked child


def current() -> Process:
    return _state


def _after_fork_in_child() -> None:
    global _state
    _state = _state.forked()


def collect() -> int:
    return _state.owned.collect()


def pending_segments() -> int:
    return _state.owned.pending()


def start_engine_reaper() -> None:
    """EngineCore: safe points when idle, a dead owners' sweep every :data:`SWEEP_INTERVAL_S`."""
    _state.start_reaper(sweep_interval=SWEEP_INTERVAL_S)


def placement_failed(hop: str, nbytes: int, e: OSError) -> str:
    """Log why a segment could not be created; the fallback reason. ENOSPC warns once per
    server (:data:`NO_SPACE_MARKER`), others once per process."""
    state = _state
    reason = seg.fallback_reason(e)
    no_space = reason == "no_space"
    first = not state.placement_warned
    state.placement_warned = True
    if first and no_space:
        first = _first_in_server(NO_SPACE_MARKER)
    (logger.warning if first else logger.debug)(
        "shm-embeds: could not place %d bytes of prompt_embeds in %s (%s); %s uses "
        "the stock path for such tensors%s (further failures are logged at debug "
        "level and counted in vllm:shm_embeds_fallbacks_total)",
        nbytes, shm_dir(), e, hop,
        f" while they do not fit ({segment_dir.free_bytes(shm_dir())} bytes free now): "
        "make the directory larger (Docker: --shm-size); the start-up log says how large"
        if no_space else "",
    )
    return reason


def _first_in_server(marker: str) -> bool:
    """True for the first process to create ``marker`` in the stats dir (or if none)."""
    directory = stats_dir()
    if not directory:
        return True
    try:
        os.close(os.open(os.path.join(directory, marker), os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as e:  # made by another process first, or cannot tell (True)
        return not isinstance(e, FileExistsError)
    return True


def sweep_stale_segments(expected: bool = False) -> int:
    """Unlink segments of certainly dead owners; how many (``expected``: log at info)."""
    removed = segment_dir.sweep(shm_dir(), pid_namespace())
    if removed:
        (logger.info if expected else logger.warning)(
            "shm-embeds: removed %d stale segment(s) of dead processes from %s",
            removed, shm_dir())
        count(Event.SEGMENTS_SWEPT, removed)
    return removed


def shutdown() -> None:
    """Unlink this process's remaining segments; log its counters once."""
    state = _state
    n = state.owned.unlink_all()
    if state.shutdown_done:
        return
    state.shutdown_done = True
    snapshot = counters.stats()
    if snapshot:
        logger.info(
            "shm-embeds summary (pid %d, %s): %s%s", os.getpid(),
            "/".join(counters.roles()) or "?",
            ", ".join(f"{k}={v}" for k, v in sorted(snapshot.items())),
            f"; unlinked {n} segment(s) at exit" if n else "")


def _at_exit() -> None:
    """Unlink what we own, then sweep what force-killed children left."""
    shutdown()
    if enabled():
        try:
            sweep_stale_segments(expected=True)
            # vllm serve kills its EngineCores without waiting: wait a moment for them
            deadline = time.monotonic() + EXIT_WAIT_S
            waited = False
            while _children_holding_segments() and time.monotonic() < deadline:
                waited = True
                time.sleep(0.05)
            if waited:
                sweep_stale_segments(expected=True)
        except (OSError, ValueError):
            pass


def _children_holding_segments() -> set[int]:
    """Pids of this process's live children that own a segment in :func:`shm_dir`."""
    me, ns, out = os.getpid(), pid_namespace(), set()
    for _, parsed in segment_dir.list_segments(shm_dir()):
        if parsed.pidns == ns and parsed.pid != me and parsed.pid not in out:
            stat = proc_stat(parsed.pid)  # None: gone or a zombie (dead)
            if stat is not None and int(stat[1]) == me:
                out.add(parsed.pid)
    return out


atexit.register(_at_exit)
# Runs at exit (``_at_exit`` lives as long as this module), after vLLM's own finalizers
# stop the engines (newest first; this one is made at plugin load): docs/design.md.
_PRIVATE_DIR_REMOVAL = weakref.finalize(_at_exit, private_dir.remove_made)
os.register_at_fork(after_in_child=_after_fork_in_child)
