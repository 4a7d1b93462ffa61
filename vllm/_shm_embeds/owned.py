# SPDX-License-Identifier: Apache-2.0
"""The books of the segments one process owns, and when their names may go.

A name stays for as long as the segment's pages are in use by a request:
until every reader of every broadcast of it has set its flag (after at
least one broadcast) *and* the request is done with it here (its tensor
storage, or the tensor a hop-2 copy was made from, is freed, or vLLM freed
the request: :meth:`OwnedSegments.release_adopted`). The TP workers map the
pages until their request ends too, so the names in the segment directory
are what the server holds there (the budget, ``transfer.check_budget``,
counts them). Bookkeeping happens under a lock in ordinary code; finalizers
only record (:func:`on_release`), and the work is done at the next safe
point (:meth:`OwnedSegments.collect`).

Knows segments and handles, not vLLM and not HTTP.
"""

from __future__ import annotations

import collections
import dataclasses
import mmap
import os
import threading
import weakref
from typing import Any, Protocol

import torch
from vllm.logger import init_logger

from vllm._shm_embeds import segment as seg
from vllm._shm_embeds.config import shm_dir
from vllm._shm_embeds.counters import count, count_reason
from vllm._shm_embeds.handle import MAX_READERS, SegmentName, SharedTensorHandle, ShmEmbedsError

logger = init_logger(__name__)

# Whether something tells the books when a request is freed
# (:meth:`OwnedSegments.release_adopted`, from vLLM's ``Scheduler._free_request``
# in ``sites/scheduler.py``). Without it a name goes once every reader mapped
# it, as it is unknown when the request ends.
_release_known = True


def set_release_known(known: bool) -> None:
    """Say whether :meth:`OwnedSegments.release_adopted` will be called when a
    request is freed (False: names go once every reader mapped them)."""
    global _release_known
    _release_known = known


class ProcessState(Protocol):
    """What the books need of their process (``process.Process``)."""

    pid: int
    released: collections.deque

    def owns_name(self, name: SegmentName) -> bool: ...


def on_release(state: ProcessState, key: tuple) -> None:
    """Finalizer: record that a tracked object died. Only records.

    Runs from garbage collection, on whatever thread dropped the last
    reference, possibly inside one of our locks: it must take no lock and
    do no I/O. ``deque.append`` is atomic. In a forked child the state is
    not the child's, so nothing is recorded there.
    """
    if state.pid == os.getpid():
        state.released.append(key)


@dataclasses.dataclass
class _Owned:
    """One segment this process owns.

    Attributes:
        handle: its base handle (no broadcast fields).
        mm: a mapping whose first page is the header (reader flags).
        data_ptr: address of the data in this process's mapping of it
            (adopted segments), else None.
        source: the tensor that was copied into it (hop 2 copies), else None.
        fds: the files, held open while broadcasts are pending (a
            region's for as long as the name: its memfd has no name).
        broadcasts: ``(flag_base, readers)`` of broadcasts whose readers have
            not all set their flags.
        next_flag: first unused flag byte.
        released: the owner's tensor is gone; no new broadcast will come.
        handover: a streamed segment (binary body) that hop 1 may hand over
            to a peer by handle; never broadcast from here.
        freed: vLLM freed the request while a broadcast was pending: the
            name goes once the broadcasts are done.
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
    freed: bool = False

    def maps(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` is exactly this segment's mapping here (same
        address, dtype and shape)."""
        return (self.data_ptr == tensor.data_ptr() and tensor.dtype == self.handle.torch_dtype
                and tuple(tensor.shape) == self.handle.shape)

    def in_use(self) -> bool:
        """True while the request still uses the segment here: its tensor
        (adopted) or the tensor it copies (hop 2) is alive and vLLM has not
        freed the request."""
        if self.freed or not _release_known:
            return False
        return self.data_ptr is not None or (self.source is not None
                                             and self.source() is not None)

    def settle(self) -> None:
        """Drop the broadcasts whose readers have all set their flags."""
        self.broadcasts = [(base, readers) for base, readers in self.broadcasts
                           if b"\x00" in seg.read_flags(self.mm, base, readers)]

    def close_fds(self) -> None:
        for fd in self.fds or ():
            os.close(fd)
        self.fds = None


class OwnedSegments:
    """Segments this process owns, and when to unlink their names.

    A name is unlinked once no broadcast of it is pending (every reader set
    its flag) and the request no longer uses it here (:meth:`_Owned.in_use`):
    so a name is linked for as long as a request holds the pages, and the
    budget can count them by name. All bookkeeping happens under ``_lock``
    in ordinary code; finalizers only queue (:func:`on_release`).
    """

    def __init__(self, state: ProcessState) -> None:
        self._state = state
        self._segs: dict[str, _Owned] = {}
        self._by_ptr: dict[int, str] = {}  # data address -> segment name
        self._lock = threading.Lock()
        # Files a request body is being written into (``streamed_file.StreamedFile``).
        self._streams: set = set()
        # Segments out of the books whose tensor still maps them here (handed
        # over at hop 1; adopted ones whose name is gone): name -> entry, for
        # :meth:`release` (forgotten when the storage dies).
        self._views: dict[str, _Owned] = {}

    # -- adding

    def add_mapped(self, handle: SharedTensorHandle, mm: mmap.mmap, tensor: torch.Tensor,
                   anchor: Any, handover: bool = False, fds: list[int] | None = None) -> None:
        """Own a segment mapped here as ``tensor``; released when its storage dies.

        ``anchor``: the buffer object the storage keeps alive
        (:func:`~vllm._shm_embeds.segment.tensor_view`). ``handover``: a
        streamed segment, for :meth:`hand_over`. ``fds``: its files, held
        open from now on (a region's memfd can be opened only by fd).
        """
        with self._lock:
            self._segs[handle.name] = _Owned(handle, mm, data_ptr=tensor.data_ptr(),
                                             handover=handover, fds=fds)
            self._by_ptr[tensor.data_ptr()] = handle.name
        weakref.finalize(anchor, on_release, self._state, ("storage", handle.name))

    def add_copy(self, handle: SharedTensorHandle, mm: mmap.mmap, fds: list[int],
                 source: torch.Tensor) -> None:
        """Own a segment holding a copy of ``source`` (hop 2), fds held open."""
        with self._lock:
            self._segs[handle.name] = _Owned(
                handle, mm, source=weakref.ref(source), fds=fds, released=True
            )
            self._by_ptr[source.data_ptr()] = handle.name
        weakref.finalize(source, on_release, self._state,
                         ("source", handle.name, source.data_ptr()))

    # -- safe points

    def _drain(self) -> list[_Owned]:
        """Apply the finalizers' records; return segments to unlink (lock held)."""
        gone = []
        released = self._state.released
        while released:
            key = released.popleft()
            name = key[1]
            if key[0] == "storage":
                self._views.pop(name, None)
            entry = self._segs.get(name)
            if key[0] == "source":
                if self._by_ptr.get(key[2]) == name:
                    del self._by_ptr[key[2]]
                if entry is not None:
                    entry.source = None
                    if entry.data_ptr is None and not entry.broadcasts:
                        gone.append(self._pop(name))  # a hop-2 copy nobody needs
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
        """Unlink the names that no reader and no request needs any more;
        returns how many segments went."""
        if not self._segs and not self._state.released:
            return 0
        idle_fds: list[int] = []
        drop: list[_Owned] = []
        with self._lock:
            gone = self._drain()
            for name, entry in list(self._segs.items()):
                if not entry.broadcasts:
                    continue
                entry.settle()
                if entry.broadcasts:
                    continue
                if entry.in_use():  # the TP workers map it until the request ends
                    if entry.fds and not entry.handle.region:  # reopened by name if re-sent
                        idle_fds += entry.fds
                        entry.fds = None
                    continue
                gone.append(self._pop(name))
                if entry.data_ptr is not None:  # still mapped here as a tensor
                    if entry.freed:  # vLLM freed the request meanwhile
                        drop.append(entry)
                    else:
                        self._views[name] = entry
        for fd in idle_fds:
            os.close(fd)
        self._unlink(gone)
        for entry in drop:
            if self._let_go(entry, False):
                count(engine_pages_released=1)
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
                    not entry.handover and not entry.freed
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
            vanished = False
            if entry.fds is None:
                try:
                    entry.fds = seg.open_files(shm_dir(), entry.handle, reader=False)
                except ShmEmbedsError:
                    vanished = True
                    self._pop(entry.handle.name)
                    if entry.data_ptr is not None:  # still mapped here: let go when freed
                        self._views[entry.handle.name] = entry
            if not vanished:
                base = entry.next_flag
                entry.next_flag += readers
                entry.broadcasts.append((base, readers))
                files = tuple((fd, os.fstat(fd).st_ino) for fd in entry.fds)
        if vanished:
            logger.warning("shm-embeds: a prompt_embeds segment was removed by another "
                           "process before hop 2; copying it again")
            count_reason("fallback", "vanished", hop="2")
            self._unlink([entry])
            return None
        return dataclasses.replace(
            entry.handle, flag_base=base, owner_pid=os.getpid(), owner_files=files
        )

    # -- hop 1 (streamed segments)

    def handover_entry(self, tensor: torch.Tensor) -> _Owned | None:
        """The streamed segment that is exactly ``tensor`` (lock held by caller or not)."""
        name = self._by_ptr.get(tensor.data_ptr())
        entry = self._segs.get(name) if name is not None else None
        if (entry is None or not entry.handover or not entry.maps(tensor)
                or not tensor.is_contiguous()):
            return None
        return entry

    def hand_over(self, tensor: torch.Tensor) -> SharedTensorHandle | None:
        """Give up a streamed segment to a peer; its handle, or None if not one."""
        with self._lock:
            gone = self._drain()
            entry = self.handover_entry(tensor)
            if entry is not None:
                self._pop(entry.handle.name)
                self._views[entry.handle.name] = entry
        self._unlink(gone)
        return entry.handle if entry is not None else None

    def _view_entry(self, tensor: torch.Tensor) -> _Owned | None:
        """The segment out of the books that is exactly ``tensor`` (lock held)."""
        return next((e for e in self._views.values() if e.maps(tensor)), None)

    def release_adopted(self, tensor: torch.Tensor) -> bool:
        """The EngineCore is done with ``tensor`` (vLLM freed its request):
        unlink the name of the segment it adopted at hop 1, or of the hop-2
        copy made from it, and drop this process's pages of an adopted one
        (the TP workers have mappings of their own, dropped at their next
        step). While a broadcast of it is pending (its readers' flags live in
        the mapping) both happen at the safe point after the readers are
        done (:meth:`collect`). True if pages were dropped here now."""
        adopted: list[_Owned] = []
        copies: list[_Owned] = []
        with self._lock:
            # Every segment of it: the adopted one, and copies (made when its
            # flags ran out or its name vanished, which left it unlinked in
            # ``_views``); a scan of the running requests' segments.
            for name, entry in list(self._segs.items()):
                copy = (entry.data_ptr is None and entry.source is not None
                        and entry.source() is tensor)
                if entry.handover or not (copy or entry.maps(tensor)):
                    continue
                entry.settle()
                if entry.broadcasts:
                    entry.freed = True
                    continue
                (copies if copy else adopted).append(self._pop(name))
            view = self._view_entry(tensor)
            if view is not None:
                self._views.pop(view.handle.name, None)
        self._unlink(copies)  # only their headers are mapped here
        dropped = False
        for entry in adopted:
            dropped |= self._let_go(entry, True)
        if view is not None:
            dropped |= self._let_go(view, False)
        return dropped

    def release(self, tensor: torch.Tensor) -> bool:
        """This process is done with ``tensor``, a streamed segment (its request ended).

        Unlinks the segment now if it was not handed over, and drops this
        process's pages of it either way (``segment.drop_pages``: the tensor
        stays valid and reads zeros), so that the memory comes back as soon
        as the peer that took it lets go, whatever here still holds the
        tensor object. Returns True if ``tensor`` was such a segment.
        """
        with self._lock:
            entry = self.handover_entry(tensor)
            unlink = entry is not None
            if unlink:
                self._pop(entry.handle.name)
            else:
                entry = self._view_entry(tensor)
            if entry is not None:
                self._views.pop(entry.handle.name, None)
        if entry is None:
            return False
        self._let_go(entry, unlink)
        return True

    def _let_go(self, entry: _Owned, unlink: bool) -> bool:
        """Unlink ``entry`` (if ``unlink``) and drop this process's pages of it
        (lock not held); False if the pages could not be dropped."""
        if unlink:
            self._unlink([entry])
        try:
            seg.drop_pages(entry.mm)
        except OSError as e:  # the pages then go when the tensor does
            logger.debug("shm-embeds: could not drop a finished request's pages: %s", e)
            return False
        return True

    # -- whole process

    def stream_started(self, f: Any) -> None:
        """``f`` (a ``streamed_file.StreamedFile``) is being filled from a request body."""
        with self._lock:
            self._streams.add(f)

    def stream_ended(self, f: Any) -> None:
        """``f`` was finished or aborted."""
        with self._lock:
            self._streams.discard(f)

    def pending_stream_bytes(self) -> int:
        """Bytes this process's bodies still arriving were granted by the budget
        and have not written yet (``transfer.StreamedSegment``: a bounded
        look-ahead each, not their whole size)."""
        with self._lock:
            return sum(max(0, f.reserved - f.filled) for f in self._streams)

    def live(self) -> int:
        """Segments this process owns or still maps (the per-process cap):
        in the books, out of them but mapped here, and bodies arriving."""
        with self._lock:
            return len(self._segs) + len(self._views) + len(self._streams)

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
            self._views.clear()
        n = 0
        for entry in gone:
            entry.close_fds()
            n += seg.unlink_segment(shm_dir(), entry.handle.name, len(entry.handle.parts()))
        for name, parsed in seg.list_segments(shm_dir()):
            if not self._state.owns_name(parsed):
                continue
            path = os.path.join(shm_dir(), name)
            try:  # only a regular file of ours: never what someone planted
                if seg.our_file(os.lstat(path)) and seg.unlink_quietly(path):
                    n += parsed.part == 0
            except OSError:
                continue
        if n:
            count(segments_unlinked=n)
        return n

