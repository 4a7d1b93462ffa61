# SPDX-License-Identifier: Apache-2.0
"""Counters of what shm-embeds did: an in-memory add plus, with ``VLLM_SHM_EMBEDS_STATS_DIR``
set, a write to this process's ``prometheus_client`` multiprocess file. Never count from a
finalizer (this takes a lock). Base layer: may import the other base modules.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import enum
import glob
import json
import os
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple

from vllm._shm_embeds import config, extensions

FAMILY = "shm_embeds_event"
_LABELS = ("event", "role", "hop", "reason")
_HELP = "shm-embeds events of one process (internal; see vllm:shm_embeds_* on /metrics)"


class EventKind(enum.StrEnum):
    """A counted event; the value is the stored name. ``metric``: the
    ``vllm:shm_embeds_*`` family it feeds (no prefix), None: summary and tests only;
    ``labels``: :func:`count_reason`'s, () for :func:`count`; ``doc``: what it counts."""

    metric: str | None
    labels: tuple[str, ...]
    doc: str

    def __new__(cls, value: str, metric: str | None, doc: str,
                labels: tuple[str, ...] = ()) -> EventKind:
        member = str.__new__(cls, value)
        member._value_ = value
        member.metric, member.doc, member.labels = metric, doc, labels
        return member


class Event(EventKind):
    """The core's events (:class:`EventKind`)."""

    # hops (the sender counts tensors/bytes; a receiver's *_shm_tensors are received)
    HOP1_SHM_TENSORS = ("hop1_shm_tensors", "tensors", "hop-1 tensors sent by shared memory "
                        "(API server) or adopted (EngineCore: received_tensors)")
    HOP1_SHM_BYTES = ("hop1_shm_bytes", "bytes", "their bytes")
    HOP1_STOCK_TENSORS = ("hop1_stock_tensors", "tensors", "hop-1 tensors sent as ZMQ frames")
    HOP1_STOCK_BYTES = ("hop1_stock_bytes", "bytes", "their bytes")
    HOP2_SHM_TENSORS = ("hop2_shm_tensors", "tensors", "hop-2 tensors sent as handles "
                        "(EngineCore) or mapped (each TP worker: received_tensors)")
    HOP2_SHM_BYTES = ("hop2_shm_bytes", "bytes", "their bytes")
    HOP2_STOCK_TENSORS = ("hop2_stock_tensors", "tensors", "hop-2 tensors sent the stock way "
                          "(in the broadcast, or over ZMQ per reader)")
    HOP2_STOCK_BYTES = ("hop2_stock_bytes", "bytes", "their bytes")
    HOP1_ADOPTED_TENSORS = ("hop1_adopted_tensors", None, "hop-1 segments the EngineCore adopted")
    HOP1_HANDOVER_TENSORS = ("hop1_handover_tensors", "reused_tensors",
                             "a binary or JSON-path body's segment sent at hop 1 as it is")
    HOP2_REUSED_TENSORS = ("hop2_reused_tensors", "reused_tensors",
                           "hop-2 tensors sent without a copy (segments adopted at hop 1)")
    HOP2_PLACEHOLDER_TENSORS = ("hop2_placeholder_tensors", "placeholder_tensors", "hop-2 "
                                "tensors a later pipeline stage's worker did not map")
    HOP2_READER_TENSORS = ("hop2_reader_tensors", "reader_tensors", "hop-2 tensors per "
                           "reader of the broadcast, by what it got (EngineCore)",
                           ("hop", "reason"))
    HOP2_REMOTE_BYTES = ("hop2_remote_bytes", "remote_bytes", "tensor bytes x remote "
                         "readers that got the bytes at hop 2 (EngineCore)")
    FALLBACK = ("fallback", "fallbacks", "tensors that took the stock path (or failed)",
                ("hop", "reason"))
    # segments
    COPIED_BYTES = ("copied_bytes", "copied_bytes", "bytes copied into segments")
    SEGMENTS_CREATED = ("segments_created", "segments_created", "segments created")
    SEGMENTS_UNLINKED = ("segments_unlinked", "segments_unlinked", "segments their owner unlinked")
    SEGMENTS_SWEPT = ("segments_swept", "segments_swept", "segments of dead owners removed")
    ADOPT_NAMES_TAKEN = ("adopt_names_taken", "adopt_names_taken",
                         "names found taken when adopting (another name was drawn)")
    ENGINE_PAGES_RELEASED = ("engine_pages_released", None, "adopted segments whose pages "
                             "the EngineCore let go of once vLLM freed the request")
    # hops/hop1.py and ext/digests
    HASH_REJECTED_META = ("hash_rejected_meta", None, "digests the EngineCore refused")


class Key(NamedTuple):
    """One counter: an event, with ``hop`` and ``reason`` for labelled events."""

    event: str
    hop: str = ""
    reason: str = ""

    def flat(self) -> str:
        """Name in :func:`stats` and the summary, e.g. ``fallback.hop1.no_space``."""
        return ".".join([self.event, *([f"hop{self.hop}"] if self.hop else []),
                         *([self.reason] if self.reason else [])])


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
                except OSError:
                    pass  # counters are best effort, never fail a request
                else:  # a file this pid left earlier: go on from its values
                    for mkey, value, _ in self.file.read_all_values():
                        slot = parse_labels(json.loads(mkey)[2])
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
                if slot not in self.keys:
                    self.keys[slot] = mmap_key(FAMILY, FAMILY, _LABELS,
                                               (key.event, self.role, key.hop, key.reason), _HELP)
                store.write_value(self.keys[slot], float(self.file_totals[slot]), 0.0)


_state = _Counters()


def reset() -> None:
    """Start this process's counts again from zero (tests, and a forked child)."""
    global _state
    _state = _Counters()


os.register_at_fork(after_in_child=reset)


def set_role(role: str) -> None:
    """Record this process's role (``client``, ``engine``, ``worker``) for later counts."""
    state = _state
    with state.lock:
        state.roles.add(role)
        state.role = "+".join(sorted(state.roles))


def roles() -> list[str]:
    return sorted(_state.roles)


def events() -> list[EventKind]:
    """Every declared event: the core's, then each loaded extension's (metrics, tests)."""
    return [*Event, *(e for ext in extensions.loaded().values() for e in ext.events or ())]


def count(event: EventKind, n: int = 1, /) -> None:
    """Add ``n`` to a plain event."""
    _state.add({Key(event.value): n})


def count_many(deltas: Mapping[EventKind, int]) -> None:
    """Add to several plain events at once (one lock)."""
    _state.add({Key(event.value): n for event, n in deltas.items()})


def count_reason(event: EventKind | str, reason: str, hop: str = "", n: int = 1) -> None:
    """Add ``n`` to a labelled event, e.g. ``count_reason(Event.FALLBACK, "small", hop="1")``."""
    _state.add({Key(str(event), hop, reason): n})


def stats() -> dict[str, int]:
    """A copy of this process's counters (:meth:`Key.flat` name -> count)."""
    state = _state
    with state.lock:
        return {key.flat(): n for key, n in state.totals.items()}


def stats_files(stats_dir: str) -> dict[int, str]:
    """Pid -> the counter file it wrote in ``stats_dir``."""
    paths = sorted(glob.glob(os.path.join(glob.escape(stats_dir), "counter_*.db")))
    return {int(os.path.basename(p)[len("counter_"):-len(".db")]): p for p in paths}


def parse_labels(labels: dict[str, str]) -> tuple[Key, str]:
    """A stored sample's labels -> its ``(key, role)``."""
    return Key(labels.get("event", ""), labels.get("hop", ""),
               labels.get("reason", "")), labels.get("role", "")

