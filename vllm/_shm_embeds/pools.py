# SPDX-License-Identifier: Apache-2.0
"""Thread pools of this process, each made on first use and forgotten in a forked
child (its parent's threads are not its own): :class:`LazyPool`. Knows threads only."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable

_POOLS: list[LazyPool] = []


class LazyPool:
    """One job's threads: ``threads`` of them (a number, or a getter read when the pool
    is made), named ``name``_N; :meth:`get` makes the pool once per process."""

    def __init__(self, threads: int | Callable[[], int], name: str) -> None:
        self._threads, self._name = threads, name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        _POOLS.append(self)

    def get(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                n = self._threads() if callable(self._threads) else self._threads
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    n, thread_name_prefix=self._name)
            return self._pool

    def _forget(self) -> None:
        self._pool, self._lock = None, threading.Lock()  # another thread may have held it


def _after_fork_in_child() -> None:
    for pool in _POOLS:
        pool._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)
