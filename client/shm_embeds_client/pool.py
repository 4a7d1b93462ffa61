# SPDX-License-Identifier: Apache-2.0
"""Connection pools: the ``httpx`` clients calls send through when the caller
passes none, made once and reused (a new ``httpx.Client`` loads an SSL context:
35-175 ms on a busy 2-core host, more than a whole kept turn at small sizes).

* one-shot helpers (``complete``, ``chat``, ...): :func:`default_client`, one
  per process (``httpx.Client`` is thread-safe), and :func:`default_async_client`,
  one per event loop; :func:`close` closes them (also done at exit);
* a conversation: a :class:`Pool` of its own, shared with its forks, closed by
  the last of them to close (``close()``/``aclose()`` or ``with``).

A forked child never uses its parent's connections: it makes its own.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import httpx

__all__ = ["Pool", "close", "default_async_client", "default_client"]

_lock = threading.Lock()
_default: dict[str, httpx.Client] = {}
_default_async: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> client


def default_client() -> httpx.Client:
    """This process's shared ``httpx.Client`` (made on first use; per-request
    timeouts are the caller's)."""
    with _lock:
        client = _default.get("client")
        if client is None or client.is_closed:
            client = _default["client"] = httpx.Client(timeout=None)
        return client


def default_async_client() -> httpx.AsyncClient:
    """The running event loop's shared ``httpx.AsyncClient`` (made on first use;
    let go with the loop). Raises RuntimeError outside a running loop."""
    loop = asyncio.get_running_loop()
    with _lock:
        client = _default_async.get(loop)
        if client is None or client.is_closed:
            client = _default_async[loop] = httpx.AsyncClient(timeout=None)
        return client


def close() -> None:
    """Close the process's shared sync client (the next call makes a new one);
    the async ones are let go (their loops may be gone)."""
    with _lock:
        client = _default.pop("client", None)
        _default_async.clear()
    if client is not None:
        client.close()


class Pool:
    """A lazily made client (``make()``: ``httpx.Client`` or ``httpx.AsyncClient``)
    shared by a conversation and its forks: :meth:`share` adds a user,
    :meth:`release` removes one and hands the client back to close when it was
    the last (None otherwise, or if none was made)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._client: Any = None
        self._users = 1
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def get(self) -> Any:
        """The client (made on first use; made anew in a forked child)."""
        with self._lock:
            if self._users <= 0:
                raise RuntimeError("this conversation's connections are closed")
            if self._client is None or self._pid != os.getpid():
                self._client, self._pid = self._make(), os.getpid()
            return self._client

    def share(self) -> Pool:
        """Another user of the client (a fork); a closed pool stays closed."""
        with self._lock:
            if self._users > 0:
                self._users += 1
        return self

    def release(self) -> Any:
        with self._lock:
            self._users -= 1
            if self._users > 0 or self._pid != os.getpid():
                return None
            client, self._client = self._client, None
            return client


def _forget_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _default.clear()  # the parent's sockets: never closed or used here
    _default_async.clear()


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(close)
