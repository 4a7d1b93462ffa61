# SPDX-License-Identifier: Apache-2.0
"""Reads the ``data.pkl`` of a ``torch.save`` payload without unpickling it.

The direct decode (``ext/json/torch_save.py``) must know what tensor a client's
pickle asks torch to build, and running the pickle, even with stand-ins, hands
attacker-chosen opcodes to an unpickler. So nothing is run: :func:`scan` accepts a
pickle only when it is, byte for byte, what this torch's ``torch.save`` writes for
one dense contiguous tensor of one dtype with 2 or 3 dimensions (the template is
learned from ``torch.save`` itself, :func:`template`), its integers aside. At most
:data:`MAX_PICKLE_BYTES` are read. Anything else returns None (vLLM's loader
decides).

Knows torch's pickle; nothing of zips, HTTP or segments.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle
import pickletools
import zipfile

import torch

MAX_PICKLE_BYTES = 1024  # torch.save writes ~160 bytes for one 3-d tensor
_INT_OPS = frozenset({"BININT", "BININT1", "BININT2", "LONG1"})  # protocol 2 ints


@dataclasses.dataclass(frozen=True)
class Rebuild:
    """The one ``_rebuild_tensor_v2`` call a plain ``torch.save`` pickle makes.

    Attributes:
        numel: elements of the storage (persistent load ``"0"``, on ``"cpu"``).
        storage_offset: in elements.
        shape: sizes, 2 or 3 of them.
        stride: in elements.
    """

    numel: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Template:
    """``torch.save``'s pickle for one dtype and rank, split at its integers."""

    ops: tuple[tuple[str, object], ...]  # (opcode name, argument); ints as ("int", None)
    pieces: tuple[bytes, ...]  # the bytes between the integers (len(ints) + 1 of them)
    storage: str  # the storage class it names, e.g. "FloatStorage"


def _tokens(data: bytes) -> list[tuple[str, object, int]] | None:
    """``(opcode name, argument, position)`` of each opcode of ``data``, or None.

    None when ``data`` is longer than :data:`MAX_PICKLE_BYTES`, is not a
    pickle ``genops`` reads, or has bytes after its ``STOP``.
    """
    if len(data) > MAX_PICKLE_BYTES:
        return None
    f = io.BytesIO(data)
    try:
        out = [(op.name, arg, pos) for op, arg, pos in pickletools.genops(f)]
    except Exception:  # genops raises ValueError, and others on odd arguments
        return None
    if not out or out[-1][0] != "STOP" or f.tell() != len(data):
        return None
    return out


def _int_bytes(value: int) -> bytes:
    """``value`` as the protocol-2 pickler writes it (one opcode, its argument)."""
    return pickle.dumps(value, protocol=2)[2:-1]  # without PROTO 2 and STOP


@functools.lru_cache(maxsize=16)
def template(dtype: torch.dtype, ndim: int) -> _Template | None:
    """What this torch's ``torch.save`` writes as ``data.pkl`` for a
    contiguous ``dtype`` tensor of ``ndim`` dimensions (learned by saving a
    small one), or None when it is not the expected one-call shape (the
    direct decode is then off for that dtype: everything goes to vLLM's
    loader)."""
    shape = (2, 3) if ndim == 2 else (1, 2, 3)
    buf = io.BytesIO()
    torch.save(torch.zeros(shape, dtype=dtype), buf)
    zf = zipfile.ZipFile(buf)
    [pkl] = [n for n in zf.namelist() if n.endswith("/data.pkl")]
    data = zf.read(pkl)
    tokens = _tokens(data)
    if tokens is None:
        return None
    stride = torch.zeros(shape).stride()
    ints = [arg for name, arg, _ in tokens if name in _INT_OPS]
    if ints != [6, 0, *shape, *stride]:
        return None
    globals_ = [arg for name, arg, _ in tokens if name == "GLOBAL"]
    if (len(globals_) != 3 or globals_[0] != "torch._utils _rebuild_tensor_v2"
            or globals_[2] != "collections OrderedDict"
            or not globals_[1].startswith("torch ")):
        return None
    pieces, ops, last = [], [], 0
    ends = [pos for _, _, pos in tokens[1:]] + [len(data)]
    for (name, arg, pos), end in zip(tokens, ends):
        if name in _INT_OPS:
            pieces.append(data[last:pos])
            last = end
            ops.append(("int", None))
        else:
            ops.append((name, arg))
    pieces.append(data[last:])
    return _Template(tuple(ops), tuple(pieces), globals_[1].split(" ", 1)[1])


def scan(data: bytes, dtype: torch.dtype) -> Rebuild | None:
    """The tensor that the ``torch.save`` pickle ``data`` asks for, when it is
    exactly what ``torch.save`` writes for one contiguous-layout ``dtype``
    tensor of 2 or 3 dimensions (see the module doc), else None.

    Only the layout is read here; whether the integers describe a plain
    tensor (offset 0, contiguous strides, storage of exactly its elements)
    is the caller's check. Bounded: reads at most :data:`MAX_PICKLE_BYTES`,
    allocates no more than that. Never raises.
    """
    tokens = _tokens(data)
    if tokens is None:
        return None
    ops = tuple(("int", None) if name in _INT_OPS else (name, arg)
                for name, arg, _ in tokens)
    ints = [arg for name, arg, _ in tokens if name in _INT_OPS]
    for ndim in (2, 3):
        try:
            ref = template(dtype, ndim)
        except Exception:  # torch.save of a small tensor failed: no direct decode
            return None
        if ref is None or ref.ops != ops:
            continue
        # Byte for byte what the pickler writes for these integers (one
        # encoding per value: BININT1 / BININT2 / BININT / LONG1).
        expected = ref.pieces[0] + b"".join(
            _int_bytes(v) + piece for v, piece in zip(ints, ref.pieces[1:]))
        if expected != data:
            return None
        return Rebuild(ints[0], ints[1], tuple(ints[2:2 + ndim]), tuple(ints[2 + ndim:]))
    return None


def storage_name(dtype: torch.dtype) -> str | None:
    """The storage class ``torch.save`` names for ``dtype`` (e.g. ``FloatStorage``)."""
    ref = template(dtype, 2)
    return ref.storage if ref is not None else None
