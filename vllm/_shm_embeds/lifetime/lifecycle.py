# SPDX-License-Identifier: Apache-2.0
"""An owned segment's :class:`Kind` and :class:`State`; it moves only by the events of
:data:`TRANSITIONS` (any other move is refused by :func:`check`)."""

from __future__ import annotations

import dataclasses
import enum
import mmap
import os
import weakref
from typing import NamedTuple

import torch
from vllm.logger import init_logger

from vllm._shm_embeds import config
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.handle import READER_FLAGS_OFFSET, SharedTensorHandle

logger = init_logger(__name__)


class Kind(enum.Enum):
    """How a segment came to this process."""

    ADOPTED = "adopted"  # hop 1: a peer's segment, renamed to ours and mapped
    HELD_FILE = "held_file"  # hop 1: a held file's header adopted, its memfd mapped
    COPY = "copy"  # hop 2: a copy of a tensor, only its header mapped here
    STREAMED = "streamed"  # a request body written into it here, for hop 1's hand-over


class State(enum.Enum):
    HELD = "held"
    BROADCAST = "broadcast"
    FREED = "freed"
    MAPPED = "mapped"
    DRAINING = "draining"
    GONE = "gone"


class Transition(NamedTuple):
    """``event`` moves a segment of ``kinds`` from ``source`` (None: new) to one of ``to``."""

    event: str
    source: State | None
    to: frozenset[State]
    kinds: frozenset[Kind]


# Finalizers' records: a mapped segment's tensor storage freed; a hop-2 copy's source
# tensor (data address ``ptr``) freed; a zero-copy send of its bytes done.
StorageDied = NamedTuple("StorageDied", [("name", str)])
SourceDied = NamedTuple("SourceDied", [("name", str), ("ptr", int)])
SendDone = NamedTuple("SendDone", [("name", str)])


class IllegalTransition(RuntimeError):
    """An event that :data:`TRANSITIONS` does not allow (raised if :func:`strict`)."""


HELD, BROADCAST, FREED, MAPPED, DRAINING, GONE = State
ALL = frozenset(Kind)
SENT = frozenset({Kind.ADOPTED, Kind.HELD_FILE, Kind.COPY})  # broadcast at hop 2
MAPS = frozenset({Kind.ADOPTED, Kind.HELD_FILE, Kind.STREAMED})  # a tensor maps it here


def _row(event: str, source: State | None, to: set[State], kinds: frozenset[Kind]) -> Transition:
    return Transition(event, source, frozenset(to), kinds)


# Events that no call makes: seen by the books at a safe point.
OBSERVED = frozenset({
    "die",  # its tensor's storage, or a copy's source, was freed (a finalizer's record)
    "settle",  # the readers of its broadcasts have set their flags (``collect``)
    "vanish",  # another process removed its name (seen by ``broadcast``)
    "sent",  # the last zero-copy send of its bytes is done (a finalizer's record)
})

# The only moves a segment makes (events: ``OwnedSegments`` methods, or OBSERVED).
TRANSITIONS: tuple[Transition, ...] = (
    _row("own", None, {HELD}, ALL),
    _row("broadcast", HELD, {BROADCAST}, SENT),
    _row("broadcast", BROADCAST, {BROADCAST}, SENT),
    # (vLLM freed the request on another thread since hop 2 looked it up)
    _row("broadcast", FREED, {FREED}, SENT),
    # readers done: still in use, unlinked (pages mapped here if nothing tells the end), gone
    _row("settle", BROADCAST, {HELD, MAPPED, GONE}, SENT),
    _row("settle", FREED, {GONE, DRAINING}, SENT),
    # another process removed the name before hop 2 could reuse it
    _row("vanish", HELD, {MAPPED, GONE}, SENT),
    _row("hand_over", HELD, {MAPPED}, frozenset({Kind.STREAMED})),
    _row("release_adopted", HELD, {GONE, DRAINING}, SENT),
    _row("release_adopted", BROADCAST, {FREED, GONE, DRAINING}, SENT),
    _row("release_adopted", FREED, {FREED, GONE, DRAINING}, SENT),
    _row("release_adopted", MAPPED, {GONE, DRAINING}, MAPS),
    _row("release_streamed", HELD, {GONE, DRAINING}, frozenset({Kind.STREAMED})),
    _row("release_streamed", MAPPED, {GONE, DRAINING}, MAPS),
    # the last zero-copy send of its bytes is done: its pages may go
    _row("sent", DRAINING, {GONE}, MAPS),
    _row("die", HELD, {GONE}, ALL),
    _row("die", BROADCAST, {BROADCAST}, SENT),
    _row("die", FREED, {FREED}, SENT),
    _row("die", MAPPED, {GONE}, MAPS),
    *(_row("unlink_all", s, {GONE}, ALL) for s in (HELD, BROADCAST, FREED, MAPPED, DRAINING)),
)

_ALLOWED: dict[tuple[str, State | None], Transition] = {(t.event, t.source): t for t in TRANSITIONS}


def allowed(kind: Kind, event: str, source: State | None, to: State) -> bool:
    """True if :data:`TRANSITIONS` lets ``event`` move a ``kind`` segment ``source`` -> ``to``."""
    t = _ALLOWED.get((event, source))
    return t is not None and to in t.to and kind in t.kinds


def strict() -> bool:
    return config.strict()


def check(kind: Kind, event: str, source: State | None, to: State, name: str = "") -> bool:
    """Whether the move is allowed; if not, log it (raise if :func:`strict`)."""
    if allowed(kind, event, source, to):
        return True
    what = (f"illegal segment transition {event}: {source and source.name} -> {to.name} "
            f"({kind.value} {name})")
    if strict():
        raise IllegalTransition(what)
    logger.error("shm-embeds: %s refused; please report this bug", what)
    return False


@dataclasses.dataclass(eq=False)
class OwnedSegment:
    """One segment this process owns (or, ``MAPPED``, still maps).

    Attributes:
        mm: a mapping whose first page is the header (reader flags).
        key: the data address of the tensor that maps it here, or a copy's source's.
        data_ptr: its data's address here while a tensor maps it, else None.
        fds: its files, open while broadcasts are pending (a held file's always).
        broadcasts: ``(flag_base, readers)`` of broadcasts not all flagged.
        sends: zero-copy sends not done; its pages stay while > 0.
    """

    handle: SharedTensorHandle
    mm: mmap.mmap | None
    kind: Kind
    key: int
    state: State | None = None
    data_ptr: int | None = None
    source: weakref.ref | None = None
    fds: list[int] | None = None
    broadcasts: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    next_flag: int = 0
    sends: int = 0

    def maps(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` is exactly this segment's mapping."""
        return (self.data_ptr == tensor.data_ptr() and tensor.dtype == self.handle.torch_dtype
                and tuple(tensor.shape) == self.handle.shape)

    def in_use(self, release_known: bool) -> bool:
        """True while its tensor (or a copy's source) lives and vLLM has not freed it."""
        if self.state is FREED or not release_known:
            return False
        return self.data_ptr is not None or (self.source is not None
                                             and self.source() is not None)

    def settle(self) -> None:
        """Forget the broadcasts whose readers all set their flags."""
        start = READER_FLAGS_OFFSET
        self.broadcasts = [(base, readers) for base, readers in self.broadcasts
                           if b"\x00" in self.mm[start + base : start + base + readers]]

    def close_fds(self) -> None:
        for fd in self.fds or ():
            os.close(fd)
        self.fds = None


class Index:
    """A process's segments not ``GONE``, by name and (not ``MAPPED``) by key; only
    :meth:`move` changes a state (the caller holds ``OwnedSegments._lock``)."""

    def __init__(self) -> None:
        self._names: dict[str, OwnedSegment] = {}
        self._keys: dict[int, str] = {}  # key -> name; the last one owned wins

    def __len__(self) -> int:
        return len(self._names)

    def get(self, name: str) -> OwnedSegment | None:
        return self._names.get(name)

    def at(self, key: int) -> OwnedSegment | None:
        """The segment last owned at address ``key``, if any."""
        name = self._keys.get(key)
        return self._names.get(name) if name is not None else None

    def unkey(self, key: int | None, name: str) -> None:
        if key is not None and self._keys.get(key) == name:
            del self._keys[key]

    def all(self) -> list[OwnedSegment]:
        return list(self._names.values())

    def linked(self) -> list[OwnedSegment]:
        """The segments whose names are linked (not ``MAPPED`` or ``DRAINING``)."""
        return [e for e in self._names.values() if e.state not in (MAPPED, DRAINING)]

    def containing(self, tensor: torch.Tensor) -> OwnedSegment | None:
        """The segment whose live mapping here holds all of ``tensor``'s storage, if any."""

        def holds(e: OwnedSegment | None) -> bool:
            return (e is not None and e.data_ptr is not None and e.mm is not None
                    and e.state not in (DRAINING, GONE) and seg.within(e.mm, tensor))

        first = self.at(tensor.data_ptr())  # most often, the tensor is the whole segment
        return next((e for e in (first, *self._names.values()) if holds(e)), None)

    def mapped(self, tensor: torch.Tensor) -> OwnedSegment | None:
        """The ``MAPPED`` segment that is exactly ``tensor``, if any."""
        return next((e for e in self._names.values()
                     if e.state is MAPPED and e.maps(tensor)), None)

    def move(self, entry: OwnedSegment, event: str, to: State) -> bool:
        """Make ``event`` move ``entry`` to ``to`` if the table allows it (else False)."""
        name = entry.handle.name
        if not check(entry.kind, event, entry.state, to, name):
            return False
        if entry.state is None:
            self._names[name] = entry
            self._keys[entry.key] = name
        entry.state = to
        if to in (MAPPED, DRAINING, GONE):
            self.unkey(entry.key, name)
        if to is GONE:
            self._names.pop(name, None)
        return True
