# SPDX-License-Identifier: Apache-2.0
"""Registered regions seen from a sibling API server (``--api-server-count`` > 1).

One API server of a ``vllm serve`` serves the regions socket (``ext/regions/server.py``).
A request on another API server that names a region is resolved by
:class:`RegionMirror`: it asks the serving API server over the same socket
(``{"op": "lookup"}``; only a sibling, same uid and parent, may) and gets the
region's fd back (``SCM_RIGHTS``) with its datatype, shape and digests. The fd is
checked as a registration is, mapped read-only and held by this request's lease
only; hop 1 then sends *this* process's fd of it.

Knows sockets and the registry (``ext/regions/registry.py``), not vLLM and not HTTP.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import array
import dataclasses
import json
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch

from vllm._shm_embeds.counters import count
from vllm._shm_embeds.ext.regions.events import RegionEvent
from vllm._shm_embeds.ext.regions.registry import (
    UNKNOWN_REGION,
    Lease,
    RegionError,
    RegionLimits,
    RegionRegistry,
)
from vllm._shm_embeds.files.sockets import peer_is_sibling, received_fds

_MAX_REPLY = 1 << 20  # bytes of a lookup answer (digests included)
_TIMEOUT_S = 10.0


class RegionMirror:
    """Duck-types the request side of ``RegionRegistry`` (``lease``, ``find``,
    ``is_held``, ``close``, ``stats``) for an API server that does not
    serve the regions socket at ``path``.

    Args:
        path: the regions socket a sibling API server serves.
        limits: the model's limits (hidden size, max tokens) to check answers by.
        on_mirrored: ``(tensor, answer)`` for each region mapped here (the
            integration attaches the digests in the answer).
    """

    holds = "regions"  # service.current() finds it among the holders by this

    remote = True  # lookups are socket round trips: callers keep them off the event loop

    def __init__(self, path: str, limits: RegionLimits,
                 on_mirrored: Callable[[torch.Tensor, dict], None] | None = None) -> None:
        self.path = path
        self.on_mirrored = on_mirrored
        self.limits = dataclasses.replace(limits, allowed_uids=frozenset({os.getuid()}),
                                          max_regions_per_uid=1 << 30,
                                          max_bytes_per_uid=1 << 62)
        self._local = RegionRegistry(self.limits, counted=False)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _ask(self, region_id: str) -> tuple[dict, list[int]]:
        """One lookup round trip (lock held); reconnects once if the socket broke."""
        for attempt in (0, 1):
            try:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    sock.settimeout(_TIMEOUT_S)
                    try:
                        sock.connect(self.path)
                        if not peer_is_sibling(sock):
                            # Not this vllm serve's API server: it would learn every
                            # region id named here and could answer with any memory.
                            raise ConnectionRefusedError("not a sibling API server")
                    except OSError:
                        sock.close()
                        raise
                    self._sock = sock
                self._sock.send(json.dumps({"op": "lookup", "region": region_id}).encode())
                data, anc, _, _ = self._sock.recvmsg(
                    _MAX_REPLY, socket.CMSG_SPACE(4 * array.array("i").itemsize))
                fds = received_fds(anc)
                try:
                    if not data:
                        raise ConnectionError("the serving API server closed the connection")
                    answer = json.loads(data)
                    if not isinstance(answer, dict):
                        raise ValueError("not a JSON object")
                except BaseException:
                    for fd in fds:
                        os.close(fd)
                    raise
                return answer, fds
            except (OSError, ValueError, RecursionError):
                if self._sock is not None:
                    self._sock.close()
                    self._sock = None
                if attempt:
                    raise RegionError("registered regions are not reachable from this API "
                                      "server now; retry", "lookup") from None
        raise AssertionError("unreachable")

    def lease(self, region_id: Any, datatype: Any, shape: Any, byte_size: Any,
              offset: Any) -> Lease:
        """As ``RegionRegistry.lease``, by a lookup at the serving API server.
        Raises RegionError (unknown, mismatch, offset, not reachable)."""
        if not isinstance(region_id, str) or not 0 < len(region_id) <= 256:
            raise RegionError(UNKNOWN_REGION, "unknown")
        with self._lock:
            answer, fds = self._ask(region_id)
        for fd in fds[1:]:
            os.close(fd)
        if "error" in answer or len(fds) != 1:
            if fds:
                os.close(fds[0])
            raise RegionError(UNKNOWN_REGION, "unknown")
        # Checked as a registration: a sealed memfd of exactly that size.
        region = self._local.register(fds[0], os.getuid(), answer.get("datatype"),
                                      answer.get("shape"))
        try:
            if self.on_mirrored is not None:
                self.on_mirrored(region.tensor, answer)
            lease = self._local.lease(region.id, datatype, shape, byte_size, offset)
        finally:
            try:
                self._local.unregister(region.id)  # freed when the lease ends
            except RegionError:
                pass  # closed meanwhile (shutdown): already unregistered
        count(RegionEvent.REGION_LOOKUPS)
        return lease

    def find(self, tensor: torch.Tensor) -> tuple[int, int, int] | None:
        """``(pid, fd, inode)`` of a region mapped here for a request in flight."""
        return self._local.find(tensor)

    def is_held(self, tensor: Any) -> bool:
        return self._local.is_held(tensor)

    def send_view(self, tensor: Any) -> torch.Tensor | None:
        """As ``RegionRegistry.send_view``, for a region mapped here."""
        return self._local.send_view(tensor)

    def settle(self) -> int:
        """As ``RegionRegistry.settle``."""
        return self._local.settle()

    def stats(self) -> dict[str, Any]:
        return self._local.stats()

    def close(self) -> None:
        """Close the lookup connection; leases in flight keep their regions."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        self._local.close()
