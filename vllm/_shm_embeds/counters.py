# SPDX-License-Identifier: Apache-2.0
"""Counters of what shm-embeds did, in every process of a server.

A count is an in-memory add plus, when ``VLLM_SHM_EMBEDS_STATS_DIR`` is set
(an API server sets it for all its processes: ``http/metrics.py``), one
``struct.pack_into`` on an mmap'd file of ``prometheus_client``'s
multiprocess mode (``<dir>/counter_<pid>.db``, the library's
``MmapedDict``): no file is rewritten, no lock is shared between processes.
``/metrics`` and the tests read all processes' files with the library's
reader (:func:`read_server`, :func:`read_stats_dir`).

Each value is stored as a sample of one family, :data:`FAMILY`, labelled
with the event name, the process's role(s) when it was counted (``client``,
``engine``, ``worker``; a hop's sender and receiver count the same event
name) and, for the labelled events, ``hop`` and ``reason``. The public
``vllm:shm_embeds_*`` families are derived from these at scrape time
(``http/metrics.py``).

Events (bytes in bytes): ``hop{1,2}_{shm,stock}_{tensors,bytes}``,
``hop1_adopted_tensors``, ``hop1_handover_tensors``, ``hop2_reused_tensors``
(sent without a copy), ``copied_bytes`` (bytes copied into segments),
``segments_created``, ``segments_unlinked``, ``segments_swept``, the
binary, JSON and digest events of ``http/`` and ``digests.py``, and the
labelled :func:`count_reason` events ``fallback`` (hop, reason),
``binary_rejected`` and ``json_fallback`` (reason). Never count from a
finalizer (this takes a lock).
"""

from __future__ import annotations

import glob
import json
import os
import threading
from collections import Counter
from typing import Any, NamedTuple

from vllm._shm_embeds import config

FAMILY = "shm_embeds_event"
_LABELS = ("event", "role", "hop", "reason")
_HELP = "shm-embeds events of one process (internal; see vllm:shm_embeds_* on /metrics)"


class Key(NamedTuple):
    """One counter: an event, with ``hop`` and ``reason`` for labelled events."""

    event: str
    hop: str = ""
    reason: str = ""

    def flat(self) -> str:
        """The key's name in :func:`stats` and the summary log line, e.g.
        ``fallback.hop1.no_space``, ``binary_rejected.size``, ``copied_bytes``."""
        parts = [self.event] + ([f"hop{self.hop}"] if self.hop else []) + (
            [self.reason] if self.reason else [])
        return ".".join(parts)


class _Counters:
    """This process's counts and its multiprocess file; a forked child makes new ones."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.roles: set[str] = set()
        self.role = ""  # sorted roles joined by "+": a label of every count
        self.totals: Counter[Key] = Counter()
        self.file_totals: Counter[tuple[Key, str]] = Counter()
        self.file: Any = None  # prometheus_client MmapedDict
        self.file_dir: str | None = None
        self.keys: dict[tuple[Key, str], str] = {}

    def _file_for(self, directory: str | None) -> Any:
        """The MmapedDict of this process in ``directory`` (lock held)."""
        if directory != self.file_dir:
            if self.file is not None:
                self.file.close()
            self.file, self.file_dir = None, directory
            self.file_totals.clear()
            if directory:
                from prometheus_client.mmap_dict import MmapedDict

                try:
                    self.file = MmapedDict(os.path.join(directory, f"counter_{self.pid}.db"))
                except OSError:  # counters are best effort, never fail a request
                    self.file = None
                else:  # a file this pid left earlier: go on from its values
                    for mkey, value, _ in self.file.read_all_values():
                        slot = _parse(json.loads(mkey)[2])
                        self.keys[slot] = mkey
                        self.file_totals[slot] = value
        return self.file

    def add(self, deltas: dict[Key, int]) -> None:
        with self.lock:
            self.totals.update(deltas)
            store = self._file_for(config.stats_dir())
            if store is None:
                return
            from prometheus_client.mmap_dict import mmap_key

            for key, delta in deltas.items():
                slot = (key, self.role)
                self.file_totals[slot] += delta
                mkey = self.keys.get(slot)
                if mkey is None:
                    mkey = self.keys[slot] = mmap_key(
                        FAMILY, FAMILY, _LABELS, (key.event, self.role, key.hop, key.reason),
                        _HELP)
                store.write_value(mkey, float(self.file_totals[slot]), 0.0)


_state = _Counters()


def _after_fork_in_child() -> None:
    global _state
    _state = _Counters()  # a forked child counts for itself, in a file of its own


os.register_at_fork(after_in_child=_after_fork_in_child)


def reset() -> None:
    """Start this process's counts again from zero (tests)."""
    global _state
    _state = _Counters()


def set_role(role: str) -> None:
    """Record what this process is (``client``, ``engine``, ``worker``); later
    counts carry it (a hop's sender and receiver count the same event names)."""
    state = _state
    with state.lock:
        if role not in state.roles:
            state.roles.add(role)
            state.role = "+".join(sorted(state.roles))


def roles() -> list[str]:
    """This process's roles, sorted."""
    return sorted(_state.roles)


def count(**deltas: int) -> None:
    """Add to this process's counters, e.g. ``count(hop2_shm_tensors=1)``."""
    _state.add({Key(name): n for name, n in deltas.items()})


def count_reason(event: str, reason: str, hop: str = "", n: int = 1) -> None:
    """Add ``n`` to a labelled event, e.g. ``count_reason("fallback", "small", hop="1")``."""
    _state.add({Key(event, hop, reason): n})


def stats() -> dict[str, int]:
    """A copy of this process's counters (:meth:`Key.flat` name -> count)."""
    state = _state
    with state.lock:
        return {key.flat(): n for key, n in state.totals.items()}


def _files(stats_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(stats_dir), "counter_*.db")))


def _parse(labels: dict[str, str]) -> tuple[Key, str]:
    return Key(labels.get("event", ""), labels.get("hop", ""),
               labels.get("reason", "")), labels.get("role", "")


def read_server(stats_dir: str) -> dict[tuple[Key, str], float]:
    """Every process's counts in ``stats_dir`` summed per ``(key, role)``.

    Uses ``prometheus_client.multiprocess.MultiProcessCollector`` (the
    library's merge of the per-process files). Empty if the directory is
    missing or holds no file.
    """
    from prometheus_client.multiprocess import MultiProcessCollector

    files = _files(stats_dir) if stats_dir else []
    out: dict[tuple[Key, str], float] = {}
    if not files:
        return out
    for metric in MultiProcessCollector.merge(files, accumulate=True):
        if metric.name != FAMILY:
            continue
        for sample in metric.samples:
            slot = _parse(dict(sample.labels))
            out[slot] = out.get(slot, 0) + sample.value
    return out


def read_stats_dir(stats_dir: str) -> list[dict[str, Any]]:
    """Each process's counters in ``stats_dir`` (tests, benchmarks, the main job).

    Returns ``[{"pid": int, "roles": [str], "counters": {flat name: int}}]``,
    one record per process file, read with ``prometheus_client``'s reader.
    """
    from prometheus_client.mmap_dict import MmapedDict

    out = []
    for path in _files(stats_dir):
        pid = int(os.path.basename(path)[len("counter_"):-len(".db")])
        counters: Counter[str] = Counter()
        seen: set[str] = set()
        for mkey, value, _, _ in MmapedDict.read_all_values_from_file(path):
            _, _, labels, _ = json.loads(mkey)
            key, role = _parse(labels)
            counters[key.flat()] += int(value)
            seen.update(r for r in role.split("+") if r)
        out.append({"pid": pid, "roles": sorted(seen), "counters": dict(counters)})
    return out


def server_pids(stats_dir: str) -> set[int]:
    """Pids of the processes that counted in ``stats_dir``."""
    return {int(os.path.basename(p)[len("counter_"):-len(".db")]) for p in _files(stats_dir)}

