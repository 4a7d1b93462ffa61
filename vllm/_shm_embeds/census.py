# SPDX-License-Identifier: Apache-2.0
"""What our segment files hold in the segment directory, counted off the caller's thread.

The budget (``transfer.check_budget``) needs the bytes that the server's
segment files hold in the directory: a walk of the directory plus an
``lstat`` per name like ours (``segment_dir.held_bytes``). That is cheap for the
names we make, but the directory is usually ``/dev/shm`` (mode 1777): any
local user may plant names like ours by the million, and the budget is asked
on the API server's event loop (a binary body's segment and each of its
grants). So :class:`Census` never walks on a thread that runs an asyncio
event loop once it has a first count: such a caller gets the last walk's
total plus the bytes this process wrote into segments since that walk began
(kept in memory), and a walk older than :data:`MIN_INTERVAL_S` starts a new
one on a thread of its own (one at a time; the next waits twice as long as
the last one took, so a directory of planted names costs at most a third of
a core). Any other thread walks, as before, and gets the exact count.

On the event loop, what other processes wrote or removed since the last
walk is seen at the next one (within :data:`MIN_INTERVAL_S` plus a walk),
and so is what this process removed; bytes this process wrote during a walk
may count twice until the next. Every error but the other processes' new
files is on the safe side (more counted, the stock path sooner).

Knows segment files, not vLLM and not HTTP.
"""

from __future__ import annotations

import asyncio
import threading
import time

from vllm._shm_embeds import segment_dir

MIN_INTERVAL_S = 0.05  # a count at most this old (plus a walk) is used as it is


class Census:
    """Bytes our segment files hold in one directory (``segment_dir.held_bytes``),
    refreshed off the caller's thread.

    Args:
        directory: the segment directory.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._held: int | None = None  # the last walk's total (bytes)
        self._written = 0  # bytes this process wrote since the last walk began
        self._next_at = 0.0  # monotonic time before which no walk starts
        self._walking = False

    def wrote(self, nbytes: int) -> None:
        """This process wrote ``nbytes`` more into segment files in the directory."""
        with self._lock:
            self._written += nbytes

    def held(self) -> int:
        """Bytes held (see the module docstring). On an event loop's thread
        only the first call walks (there is no count yet)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # not an event loop's thread: walk, exactly
            with self._lock:
                self._walking = True
            self._walk()
            with self._lock:
                return (self._held or 0) + self._written
        with self._lock:
            first = self._held is None
            start = (not first and not self._walking
                     and time.monotonic() >= self._next_at)
            if first or start:
                self._walking = True
        if first:
            self._walk()
        elif start:
            threading.Thread(target=self._walk, name="shm-embeds-census",
                             daemon=True).start()
        with self._lock:
            return (self._held or 0) + self._written

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
