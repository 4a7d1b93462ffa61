# SPDX-License-Identifier: Apache-2.0
"""A base64 ``torch.save`` payload decoded straight into a segment, when it is plain.

Where vLLM's loader (``vllm/renderers/embed_utils.py`` ``safe_load_prompt_embeds``,
0.32/0.33) decodes and copies the payload twice before hop 1 copies it again,
:func:`direct_decode` decodes only the payload's head and tail first, decides with
:func:`plain_tensor_layout` whether it is exactly one plain tensor vLLM's loader
would take as it is, and if so decodes the tensor's base64 4 MiB at a time straight
into a segment, hashing each chunk for the prefix cache meanwhile. Anything else
returns None and vLLM's loader decides, so the outcome is always stock's.

``ctx`` below is the served model (``http.common.ServerContext``).

Knows torch's file format and segments; nothing of HTTP.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import struct
import sys
import zipfile
from typing import Any

import pybase64
import torch

from vllm._shm_embeds import extensions
from vllm._shm_embeds.config import min_bytes
from vllm._shm_embeds.counters import count, count_reason
from vllm._shm_embeds.ext.json.events import JsonEvent
from vllm._shm_embeds.ext.json import pickle_scan

digests = extensions.require("digests", "digests")

HEAD_CHARS = 64 << 10  # base64 chars decoded first: the zip records before the data
TAIL_CHARS = 128 << 10  # and last: the records after it, the central directory
DECODE_CHUNK_BYTES = 4 << 20  # decoded bytes per step straight into the segment
MAX_DIRECTORY_BYTES = 16 << 10  # torch.save: 7 records, ~700 bytes with a short archive name
MAX_RECORD_BYTES = 4 << 10  # records other than the tensor's (data.pkl: ~160 bytes)


class _NotHeld(Exception):
    """A read of the payload outside the decoded head and tail."""


class _Outline(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only the head and the tail are held.

    It is the decoded ``torch.save`` zip as far as its metadata goes: reading
    the bytes in between (the tensor data) raises :class:`_NotHeld`, so a
    payload whose metadata lies elsewhere cannot be read from it.
    """

    def __init__(self, size: int, head: bytes, tail_start: int, tail: bytes) -> None:
        super().__init__()
        self.size, self.head, self.tail_start, self.tail = size, head, tail_start, tail
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b) -> int:
        start, end = self.pos, min(self.size, self.pos + len(b))
        if end <= start:
            return 0
        if end <= len(self.head):
            data = self.head[start:end]
        elif start >= self.tail_start:
            data = self.tail[start - self.tail_start:end - self.tail_start]
        else:
            raise _NotHeld
        b[:len(data)] = data
        self.pos = end
        return len(data)


def _b64(piece: memoryview) -> bytes:
    """Strict base64 decode, as vLLM's loader does it (``pybase64``, ``validate=True``)."""
    return pybase64.b64decode(piece, validate=True)


@dataclasses.dataclass(frozen=True)
class _Reference:
    """What this torch's ``torch.save`` writes for a plain tensor of one dtype."""

    records: frozenset[str]  # record names, without the archive's folder
    flags: frozenset[int]  # zip general purpose flags of its records
    storage: str  # the storage class the pickle names, e.g. "FloatStorage"


@functools.lru_cache(maxsize=8)
def _reference(dtype: torch.dtype) -> _Reference | None:
    """Learned from ``torch.save`` itself (of a 2 x 3 zero tensor), so the
    template follows the installed torch; None when its pickle is not the
    one :mod:`pickle_scan` reads (no direct decode for ``dtype`` then)."""
    buf = io.BytesIO()
    torch.save(torch.zeros(2, 3, dtype=dtype), buf)
    zf = zipfile.ZipFile(buf)
    infos = zf.infolist()
    prefix = infos[0].filename.split("/", 1)[0] + "/"
    storage = pickle_scan.storage_name(dtype)
    if storage is None:
        return None
    return _Reference(frozenset(i.filename[len(prefix):] for i in infos),
                      frozenset(i.flag_bits for i in infos), storage)


# Zip records (APPNOTE 4.3): miniz (torch's zip reader) and Python's zipfile
# look for the central directory in different ways when these disagree.
_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory
_ZIP64_LOCATOR = struct.Struct("<IIQI")  # zip64 end of central directory locator
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory (no extra)
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header


def _plain_record(outline: _Outline, ref: _Reference) -> tuple[str, int, int, bytes] | None:
    """``(record name, data offset, size, the pickle)``: ``data/0`` and
    ``data.pkl`` as Python's ``zipfile`` reads them, when the zip is laid out
    as ``torch.save`` lays it out, else None.

    Checked so that torch's reader (miniz) and Python's ``zipfile`` cannot see
    different archives: one end record at the very end, no comment; the
    zip64 end record (``torch.save`` writes one) right before its locator,
    saying what the end record says; the central directory right before
    those; only the record names torch.save writes, none twice even ignoring
    case (miniz looks names up that way), none a directory; every record
    stored, with torch.save's flags; the data record's local header as miniz
    checks it before extracting; the central directory at most
    ``MAX_DIRECTORY_BYTES``, every record but the tensor's at most
    ``MAX_RECORD_BYTES`` (so no reader allocates more for the metadata).
    Raises whatever the readers raise.
    """
    size = outline.size
    end = size - _EOCD.size  # where the end record starts
    if end < _ZIP64_END.size + _ZIP64_LOCATOR.size:
        return None
    outline.seek(end)
    sig, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, comment = _EOCD.unpack(
        outline.read(_EOCD.size))
    if sig != 0x06054B50 or disk or cd_disk or n_disk != n_total or comment:
        return None
    outline.seek(end - _ZIP64_LOCATOR.size)
    lsig, z_disk, z_offset, disks = _ZIP64_LOCATOR.unpack(outline.read(_ZIP64_LOCATOR.size))
    if lsig == 0x07064B50:  # torch.save writes zip64 records: they must say the same
        end = z_offset
        outline.seek(z_offset)
        (zsig, zlen, _, _, zdisk, zcd_disk, zn_disk, zn_total, zcd_size,
         zcd_offset) = _ZIP64_END.unpack(outline.read(_ZIP64_END.size))
        if (z_disk or disks != 1 or z_offset != size - _EOCD.size - _ZIP64_LOCATOR.size
                - _ZIP64_END.size or zsig != 0x06064B50 or zlen != _ZIP64_END.size - 12
                or zdisk or zcd_disk or zn_disk != zn_total or zn_total != n_total
                or zcd_size != cd_size or zcd_offset != cd_offset):
            return None
    if (cd_offset + cd_size != end or n_total > len(ref.records)
            or cd_size > MAX_DIRECTORY_BYTES):
        return None  # more records than torch.save writes: no reader sizes buffers by it
    outline.seek(0)
    zf = zipfile.ZipFile(outline)
    infos = zf.infolist()
    prefix = infos[0].filename.split("/", 1)[0] + "/" if infos else ""
    names = [i.filename for i in infos]
    if (len(infos) != n_total or len({n.lower() for n in names}) != len(names)
            or any(not n.startswith(prefix) or n[len(prefix):] not in ref.records
                   or n.endswith("/") for n in names)
            or any(i.compress_type != zipfile.ZIP_STORED or i.flag_bits not in ref.flags
                   or i.external_attr & 0x10 or i.file_size != i.compress_size
                   or (i.file_size > MAX_RECORD_BYTES and not n.endswith("/data/0"))
                   for i, n in zip(infos, names))):
        return None
    name = prefix + "data/0"
    if name not in names:
        return None
    info = zf.getinfo(name)
    outline.seek(info.header_offset)
    (lsig, _, _, method, _, _, _, _, _, nlen, xlen) = _LOCAL.unpack(outline.read(_LOCAL.size))
    if lsig != 0x04034B50 or method != 0 or outline.read(nlen) != name.encode():
        return None
    if prefix + "data.pkl" not in names:
        return None
    pkl = zf.read(prefix + "data.pkl")
    return "data/0", info.header_offset + _LOCAL.size + nlen + xlen, info.file_size, pkl


def plain_tensor_layout(ctx: Any, outline: _Outline
                         ) -> tuple[torch.dtype, int, int, int] | None:
    """``(dtype, rows, hidden, data_offset)`` when the zip in ``outline`` is one
    plain tensor that vLLM's loader would take as it is, else None
    (:func:`layout_or_reason` says why)."""
    out = layout_or_reason(ctx, outline)
    return None if isinstance(out, str) else out


def layout_or_reason(ctx: Any, outline: _Outline
                     ) -> tuple[torch.dtype, int, int, int] | str:
    """``(dtype, rows, hidden, data_offset)`` when the zip in ``outline`` is one
    plain tensor that vLLM's loader would take as it is, else why not.

    "As it is": the archive is laid out as ``torch.save`` lays it out
    (:func:`_plain_record`; torch's own reader must agree on the record's
    offset and size, and on the pickle); the pickle is byte for byte what
    ``torch.save`` writes for one tensor (:func:`pickle_scan.scan`: nothing
    is unpickled, exactly one persistent load, no memo but the template's)
    asking for ``_rebuild_tensor_v2(storage, 0, size, contiguous stride,
    False, OrderedDict())`` over one storage of the model's dtype, on
    "cpu", of exactly the tensor's elements, stored in ``data/0`` as
    exactly its bytes; the size is ``(rows, hidden)`` or ``(1, rows,
    hidden)`` (vLLM squeezes it) with ``rows >= 1`` and the model's
    ``hidden_size``; this host's byte order; and ``torch.load`` to the meta
    device reads the rest without an error and builds that very tensor
    (shape, dtype, stride, storage offset, storage size). Anything else
    (casts, views, sparse, odd zips, odd pickles) is for vLLM's own loader,
    which answers it as stock does. Reasons: ``disabled``, ``zip``,
    ``pickle``, ``dtype`` (torch.save's pickle of another float dtype),
    ``tensor`` (another shape, a view), ``meta``. Never raises.
    """
    if not ctx.enable_prompt_embeds:
        return "disabled"
    dtype, hidden = ctx.dtype, ctx.hidden_size
    try:
        ref = _reference(dtype)
        record = _plain_record(outline, ref) if ref is not None else None
        if record is None:
            return "zip"
        name, offset, nbytes, pkl = record
        outline.seek(0)
        reader = torch._C.PyTorchFileReader(outline)
        if (reader.get_record_offset(name) != offset or reader.get_record_size(name) != nbytes
                or reader.get_record("byteorder") != sys.byteorder.encode()
                or reader.get_record("data.pkl") != pkl):
            return "zip"
    except Exception:  # torch's reader and zipfile raise many kinds here
        return "zip"
    call = pickle_scan.scan(pkl, dtype)
    if call is None:
        other = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        return ("dtype" if any(pickle_scan.scan(pkl, d) for d in other if d != dtype)
                else "pickle")  # a cast (vLLM's loader does it), or not torch.save's
    shape, numel = call.shape, call.numel
    rows = shape[-2] if len(shape) == 2 or shape[0] == 1 else 0
    if (rows < 1 or shape[-1] != hidden or call.storage_offset != 0
            or call.stride != tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            or numel != rows * hidden or nbytes != numel * dtype.itemsize
            or offset + nbytes > outline.size):
        return "tensor"
    # Last, torch.load itself on a meta device: it reads every other record
    # as vLLM's loader will (its checks, its errors), but not the tensor bytes.
    # Safe here: the pickle is torch.save's own (bounded), in this host's
    # byte order (torch 2.13 crashes on a meta load that has to byteswap).
    try:
        outline.seek(0)
        meta = torch.load(outline, weights_only=True, map_location="meta")
        same = (type(meta) is torch.Tensor and meta.layout == torch.strided
                and meta.dtype == dtype and tuple(meta.shape) == shape
                and meta.stride() == call.stride and meta.storage_offset() == 0
                and meta.untyped_storage().nbytes() == nbytes
                and not meta.requires_grad and not meta.is_neg() and not meta.is_conj())
    except Exception:
        return "meta"
    return (dtype, rows, hidden, offset) if same else "meta"


def _declined(reason: str) -> None:
    """Count why a payload is left to vLLM's loader; None."""
    count_reason(JsonEvent.JSON_DIRECT_DECLINED, reason)
    return None


@dataclasses.dataclass(frozen=True)
class DirectPlan:
    """Where a plain payload's tensor lies in its base64 (:func:`direct_plan`).

    Attributes:
        dtype, rows, hidden: the tensor (``(rows, hidden)``, the model's dtype).
        offset: byte offset of its data in the decoded zip.
    """

    dtype: torch.dtype
    rows: int
    hidden: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.hidden * self.dtype.itemsize


def direct_plan(ctx: Any, piece: memoryview) -> DirectPlan | None:
    """Whether one base64 ``torch.save`` payload is the plain case, from its
    head and tail alone (``HEAD_CHARS``, ``TAIL_CHARS``: the zip's metadata;
    no tensor byte is decoded).

    Returns:
        the plan, or None when the payload is not that plain case: vLLM's
        loader then decides (its answer is stock's); counted as
        ``json_direct_declined.<reason>`` (:func:`layout_or_reason`, and
        ``base64``, ``small``, ``zip``).
    """
    n = len(piece)
    if n % 4:
        return _declined("base64")  # not base64 (vLLM's loader says so)
    # Characters [0, head_chars) and [tail_chars, n) are decoded first; a
    # short payload is all head.
    head_chars = n if n <= HEAD_CHARS + TAIL_CHARS else HEAD_CHARS
    tail_chars = max(head_chars, n - TAIL_CHARS)
    try:
        if head_chars < n and piece[head_chars - 1] == 0x3D:
            return _declined("base64")  # "=" before the end: not one base64 string
        head, tail = _b64(piece[:head_chars]), _b64(piece[tail_chars:])
    except ValueError:
        return _declined("base64")
    tail_start = tail_chars // 4 * 3
    outline = _Outline(tail_start + len(tail) if tail else len(head), head, tail_start, tail)
    layout = layout_or_reason(ctx, outline)
    if isinstance(layout, str):
        return _declined(layout)
    plan = DirectPlan(*layout)
    first, last = plan.offset // 3 * 4, min(n, -(-(plan.offset + plan.nbytes) // 3) * 4)
    if plan.nbytes < min_bytes():
        return _declined("small")  # too small to matter
    if head_chars < tail_chars and (first > head_chars or last < tail_chars):
        return _declined("zip")  # characters between would go unchecked
    return plan


def direct_decode(ctx: Any, piece: memoryview,
                  plan: DirectPlan | None = None) -> torch.Tensor | None:
    """Decode one base64 ``torch.save`` payload straight into a new segment.

    vLLM's loader decodes the whole payload into fresh memory, ``torch.load``
    copies the tensor out of it into more fresh memory, and then it is copied
    into the segment: three passes over new pages. Here, once
    :func:`direct_plan` found one plain tensor (``plan``; computed here if
    not given), the base64 characters that hold its bytes are decoded 4 MiB
    at a time and written into the segment, each chunk hashed for the prefix
    cache while the next one is decoded. Every character of the payload is
    decoded and validated once, as vLLM does.

    Returns:
        the segment-backed tensor ``(rows, hidden)`` (read-only, digests
        attached), or None when the payload is not that plain case or fails
        to decode (counted ``json_direct_declined.<reason>``).
    Raises:
        OSError: the segment could not be made or written (e.g. ENOSPC);
            nothing is left in shared memory.
    """
    plan = plan if plan is not None else direct_plan(ctx, piece)
    if plan is None:
        return None
    n = len(piece)
    dtype, rows, hidden, offset, nbytes = (plan.dtype, plan.rows, plan.hidden, plan.offset,
                                           plan.nbytes)
    row_bytes = hidden * dtype.itemsize

    def chunks():
        step = digests.chunk_bytes(row_bytes, ctx.hash_block_tokens, DECODE_CHUNK_BYTES)
        for a in range(offset, offset + nbytes, step):
            b = min(a + step, offset + nbytes)
            start, end = a // 3 * 4, min(n, -(-b // 3) * 4)
            if end < n and piece[end - 1] == 0x3D:
                raise ValueError("padding inside the payload")
            skip = a - start // 4 * 3
            chunk = memoryview(_b64(piece[start:end]))[skip:skip + b - a]
            if len(chunk) != b - a:
                raise ValueError("payload shorter than its tensor")
            yield chunk

    def write(segment: Any) -> digests.BlockDigests | None:
        return digests.write_chunks_and_digest(chunks(), segment, rows, row_bytes,
                                               ctx.hash_block_tokens)

    try:
        out = digests.fill_segment(dtype, (rows, hidden), write)
    except ValueError:
        return _declined("base64")  # not valid base64 after all: vLLM's loader says so
    count(JsonEvent.JSON_DIRECT_TENSORS)
    return out



VALIDATE_CHARS = 4 << 20  # base64 characters checked per step by :func:`valid_base64`


def valid_base64(piece: memoryview) -> bool:
    """Whether vLLM's loader's ``pybase64.b64decode(piece, validate=True)``
    (``vllm/renderers/embed_utils.py``, 0.32/0.33) would accept ``piece``,
    checked :data:`VALIDATE_CHARS` characters at a time; nothing decoded is
    kept (a few milliseconds per 100 MB). Judges a payload before any work
    on it: one that fails is refused by vLLM whatever else the body holds."""
    n = len(piece)
    if n % 4:
        return False
    try:
        for a in range(0, n, VALIDATE_CHARS):
            b = min(n, a + VALIDATE_CHARS)
            if b < n and piece[b - 1] == 0x3D:
                return False  # padding before the end
            _b64(piece[a:b])
    except ValueError:
        return False
    return True
