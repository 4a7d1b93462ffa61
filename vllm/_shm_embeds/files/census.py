# SPDX-License-Identifier: Apache-2.0
"""The bytes our segment files hold, for the budget: this process's writes and unlinks at
once, the rest by a walk on a thread of its own once the count is older than
:data:`MIN_INTERVAL_S`. Errors are on the safe side (more counted)."""

from __future__ import annotations

import threading
import time

from vllm._shm_embeds.files import segment_dir

MIN_INTERVAL_S = 0.05  # a count at most this old (plus a walk) is used as it is


class Census:

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._held: int | None = None  # the last walk's total (bytes)
        self._written = 0  # bytes this process wrote since the last walk began
        self._next_at = 0.0  # monotonic time before which no walk starts
        self._walking = True
        self._threads = 0  # walks started on a thread and not finished
        self._done = threading.Condition(self._lock)
        self._start_walk()  # the first count, off the caller's thread

    def wrote(self, nbytes: int) -> None:
        with self._lock:
            self._written += nbytes

    def unlinked(self, nbytes: int) -> None:
        """This process unlinked a file of ``nbytes`` (a walk under way may undercount)."""
        with self._lock:
            self._written -= nbytes

    def held(self) -> int:
        """The last walk's total plus this process's writes since; never walks here."""
        with self._lock:
            start = not self._walking and time.monotonic() >= self._next_at
            if start:
                self._walking = True
            held = max(0, (self._held or 0) + self._written)
        if start:
            self._start_walk()
        return held

    def settle(self, timeout: float = 30.0) -> int:
        """Wait for a walk under way (``timeout`` s), walk here: the exact count (tests)."""
        with self._lock:
            self._walking = True
            self._done.wait_for(lambda: self._threads == 0, timeout)
        self._walk()
        return self.held()

    def _start_walk(self) -> None:
        with self._lock:
            self._threads += 1
        try:
            threading.Thread(target=self._walk_on_thread, name="shm-embeds-census",
                             daemon=True).start()
        except RuntimeError:  # interpreter shutting down: keep the last count
            with self._lock:
                self._walking = False
                self._threads -= 1

    def _walk_on_thread(self) -> None:
        try:
            self._walk()
        finally:
            with self._lock:
                self._threads -= 1
                self._done.notify_all()

    def _walk(self) -> None:
        began = time.monotonic()
        with self._lock:
            written_before = self._written
        try:
            held = segment_dir.held_bytes(self.directory)
        except Exception:  # noqa: BLE001 - keep the last count; never raise on a thread
            held = self._held or 0
        took = time.monotonic() - began
        with self._lock:
            self._held = held
            self._written -= written_before  # what was written since stays counted
            self._next_at = time.monotonic() + max(MIN_INTERVAL_S, 2 * took)
            self._walking = False
