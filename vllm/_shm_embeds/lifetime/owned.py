# SPDX-License-Identifier: Apache-2.0
"""The books of the segments one process owns: a name stays until every reader of every
broadcast set its flag *and* the request is done with it here. Finalizers only record
(:func:`on_release`); the work is done at the next safe point (``collect``)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from vllm.logger import init_logger

from vllm._shm_embeds.config import shm_dir
from vllm._shm_embeds.counters import Event, count, count_reason
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.files import segment_dir
from vllm._shm_embeds.handle import MAX_READERS, SegmentName, SharedTensorHandle, ShmEmbedsError
from vllm._shm_embeds.lifetime.lifecycle import (BROADCAST, DRAINING, FREED, GONE, HELD, MAPPED,
                                                 Index, Kind, OwnedSegment, SendDone,
                                                 SourceDied, State, StorageDied)

logger = init_logger(__name__)


class ProcessState(Protocol):
    """What the books need of their process (``process.Process``)."""

    pid: int
    released: collections.deque
    release_known: bool

    def owns_name(self, name: SegmentName) -> bool: ...


def on_release(state: ProcessState, record: StorageDied | SourceDied | SendDone) -> None:
    """Finalizer: record only (no lock, no I/O: it may run inside one of our locks)."""
    if state.pid == os.getpid():
        state.released.append(record)


def _settles(verb: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(verb)
    def settling(self: OwnedSegments, *args: Any, **kwargs: Any) -> Any:
        with self._settling:
            return verb(self, *args, **kwargs)

    return settling


class OwnedSegments:
    def __init__(self, state: ProcessState) -> None:
        self._state = state
        self._index = Index()
        self._lock = threading.Lock()
        # Held across unlinks (before ``_lock``): a verb returns once every unlink is done.
        self._settling = threading.RLock()
        self._streams: set = set()  # an extension's streamed files being filled
        self._drained: list[OwnedSegment] = []  # pages to drop at the end of ``collect``

    def own(self, kind: Kind, handle: SharedTensorHandle, mm: mmap.mmap,
            tensor: torch.Tensor, anchor: Any = None, fds: list[int] | None = None) -> None:
        """Own a segment: ``tensor`` maps it (``anchor``: the buffer its storage keeps
        alive), or for a ``COPY`` is the tensor copied into it. ``fds``: kept open."""
        ptr = tensor.data_ptr()
        if kind is Kind.COPY:
            entry = OwnedSegment(handle, mm, kind, ptr, source=weakref.ref(tensor), fds=fds)
            watched, record = tensor, SourceDied(handle.name, ptr)
        else:
            entry = OwnedSegment(handle, mm, kind, ptr, data_ptr=ptr, fds=fds)
            watched, record = anchor, StorageDied(handle.name)
        with self._lock:
            self._index.move(entry, "own", HELD)
        weakref.finalize(watched, on_release, self._state, record)

    def _apply_records(self) -> list[OwnedSegment]:
        """Apply the finalizers' records; the segments to unlink (lock held)."""
        gone = []
        index, records = self._index, self._state.released
        while records:
            record = records.popleft()
            entry = index.get(record.name)
            if isinstance(record, SendDone):
                if entry is not None:
                    entry.sends -= 1
                    if (entry.state is DRAINING and not entry.sends
                            and index.move(entry, "sent", GONE)):
                        self._drained.append(entry)
                continue
            if isinstance(record, SourceDied):
                index.unkey(record.ptr, record.name)
                if entry is None or entry.state in (MAPPED, DRAINING):
                    continue
                entry.source = None
            elif entry is None or entry.state is DRAINING:
                continue  # (the send views have storages of their own)
            elif entry.state is MAPPED:
                index.move(entry, "die", GONE)
                continue
            else:
                index.unkey(entry.data_ptr, record.name)
                entry.data_ptr = None
            if entry.data_ptr is None and not entry.broadcasts:
                if index.move(entry, "die", GONE):
                    gone.append(entry)
            else:
                index.move(entry, "die", entry.state)
        return gone

    def _unlink(self, gone: list[OwnedSegment]) -> int:
        """Close and unlink (lock not held), count; how many names were still there."""
        n = 0
        for entry in gone:
            entry.close_fds()
            try:
                directory = shm_dir()
            except OSError:  # the directory is gone (removed by someone), its files with it
                continue
            if seg.unlink_segment(directory, entry.handle.name, len(entry.handle.parts())):
                n += 1
                if entry.kind is not Kind.HELD_FILE:
                    self._state.census(directory).unlinked(entry.handle.nbytes)
        if n:
            count(Event.SEGMENTS_UNLINKED, n)
        return n

    def _drop(self, entry: OwnedSegment) -> bool:
        """Drop our pages of ``entry`` (lock not held); False: they go with the tensor."""
        try:
            seg.drop_pages(entry.mm)
        except OSError as e:
            logger.debug("shm-embeds: could not drop a finished request's pages: %s", e)
            return False
        return True

    def _finish(self, entry: OwnedSegment) -> State:
        """A request's end: ``DRAINING`` while a zero-copy send may read it."""
        return DRAINING if entry.sends else GONE

    @_settles
    def collect(self) -> int:
        """Safe point: unlink the names no reader or request needs; how many went."""
        if not self._index and not self._state.released:
            return 0
        idle_fds: list[int] = []
        known = self._state.release_known
        with self._lock:
            gone = self._apply_records()
            for entry in self._index.linked():
                if not entry.broadcasts:
                    continue
                entry.settle()
                if entry.broadcasts:
                    continue
                if entry.in_use(known):  # the TP workers map it until the request ends
                    if not self._index.move(entry, "settle", HELD):
                        continue
                    if entry.fds and not entry.handle.unnamed_data:  # reopened by name if re-sent
                        idle_fds += entry.fds
                        entry.fds = None
                    continue
                # still mapped here: dropped now if vLLM freed the request meanwhile
                mapped = entry.data_ptr is not None and entry.state is not FREED
                freed = entry.data_ptr is not None and not mapped
                to = MAPPED if mapped else self._finish(entry) if freed else GONE
                if self._index.move(entry, "settle", to):
                    gone.append(entry)
                    if freed and to is GONE:
                        self._drained.append(entry)
            drained, self._drained = self._drained, []
        for fd in idle_fds:
            os.close(fd)
        self._unlink(gone)
        for entry in drained:
            if self._drop(entry) and entry.kind is not Kind.STREAMED:
                count(Event.ENGINE_PAGES_RELEASED)
        return len(gone)

    def send_view(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A view of ``tensor`` with a storage of its own that keeps the pages until freed,
        or None if no mapping here holds it. For vLLM's ``copy=False`` frames
        (``MessageQueue.enqueue``, ``_send_input``; 0.32)."""
        with self._lock:
            entry = self._index.containing(tensor)
            if entry is None:
                return None
            view, anchor = seg.view_within(entry.mm, tensor)
            entry.sends += 1
        weakref.finalize(anchor, on_release, self._state, SendDone(entry.handle.name))
        return view

    # -- hop 2

    @_settles
    def lookup(self, tensor: torch.Tensor) -> OwnedSegment | None:
        """The segment already holding exactly ``tensor``'s bytes, if any."""
        with self._lock:
            gone = self._apply_records()
            entry = self._index.at(tensor.data_ptr())
            if entry is not None:
                h = entry.handle
                same = (
                    entry.kind is not Kind.STREAMED and entry.state is not FREED
                    and tensor.dtype == h.torch_dtype and tuple(tensor.shape) == h.shape
                    and (entry.data_ptr == tensor.data_ptr()
                         or (entry.source is not None and entry.source() is tensor))
                )
                if not same:
                    entry = None
        self._unlink(gone)
        return entry

    @_settles
    def broadcast(self, entry: OwnedSegment, readers: int) -> SharedTensorHandle | None:
        """Reserve flags for one more broadcast of ``entry``: the handle to send, or None
        (name vanished or flags used up: the caller copies)."""
        with self._lock:
            if (self._index.get(entry.handle.name) is not entry or entry.state is MAPPED
                    or entry.next_flag + readers > MAX_READERS):
                return None
            vanished = False
            if entry.fds is None:
                try:
                    entry.fds = seg.open_files(shm_dir(), entry.handle, reader=False)
                except ShmEmbedsError:
                    vanished = True  # still mapped here: released when freed
                    self._index.move(entry, "vanish", GONE if entry.data_ptr is None else MAPPED)
            if not vanished:
                if not self._index.move(entry, "broadcast",
                                        FREED if entry.state is FREED else BROADCAST):
                    return None
                base = entry.next_flag
                entry.next_flag += readers
                entry.broadcasts.append((base, readers))
                files = tuple((fd, os.fstat(fd).st_ino) for fd in entry.fds)
        if vanished:
            logger.warning("shm-embeds: a prompt_embeds segment was removed by another "
                           "process before hop 2; copying it again")
            count_reason(Event.FALLBACK, "vanished", hop="2")
            self._unlink([entry])
            return None
        return dataclasses.replace(entry.handle, flag_base=base, readers=readers,
                                   owner_pid=os.getpid(), owner_files=files)

    # -- hop 1 (streamed segments)

    def _streamed(self, tensor: torch.Tensor) -> OwnedSegment | None:
        """The ``HELD`` streamed segment that is exactly ``tensor`` (lock held)."""
        entry = self._index.at(tensor.data_ptr())
        if (entry is None or entry.kind is not Kind.STREAMED or entry.state is not HELD
                or not entry.maps(tensor) or not tensor.is_contiguous()):
            return None
        return entry

    def is_streamed(self, tensor: torch.Tensor) -> bool:
        with self._lock:
            return self._streamed(tensor) is not None

    @_settles
    def hand_over(self, tensor: torch.Tensor) -> SharedTensorHandle | None:
        """Give up a streamed segment to a peer: its handle, or None if not one."""
        with self._lock:
            gone = self._apply_records()
            entry = self._streamed(tensor)
            if entry is not None and not self._index.move(entry, "hand_over", MAPPED):
                entry = None
        self._unlink(gone)
        return entry.handle if entry is not None else None

    # -- release: the request is done with a segment here

    @_settles
    def release_adopted(self, tensor: torch.Tensor) -> bool:
        """vLLM freed ``tensor``'s request: unlink its adopted segment or hop-2 copies (while
        a broadcast is pending: at :meth:`collect`). True if pages were dropped now."""
        adopted: list[OwnedSegment] = []
        copies: list[OwnedSegment] = []
        with self._lock:
            gone = self._apply_records()  # (sends done by now: no DRAINING for them)
            # the adopted segment and its copies (made when flags ran out or it vanished)
            for entry in self._index.linked():
                copy = (entry.kind is Kind.COPY and entry.source is not None
                        and entry.source() is tensor)
                if entry.kind is Kind.STREAMED or not (copy or entry.maps(tensor)):
                    continue
                entry.settle()
                to = GONE if copy else self._finish(entry)
                if entry.broadcasts:
                    self._index.move(entry, "release_adopted", FREED)
                elif self._index.move(entry, "release_adopted", to):
                    (copies if copy else adopted).append(entry)
            view = self._index.mapped(tensor)
            if view is not None and not self._index.move(view, "release_adopted",
                                                         self._finish(view)):
                view = None
        self._unlink(gone + copies + adopted)
        dropped = False
        for entry in adopted:  # (not the copies: only their headers are mapped here)
            dropped |= entry.state is GONE and self._drop(entry)
        if view is not None:
            dropped |= view.state is GONE and self._drop(view)
        return dropped

    @_settles
    def release_streamed(self, tensor: torch.Tensor) -> bool:
        """Unlink the streamed segment ``tensor`` if not handed over; drop its pages here
        either way. True if ``tensor`` was such a segment."""
        with self._lock:
            gone = self._apply_records()  # (sends done by now: no DRAINING for them)
            entry = self._streamed(tensor)
            unlink = entry is not None
            if not unlink:
                entry = self._index.mapped(tensor)
            if entry is not None and not self._index.move(entry, "release_streamed",
                                                          self._finish(entry)):
                entry = None
        self._unlink(gone)
        if entry is None:
            return False
        if unlink:
            self._unlink([entry])
        if entry.state is GONE:
            self._drop(entry)
        return True

    def stream_started(self, f: Any) -> None:
        """``f`` (``reserved``, ``filled``: bytes) is being filled from a request body."""
        with self._lock:
            self._streams.add(f)

    def stream_ended(self, f: Any) -> None:
        with self._lock:
            self._streams.discard(f)

    def pending_stream_bytes(self) -> int:
        """Bytes granted to bodies still arriving and not written yet."""
        with self._lock:
            return sum(max(0, f.reserved - f.filled) for f in self._streams)

    def live(self) -> int:
        """Segments this process owns or maps, and bodies arriving (the per-process cap)."""
        with self._lock:
            return len(self._index) + len(self._streams)

    def pending(self) -> int:
        """Names this process owns and has not unlinked."""
        with self._lock:
            return len(self._index.linked())

    @_settles
    def unlink_all(self) -> int:
        """Shutdown: unlink every name this process owns (un-adopted ones too); how many."""
        with self._lock:
            gone = self._index.linked()  # MAPPED ones were unlinked already
            for entry in self._index.all():
                self._index.move(entry, "unlink_all", GONE)
        n = self._unlink(gone)
        try:  # only regular files of ours: never what someone planted
            swept = segment_dir.unlink_ours(shm_dir(), self._state.owns_name)
        except OSError:  # the directory is gone (removed by someone): nothing left in it
            swept = 0
        if swept:
            count(Event.SEGMENTS_UNLINKED, swept)
        return n + swept
