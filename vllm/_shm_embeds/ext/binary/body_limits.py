# SPDX-License-Identifier: Apache-2.0
"""The limits on untrusted request bodies (``docs/security.md``).

* :func:`byte_count`: a header value that is a byte count, or None.
* :func:`receive_body_message` (per-receive timeout, ``Stalled``) and
  :func:`deadline_for` (an overall deadline by the body's size).
* :class:`InFlight` / :data:`IN_FLIGHT`: bytes the body paths hold in
  memory at once, charged as they arrive.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

from vllm._shm_embeds.ext.binary.common import Receive
from vllm._shm_embeds.ext.binary.settings import body_deadline_s, body_timeout_s, inflight_bytes

_BYTE_COUNT = re.compile(r"[0-9]{1,19}")  # ASCII digits only ("²".isdigit() is True)


def byte_count(value: str | None) -> int | None:
    """A header value that is a byte count (ASCII digits, surrounding spaces
    allowed, below 10**19), as an int; None if absent or anything else."""
    if value is None:
        return None
    value = value.strip(" \t")
    return int(value) if _BYTE_COUNT.fullmatch(value) else None


class Stalled(Exception):
    """The client sent no body bytes for ``settings.BODY_TIMEOUT_S`` seconds,
    or the body took longer in all than :func:`deadline_for` allows."""


def deadline_for(nbytes: int) -> float:
    """The ``time.monotonic()`` by which a body of ``nbytes`` must have arrived
    (``settings.body_deadline_s``: timeout plus size over the minimum rate)."""
    return time.monotonic() + body_deadline_s(nbytes)


async def receive_body_message(receive: Receive, deadline: float | None = None) -> dict:
    """The next ASGI message of a request body, waiting at most
    ``settings.BODY_TIMEOUT_S`` seconds, and never past ``deadline``
    (``time.monotonic()``; :func:`deadline_for`).

    Raises:
        Stalled: nothing came in time, or the deadline passed (the caller
            answers 408 and frees what the body held).
    """
    timeout = body_timeout_s()
    slow = False
    if deadline is not None:
        left = deadline - time.monotonic()
        if left < timeout:
            timeout, slow = max(0.0, left), True
    try:
        return await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        if slow:
            raise Stalled("the request body arrived slower than the server's minimum "
                          "rate") from None
        raise Stalled(f"no request body bytes for {timeout:g} s") from None


class InFlight:
    """Bytes the body paths hold in memory now (this process), charged as they
    arrive (``gate.Body``), never by what a client declares.

    :meth:`take` charges bytes if the total stays within
    ``settings.inflight_bytes()``; :meth:`room` tells whether a new
    body may start; :meth:`give_back` returns a body's charge once it is in.
    Thread-safe; only ever touched on the event loop in practice.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.bytes + nbytes > inflight_bytes():
                return False
            self.bytes += nbytes
            return True

    def room(self) -> bool:
        """Whether a new body may start (the cap is not reached)."""
        with self._lock:
            return self.bytes < inflight_bytes()

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self.bytes -= nbytes


IN_FLIGHT = InFlight()
