# SPDX-License-Identifier: Apache-2.0
"""Registered regions: sealed memfds of same-host producers, mapped read-only.

A producer hands the API server a sealed memfd holding one ``prompt_embeds``
tensor (the socket protocol: ``ext/regions/operations.py``) and gets a region id;
requests name the region (Triton's ``shared_memory_region`` parameters) and
get this process's zero-copy, read-only mapping of it as their tensor. An
unregistered region leaves lookup at once; its fd and mapping stay until its
last :class:`Lease` is released, so requests in flight keep working.

Knows files and tensors, not vLLM and not HTTP. Thread-safe (one lock).
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import collections
import dataclasses
import mmap
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from shm_embeds_client.wire import DATATYPES, REGION
from vllm.logger import init_logger

from vllm._shm_embeds.counters import count, count_many, count_reason
from vllm._shm_embeds.ext.regions.events import RegionEvent
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.ext.regions import memfd
from vllm._shm_embeds.ext.regions import settings
from vllm._shm_embeds.ext.regions.memfd import NOT_MEMFD, RegionError  # noqa: F401 (the API)
from vllm._shm_embeds.files.sockets import discard_fd

logger = init_logger(__name__)

# The client's table (shm_embeds_client.wire), with torch dtypes.
DTYPES = {name: getattr(torch, dt.torch) for name, dt in DATATYPES.items()}
UNKNOWN_REGION = f"unknown {REGION}"  # never the id: it is a capability


@dataclasses.dataclass(frozen=True)
class RegionLimits:
    """What a registration may be.

    Attributes:
        hidden_size: H, the model's hidden size; every region is ``(T, H)``.
        max_tokens: largest T (the model's ``max_model_len``).
        allowed_uids: peer uids that may register.
        max_regions_per_uid, max_bytes_per_uid: regions / bytes one uid may
            hold; a region unregistered while leased counts until its last
            release (its memory is held until then).
        idle_ttl_s: seconds without a lease after which a region is unregistered.
        datatype: the model's (a :data:`DTYPES` key), the only one accepted; None: any.
        max_leases: leases (region references of requests in flight) this
            process may hold at once; each costs the EngineCore two fds and
            two mappings while its request runs. Over it: RegionError
            ``leases`` (HTTP 429).
    """

    hidden_size: int
    max_tokens: int
    allowed_uids: frozenset[int]
    max_regions_per_uid: int
    max_bytes_per_uid: int
    idle_ttl_s: float
    datatype: str | None = None
    max_leases: int = settings.REGIONS_LEASES_MAX

    @classmethod
    def from_config(cls, hidden_size: int, max_tokens: int,
                    datatype: str | None = None) -> RegionLimits:
        """Limits from the ``VLLM_SHM_EMBEDS_REGIONS_*`` variables; ``datatype``
        the model's (``"FP32"``/``"FP16"``/``"BF16"``) or None (any)."""
        if datatype is not None and datatype not in DTYPES:
            raise ValueError(f"datatype must be one of {', '.join(DTYPES)} or None")
        return cls(hidden_size, max_tokens, settings.regions_allowed_uids(),
                   settings.regions_max(), settings.regions_max_bytes(),
                   settings.regions_ttl_s(), datatype, settings.regions_leases_max())


@dataclasses.dataclass(eq=False, repr=False)
class Region:
    """One registered memfd and this process's read-only mapping of it.

    Attributes:
        id: ``secrets.token_urlsafe(16)`` (128 random bits; never logged).
        uid: the producer's uid.
        datatype, dtype: ``"FP32"``/``"FP16"``/``"BF16"`` and the torch dtype.
        shape, nbytes: ``(T, H)``; ``T * H * itemsize`` bytes, the memfd's size.
        fd, inode: this process's fd of the memfd (open until freed), its inode
            (readers of ``/proc/<pid>/fd/<fd>`` check it).
        tensor: ``(T, H)`` of ``dtype`` over the whole mapping, zero-copy; an
            in-place write faults (mapped ``PROT_READ``).
        last_used: ``time.monotonic()`` of the last lease or release.
    """

    id: str
    uid: int
    datatype: str
    shape: tuple[int, int]
    fd: int
    inode: int
    mm: mmap.mmap
    tensor: torch.Tensor
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    leases: int = 0
    sends: int = 0  # zero-copy sends of its bytes not done (live send views)
    registered: bool = True  # False: out of lookup, freed at the last release or send

    dtype = property(lambda self: self.tensor.dtype)
    nbytes = property(lambda self: self.tensor.nbytes)

    def __repr__(self) -> str:  # never the id: it is a capability
        return f"Region({self.datatype}, {self.shape}, uid={self.uid}, leases={self.leases})"


class Lease:
    """One request's use of ``region``: keeps its fd and mapping alive.
    ``tensor`` is ``region.tensor`` (the same object). :meth:`release` when the
    request ends; a lease never released keeps the memfd open until exit.
    It counts against ``max_leases`` until :meth:`settle` or :meth:`release`."""

    __slots__ = ("_counted", "_registry", "_released", "region", "tensor")

    def __init__(self, registry: RegionRegistry, region: Region) -> None:
        self.region, self.tensor = region, region.tensor
        self._registry, self._released, self._counted = registry, False, True

    def settle(self) -> None:
        """The request's response has started (its EngineCore holds the region
        by its own fds by then): the lease stops counting against
        ``max_leases`` (a slow reader holds none of them), and still keeps
        the region alive until :meth:`release`."""
        self._registry._settle(self)

    def release(self) -> None:
        """End this use; the last release of an unregistered region frees it."""
        self._registry._release(self)


class RegionRegistry:
    """The regions of one API server. ``on_registered(tensor)`` runs for each
    new region before its id is returned (the integration computes prefix-cache
    digests there); if it raises, the registration is refused, the fd closed.
    One of ``process.current().holders`` while it serves (``service.py``)."""

    holds = "regions"  # service.current() finds it among the holders by this

    def __init__(self, limits: RegionLimits,
                 on_registered: Callable[[torch.Tensor], None] | None = None,
                 counted: bool = True) -> None:
        self.limits = limits
        self.on_registered = on_registered
        self.counted = counted  # False: a sibling's regions seen here (ext/regions/mirror.py)
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}  # registered
        self._live: dict[int, Region] = {}  # data_ptr -> registered or leased
        self._held: dict[int, list[int]] = {}  # uid -> [regions, bytes], pending included
        self._leases = 0  # leases not released (requests' and lookups')
        # Regions whose send view died (finalizers append, nothing else).
        self._sent: collections.deque = collections.deque()
        self._closed = False

    # ------------------------------------------------------------ register

    def _check_meta(self, uid: int, datatype: Any, shape: Any) -> tuple[torch.dtype, int, int]:
        if uid not in self.limits.allowed_uids:
            raise RegionError("this user may not register regions", "uid")
        if not isinstance(datatype, str) or datatype not in DTYPES:
            raise RegionError(f"datatype must be one of {', '.join(DTYPES)}", "datatype")
        if self.limits.datatype is not None and datatype != self.limits.datatype:
            raise RegionError(f"datatype must be the model's, {self.limits.datatype} (got "
                              f"{datatype})", "datatype")
        if (not isinstance(shape, (list, tuple)) or len(shape) != 2
                or not all(type(s) is int for s in shape)):
            raise RegionError("shape must be [T, H], two integers", "shape")
        t, h = shape
        if h != self.limits.hidden_size:
            raise RegionError(f"shape [T, H]: H must be the model's hidden size "
                              f"{self.limits.hidden_size}, got {h}", "hidden_size")
        if not 1 <= t <= self.limits.max_tokens:
            raise RegionError(f"shape [T, H]: T must be 1..{self.limits.max_tokens} "
                              f"(the model's max tokens), got {t}", "tokens")
        return DTYPES[datatype], t, h

    def _reserve(self, uid: int, nbytes: int) -> None:
        with self._lock:
            if self._closed:
                raise RegionError("the server is shutting down", "closed")
            held = self._held.setdefault(uid, [0, 0])
            if held[0] >= self.limits.max_regions_per_uid:
                raise RegionError(f"this user holds {held[0]} regions, the most allowed",
                                  "limit_count")
            if held[1] + nbytes > self.limits.max_bytes_per_uid:
                raise RegionError(f"{nbytes} more bytes would take this user's regions "
                                  f"({held[1]} bytes) over the limit of "
                                  f"{self.limits.max_bytes_per_uid}", "limit_bytes")
            held[0], held[1] = held[0] + 1, held[1] + nbytes

    def _unreserve(self, uid: int, nbytes: int) -> None:  # lock held
        held = self._held[uid]
        held[0], held[1] = held[0] - 1, held[1] - nbytes
        if held[0] == 0:
            del self._held[uid]

    def register(self, fd: int, uid: int, datatype: str, shape: Any) -> Region:
        """Register the sealed memfd ``fd`` of peer ``uid``; takes ownership of ``fd``.

        Args:
            fd: a memfd sealed with at least F_SEAL_WRITE|SHRINK|GROW|SEAL, of
                exactly ``T * H * itemsize`` bytes; discarded on any failure.
            uid: the producer's uid (SO_PEERCRED).
            datatype: ``"FP32"``, ``"FP16"`` or ``"BF16"`` (the model's, if set).
            shape: ``[T, H]``, H the model's hidden size, 1 <= T <= max tokens.
        Raises:
            RegionError: refused (counted as ``region_refused`` by reason).
        """
        mm = tensor = region = None
        reserved = 0
        try:
            dtype, t, h = self._check_meta(uid, datatype, shape)
            nbytes = t * h * dtype.itemsize
            inode = memfd.check_sealed(fd, nbytes)
            self._reserve(uid, nbytes)
            reserved = nbytes
            try:
                mm, tensor = memfd.map_readonly(fd, dtype, (t, h))
            except OSError as e:
                logger.warning("shm-embeds: mapping a region failed: %s", e)
                raise RegionError("the memfd could not be mapped", "map_failed") from e
            if self.on_registered is not None:
                try:
                    self.on_registered(tensor)
                except RegionError:
                    raise
                except Exception as e:
                    logger.exception("shm-embeds: on_registered failed for a region")
                    raise RegionError("the region could not be registered", "callback") from e
            region = Region(secrets.token_urlsafe(16), uid, datatype, (t, h), fd, inode, mm,
                            tensor)
            with self._lock:
                if self._closed:
                    raise RegionError("the server is shutting down", "closed")
                self._regions[region.id] = region
                self._live[tensor.data_ptr()] = region
        except BaseException as e:
            tensor = region = None
            if mm is not None:
                memfd.unmap(mm)
            if reserved:
                with self._lock:
                    self._unreserve(uid, reserved)
            discard_fd(fd)
            if isinstance(e, RegionError):
                count_reason(RegionEvent.REGION_REFUSED, e.reason)
            raise
        if self.counted:
            count_many({RegionEvent.REGIONS_REGISTERED: 1, RegionEvent.REGION_BYTES: nbytes})
        return region

    # ------------------------------------------------------------ unregister

    def _withdraw(self, region: Region) -> bool:
        """Take a region out of lookup (lock held); True if it is to be freed now."""
        if region.registered:
            region.registered = False
            del self._regions[region.id]
        if region.leases or region.sends or self._live.get(region.tensor.data_ptr()) is not region:
            return False
        self._live.pop(region.tensor.data_ptr(), None)
        self._unreserve(region.uid, region.nbytes)
        return True

    @staticmethod
    def _free(region: Region) -> None:
        """Drop the mapping's pages and close the fd (lock not held)."""
        memfd.unmap(region.mm)  # region.tensor is alive: drops the pages
        os.close(region.fd)
        count(RegionEvent.REGIONS_FREED)

    def _unregister(self, regions: Iterable[Region], reason: str,
                    pick: Callable[[Region], bool] | None = None) -> int:
        """Unregister those of ``regions`` registered and ``pick``-ed (under
        the lock that withdraws them); returns how many."""
        with self._lock:
            regions = [r for r in regions if r.registered and (pick is None or pick(r))]
            free = [r for r in regions if self._withdraw(r)]
        for r in free:
            self._free(r)
        if regions:
            count_reason(RegionEvent.REGION_UNREGISTERED, reason, n=len(regions))
        return len(regions)

    def unregister(self, region_id: str, uid: int | None = None) -> None:
        """Unregister a region (of ``uid`` when given); its memory stays until its
        last lease is released. Raises RegionError: no such registered region."""
        with self._lock:
            region = self._regions.get(region_id) if isinstance(region_id, str) else None
        if region is None or (uid is not None and region.uid != uid) or not self._unregister(
                [region], "op"):
            raise RegionError(UNKNOWN_REGION, "unknown")

    def unregister_ids(self, region_ids: Iterable[str], reason: str = "disconnect") -> int:
        """Unregister those of ``region_ids`` still registered (a closed
        connection's regions); returns how many. ``reason`` is the counter label."""
        with self._lock:
            regions = [self._regions[i] for i in region_ids if i in self._regions]
        return self._unregister(regions, reason)

    def expire(self, now: float | None = None) -> int:
        """Unregister regions without a lease whose ``last_used`` is more than
        ``idle_ttl_s`` seconds before ``now`` (``time.monotonic()``); returns how many."""
        now = time.monotonic() if now is None else now
        self.settle()
        ttl = self.limits.idle_ttl_s
        return self._unregister(self._regions.values(), "idle",  # iterated under the lock
                                lambda r: not r.leases and now - r.last_used > ttl)

    def close(self) -> None:
        """Unregister every region and refuse new ones; each region's fd is
        closed now, or at its last lease's release."""
        with self._lock:
            self._closed = True
            regions = list(self._regions.values())
        self._unregister(regions, "close")

    # ------------------------------------------------------------ requests

    def lease(self, region_id: Any, datatype: Any, shape: Any, byte_size: Any,
              offset: Any) -> Lease:
        """A request's use of a region, from Triton's parameters: ``region_id``
        (``shared_memory_region``) a registered id; ``datatype`` and ``shape``
        ``[T, H]`` as registered; ``byte_size`` (``shared_memory_byte_size``)
        the region's bytes; ``offset`` (``shared_memory_offset``) 0 or None.
        ``lease.tensor`` is the region's ``(T, H)`` tensor. Raises RegionError:
        unknown region (the id is not echoed), or a mismatch."""
        with self._lock:
            region = self._regions.get(region_id) if isinstance(region_id, str) else None
        try:
            if region is None:
                raise RegionError(UNKNOWN_REGION, "unknown")
            if datatype != region.datatype:
                raise RegionError(f"datatype does not match the region's ({region.datatype})",
                                  "mismatch")
            if (not isinstance(shape, (list, tuple)) or [type(s) for s in shape] != [int, int]
                    or tuple(shape) != region.shape):
                raise RegionError(f"shape does not match the region's ({list(region.shape)})",
                                  "mismatch")
            if type(byte_size) is not int or byte_size != region.nbytes:
                raise RegionError("shared_memory_byte_size does not match the region's "
                                  f"({region.nbytes})", "mismatch")
            if offset is not None and (type(offset) is not int or offset != 0):
                raise RegionError("shared_memory_offset must be 0 (only whole regions are "
                                  "supported)", "offset")
            with self._lock:
                if not region.registered:  # unregistered meanwhile
                    raise RegionError(UNKNOWN_REGION, "unknown")
                if self._leases >= self.limits.max_leases:
                    raise RegionError(f"this server uses {self._leases} regions for requests "
                                      "in flight, the most allowed; retry later", "leases")
                self._leases += 1
                region.leases += 1
                region.last_used = time.monotonic()
        except RegionError as e:
            count_reason(RegionEvent.REGION_LEASE_REFUSED, e.reason)
            raise
        count(RegionEvent.REGION_LEASES)
        return Lease(self, region)

    def lookup(self, region_id: Any) -> Lease:
        """A lease on the registered region ``region_id``, held while its fd is
        sent to a sibling API server (``lookup`` op). Raises RegionError."""
        with self._lock:
            region = self._regions.get(region_id) if isinstance(region_id, str) else None
            if region is None:
                raise RegionError(UNKNOWN_REGION, "unknown")
            self._leases += 1  # released once its fd is sent: not capped
            region.leases += 1
            region.last_used = time.monotonic()
        return Lease(self, region)

    def _settle(self, lease: Lease) -> None:
        with self._lock:
            if lease._counted and not lease._released:
                lease._counted = False
                self._leases -= 1

    def _release(self, lease: Lease) -> None:
        region = lease.region
        with self._lock:
            free = self._sends_done()
            if not lease._released:
                lease._released = True
                self._leases -= lease._counted
                lease._counted = False
                region.leases -= 1
                region.last_used = time.monotonic()
            if not region.registered and self._withdraw(region):
                free.append(region)
        for r in free:
            self._free(r)

    # ------------------------------------------------------------ zero-copy sends

    def send_view(self, tensor: Any) -> torch.Tensor | None:
        """``tensor`` for a message vLLM may send without a copy, or None if it
        is not a live region's tensor here (``owned.OwnedSegments.send_view``
        says why): a view over the same pages with a storage of its own; the
        region is not freed (its pages not dropped) until that storage is."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return None
        with self._lock:
            region = self._live.get(tensor.data_ptr())
            if region is None or not seg.within(region.mm, tensor):
                return None
            view, anchor = seg.view_within(region.mm, tensor)
            region.sends += 1
        weakref.finalize(anchor, self._sent.append, region)  # deque.append: no lock
        return view

    def _sends_done(self) -> list[Region]:
        """Apply the finalizers' records of sends done; the regions to free now
        (lock held)."""
        free = []
        while self._sent:
            region = self._sent.popleft()
            region.sends -= 1
            if not region.registered and self._withdraw(region):
                free.append(region)
        return free

    def settle(self) -> int:
        """Free the unregistered regions whose last send is done; how many."""
        with self._lock:
            free = self._sends_done()
        for r in free:
            self._free(r)
        return len(free)

    def find(self, tensor: torch.Tensor) -> tuple[int, int, int] | None:
        """``(pid, fd, inode)`` if ``tensor`` is exactly (``data_ptr``, dtype,
        shape, strides) a registered or leased region's tensor here. A reader
        then opens ``/proc/<pid>/fd/<fd>`` and checks the inode."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return None
        with self._lock:
            region = self._live.get(tensor.data_ptr())
            if (region is None or tensor.dtype != region.dtype
                    or tuple(tensor.shape) != region.shape
                    or tensor.stride() != region.tensor.stride()):
                return None
            return os.getpid(), region.fd, region.inode

    def registered(self, region_ids: Iterable[str]) -> set[str]:
        """Those of ``region_ids`` still registered."""
        with self._lock:
            return {i for i in region_ids if i in self._regions}

    def is_held(self, tensor: Any) -> bool:  # find(tensor) is not None
        return self.find(tensor) is not None

    def stats(self) -> dict[str, Any]:
        """``{"regions": n, "bytes": b, "draining": d, "leases": l, "per_uid":
        {uid: {"regions": n, "bytes": b}}}``: registered regions and their bytes;
        ``leases``: leases not released;
        ``draining``: unregistered ones still leased (their bytes still count
        in ``per_uid``, which also counts registrations in progress)."""
        with self._lock:
            return {"regions": len(self._regions),
                    "bytes": sum(r.nbytes for r in self._regions.values()),
                    "draining": sum(not r.registered for r in self._live.values()),
                    "leases": self._leases,
                    "per_uid": {uid: {"regions": n, "bytes": b}
                                for uid, (n, b) in self._held.items()}}
