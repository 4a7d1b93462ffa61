# SPDX-License-Identifier: Apache-2.0
"""Segment names and :class:`SharedTensorHandle`: what crosses a hop instead of bytes.
Pure data and parsing, no I/O. Base layer: may import the other base modules.
Design notes (the segment layout): docs/design.md, "Module notes"."""

from __future__ import annotations

import dataclasses
import math
import mmap
import re
import reprlib
from typing import Any

import torch

from vllm._shm_embeds.config import MAX_WRITERS

SEGMENT_PREFIX = "vllm-shm-embeds"
HEADER_BYTES = 4096
MAGIC = b"SHMEMB01"
# The hop-2 wire format (pickled handles and forms, the per-step agreement): bump on any
# change; a worker answering another number keeps its engine's hop 2 stock.
HOP2_WIRE = 4
READER_FLAGS_OFFSET = 64
MAX_READERS = HEADER_BYTES - READER_FLAGS_OFFSET  # flag bytes per segment
PAGE_BYTES = mmap.PAGESIZE
PART_MIN_BYTES = 4 << 20  # a segment is striped only into files at least this big


class ShmEmbedsError(RuntimeError):
    """A segment could not be created, found or mapped."""


# Canonical numbers only (ASCII digits, no leading zero, at most 20 digits, no part 0),
# so a name parses to one that prints back the same.
_NUM = r"(0|[1-9][0-9]{0,19})"
_NAME_RE = re.compile(rf"{re.escape(SEGMENT_PREFIX)}\.{_NUM}\.{_NUM}\.{_NUM}\.{_NUM}"
                      r"(?:p([1-9][0-9]{0,19}))?", re.ASCII)


@dataclasses.dataclass(frozen=True)
class SegmentName:
    """A segment file name's parts: the owner's ``pidns`` (inode of
    ``/proc/<pid>/ns/pid``, or 0), ``pid``, ``start`` (clock ticks since boot; 0 if
    unknown), ``seq``, and ``part`` (file index)."""

    pidns: int
    pid: int
    start: int
    seq: int
    part: int = 0

    def __str__(self) -> str:
        return part_name(f"{SEGMENT_PREFIX}.{self.pidns}.{self.pid}.{self.start}.{self.seq}",
                         self.part)

    @classmethod
    def parse(cls, name: str) -> SegmentName | None:
        """The parts of ``name``, or None if it is not a segment file name of ours."""
        m = _NAME_RE.fullmatch(name) if isinstance(name, str) else None
        return None if m is None else cls(*(int(g or 0) for g in m.groups()))

    def base(self) -> SegmentName:
        """The segment's own name (file 0)."""
        return dataclasses.replace(self, part=0)


def part_name(name: str, index: int) -> str:
    """File name of part ``index`` of segment ``name`` (part 0 is ``name`` itself)."""
    return name if index == 0 else f"{name}p{index}"


def torch_dtype(name: str, what: str = "handle") -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``); raises ShmEmbedsError if none."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ShmEmbedsError(f"{what} names an unknown dtype {name!r}")
    return dt


@dataclasses.dataclass(frozen=True)
class SharedTensorHandle:
    """Names a tensor stored in a shared-memory segment; a few hundred bytes pickled.

    Attributes:
        name: segment file name (no directory part); file 0 when striped.
        dtype: torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``.
        shape: tensor shape, e.g. ``(num_tokens, hidden_size)``.
        split: data byte offsets where files 1, 2, ... begin (page multiples).
        flag_base: hop 2: reader ``i`` sets byte ``64 + flag_base + i``.
        owner_pid, owner_files: hop 2: the owner and its ``(fd, inode)`` per file;
            readers open ``/proc/<owner_pid>/fd/<fd>`` (0, (): by name).
        readers: hop 2: readers this broadcast has flags for (0: hop 1, unchecked).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    split: tuple[int, ...] = ()
    flag_base: int = 0
    owner_pid: int = 0
    owner_files: tuple[tuple[int, int], ...] = ()
    readers: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype, "handle")

    @property
    def nbytes(self) -> int:
        """Size of the tensor data in bytes (the segment is 4096 bytes larger)."""
        return math.prod(self.shape) * self.torch_dtype.itemsize

    @property
    def unnamed_data(self) -> bool:
        """File 0 is the header alone and the data a file with no name (``split == (0,)``:
        a memfd, ``ext/held``): opened by descriptor only, read-only, maybe longer."""
        return self.split[:1] == (0,)

    def parts(self) -> list[tuple[str, int, int]]:
        """``(file name, first data byte, data bytes)`` for each file of the segment."""
        bounds = [0, *self.split, self.nbytes]
        return [(part_name(self.name, i), bounds[i], bounds[i + 1] - bounds[i])
                for i in range(len(bounds) - 1)]

    def renamed(self, name: str) -> SharedTensorHandle:
        """The same tensor under another segment name."""
        return dataclasses.replace(self, name=name)

    def to_meta(self) -> dict[str, Any]:
        """Plain-dict form for msgpack metadata (hop 1: name, dtype, shape, split)."""
        meta = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.split:
            meta["split"] = list(self.split)
        return meta

    @classmethod
    def from_meta(cls, meta: Any) -> SharedTensorHandle:
        """Inverse of :meth:`to_meta`. Raises ``ShmEmbedsError`` (only) on malformed
        input (types, negative sizes, not our name, a bad split)."""
        try:
            name, dtype, shape = meta["name"], meta["dtype"], meta["shape"]
            split = meta.get("split", ())
            if not (isinstance(name, str) and isinstance(dtype, str)
                    and all(isinstance(x, (list, tuple)) for x in (shape, split))):
                raise TypeError("field types")
            ints = [int(x) for x in (*shape, *split)
                    if isinstance(x, int) and not isinstance(x, bool)]
            if len(ints) != len(shape) + len(split) or min(ints, default=0) < 0:
                raise ValueError("not non-negative integers")
            handle = cls(name, dtype, tuple(shape), tuple(split))
            nbytes = handle.nbytes
        except (KeyError, TypeError, ValueError, AttributeError, ShmEmbedsError) as e:
            raise ShmEmbedsError(f"malformed shm-embeds handle {reprlib.repr(meta)}") from e
        parsed = SegmentName.parse(handle.name)
        if parsed is None or parsed.part != 0:
            raise ShmEmbedsError(f"not a shm-embeds segment name: {reprlib.repr(handle.name)}")
        split = handle.split
        bounds = [0, *split, nbytes]
        if len(split) >= MAX_WRITERS or any(
            b % PAGE_BYTES or b <= a for a, b in zip(bounds, bounds[1:-1])
        ) or (split and split[-1] >= nbytes):
            raise ShmEmbedsError(f"malformed shm-embeds handle split {reprlib.repr(split)}")
        return handle


@dataclasses.dataclass(frozen=True)
class EmbedsPlaceholder:
    """What a hop-2 reader that never reads a ``prompt_embeds`` tensor gets instead of a
    handle; it builds a :func:`placeholder_tensor` of ``dtype`` (a name) and ``shape``."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype, "placeholder")


@dataclasses.dataclass(frozen=True)
class StepEmbeds(EmbedsPlaceholder):
    """A tensor a remote first-stage reader receives inside the step from ``ext/nodes``
    (a later stage's placeholder); without that extension the step fails on every rank."""


@dataclasses.dataclass(frozen=True)
class InlineEmbeds:
    """A tensor sent by value (hop 2) to readers on other nodes when one is on the first
    stage; the wrapper makes every rank join the agreement."""

    tensor: torch.Tensor


def placeholder_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A ``shape``/``dtype`` tensor of one element (zero strides): NaN, or 0 for integers."""
    fill = float("nan") if (dtype.is_floating_point or dtype.is_complex) else 0
    return torch.full((), fill, dtype=dtype).expand(tuple(shape))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def split_for(nbytes: int, writers: int) -> tuple[int, ...]:
    """Page-aligned data offsets at which to stripe ``nbytes`` over ``writers`` files."""
    k = min(writers, nbytes // PART_MIN_BYTES)
    if k <= 1:
        return ()
    step = nbytes // k // PAGE_BYTES * PAGE_BYTES
    return tuple(step * i for i in range(1, k))
