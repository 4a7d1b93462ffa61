# SPDX-License-Identifier: Apache-2.0
"""The framing of a binary ``prompt_embeds`` body: its headers and JSON header,
parsed and validated against the served model before anything is allocated.

Wire format: ``ext/binary/binary.py``'s docstring and docs/binary-protocol.md. Knows
nothing of segments: the middleware (``ext/binary/binary.py``) decides where the
bytes go.

Bounds on the JSON header, all checked before ``json.loads`` builds anything
(:func:`check_json_bounds`, a pre-scan in C): at most :data:`MAX_JSON_BYTES`
bytes, :func:`max_json_values` values and keys (grows with
``settings.BINARY_MAX_TENSORS``), :data:`MAX_JSON_DEPTH` containers
open at once. Every descriptor field is type-checked before it is used
(:func:`parse_spec`): any malformed header is a :class:`BinaryBodyError`,
never another exception.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from shm_embeds_client import wire
from starlette.datastructures import Headers

from vllm._shm_embeds.ext.binary.body_limits import byte_count
from vllm._shm_embeds.ext.binary.common import CHAT, ServerContext, content_type, embeds_slots
from vllm._shm_embeds.ext.binary.gate import Refused
from vllm._shm_embeds.ext.binary.placeholders import new_token, placeholder
from vllm._shm_embeds.ext.binary.settings import binary_max_tensors

# The client's spellings (shm_embeds_client.wire), as the server compares them.
HEADER_NAME = wire.HEADER_LENGTH.lower()
CONTENT_TYPE = wire.CONTENT_TYPE.encode()
DATATYPES: dict[str, torch.dtype] = {
    name: getattr(torch, dt.torch) for name, dt in wire.DATATYPES.items()}
MAX_JSON_BYTES = 16 << 20  # the JSON header is read into memory; bounded
MAX_JSON_DEPTH = 128  # containers (objects, arrays) open at once in the JSON header
MAX_JSON_BASE_VALUES = 1 << 16  # values and keys of a JSON header besides its descriptors
MAX_JSON_VALUES_PER_TENSOR = 32  # ... and per tensor (a chat part and its descriptor: ~20)

# One JSON string (escapes included), or an unterminated one to the end (a match
# never fails); possessive: linear time, no backtracking (as ``json_strings._STRING``).
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b"{}[],:")))
_NESTING = bytes.maketrans(b"{[]}", b"\x01\x01\xff\xff")  # +1 / -1 as int8


class BinaryBodyError(Refused):
    """A binary body the server refuses (``gate.Refused``): a 4xx or 503 in
    vLLM's error shape, counted ``binary_rejected.<reason>``; its message
    never names a segment or a path."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One validated descriptor: ``dtype`` and ``shape`` ``(T, H)``; ``nbytes``, its bytes in
    the body (T*H*itemsize; with ``extra``, the parameters an extension's hook reads,
    only the last ``nbytes`` of them: a continuation)."""

    dtype: torch.dtype
    shape: tuple[int, int]
    nbytes: int
    extra: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass
class ParsedHeader:
    """The JSON header with descriptors replaced by placeholders, and the tensors to read.

    Attributes:
        body: the request dict to hand to vLLM (placeholders in place).
        specs: tensors in body order.
        token: this request's random placeholder token (hex str).
    """

    body: dict
    specs: list[TensorSpec]
    token: str


def _bad(reason: str, message: str, status: int = 400) -> BinaryBodyError:
    return BinaryBodyError(status, reason, message)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _shown(x: Any) -> str:
    """A JSON value for an error message: at most 32 characters of a scalar's
    repr, a container only by its kind (never rendered: it may be large)."""
    if isinstance(x, dict):
        return "an object"
    if isinstance(x, list):
        return "an array"
    return repr(x[:32] if isinstance(x, str) else x)[:32]


def max_json_values() -> int:
    """Values and keys a binary body's JSON header may hold (count):
    :data:`MAX_JSON_BASE_VALUES` plus :data:`MAX_JSON_VALUES_PER_TENSOR` per
    tensor ``settings.BINARY_MAX_TENSORS`` allows."""
    return MAX_JSON_BASE_VALUES + MAX_JSON_VALUES_PER_TENSOR * binary_max_tensors()


STRUCTURE_PIECE = 1 << 20  # bytes outside strings judged per step (memory: a few times this)


def _outside_strings(json_bytes: bytes | bytearray) -> Iterator[memoryview]:
    """The bytes of ``json_bytes`` outside its strings (quotes excluded), in
    order, in views of at most :data:`STRUCTURE_PIECE` bytes (no copy of the
    whole); read from the start (outside strings a ``"`` always opens one in
    valid JSON); an unterminated string runs to the end. One Python step per
    string: ``find`` (``memchr``) past a string without escapes,
    :data:`_STRING` (C) over one with them."""
    view, find, pos, n = memoryview(json_bytes), json_bytes.find, 0, len(json_bytes)
    while pos < n:
        start = find(b'"', pos)
        stop = n if start < 0 else start
        for a in range(pos, stop, STRUCTURE_PIECE):
            yield view[a:min(stop, a + STRUCTURE_PIECE)]
        if start < 0:
            return
        end = find(b'"', start + 1)
        if end < 0:
            return
        if find(b"\\", start + 1, end) >= 0:  # an escape: maybe of this very quote
            pos = _STRING.match(json_bytes, start).end()  # never fails (to the end)
        else:
            pos = end + 1


def check_json_bounds(json_bytes: bytes | bytearray) -> None:
    """Bound what ``json.loads(json_bytes)`` can build, before it runs.

    Outside strings, every value but the first follows a ``,``, a ``:`` or an
    opening bracket, and every key precedes a ``:``: their count bounds the
    values and keys ``json.loads`` makes (each object it builds then takes
    some 100 bytes at most, a string besides its characters), and the
    opening brackets bound the nesting. Also on input that is not JSON: the
    count bounds what ``json.loads`` builds before it fails.

    ``bytes.count`` over all the bytes first (C, no memory); if the bounds
    hold with the text of strings counted too, that is all. Else (many
    containers, or commas in a long prompt) the structure outside strings is
    judged piece by piece (:func:`_outside_strings`, only with at most twice
    :func:`max_json_values` ``"``), its nesting by a ``numpy`` cumulative
    sum per piece, and it stops at the first bound passed: extra memory a
    few times :data:`STRUCTURE_PIECE`, whatever the header's size.

    Raises:
        BinaryBodyError: 400 (``json``) with more than :func:`max_json_values`
            values and keys (or, when they must be told apart from text,
            more than twice as many ``"``), a closing bracket with none open,
            or more than :data:`MAX_JSON_DEPTH` containers open at once.
    """
    limit = max_json_values()
    opens = json_bytes.count(b"{") + json_bytes.count(b"[")
    if opens <= MAX_JSON_DEPTH and (len(json_bytes) <= limit or  # a value takes a byte
                                    1 + opens + json_bytes.count(b",")
                                    + json_bytes.count(b":") <= limit):
        return  # the bounds hold with the text of strings counted too
    too_many = _bad("json", f"the JSON header holds more than the server's limit of "
                    f"{limit} values (send fewer values, or a JSON request body)")
    if json_bytes.count(b'"') > 2 * limit:
        raise too_many
    values, depth = 1, 0
    for piece in _outside_strings(json_bytes):
        structure = bytes(piece).translate(None, _NOT_STRUCTURE)
        values += (structure.count(b"{") + structure.count(b"[") + structure.count(b",")
                   + structure.count(b":"))
        if values > limit:
            raise too_many
        nesting = np.frombuffer(structure.translate(_NESTING, b",:"), dtype=np.int8)
        if not nesting.size:
            continue
        levels = np.cumsum(nesting, dtype=np.int32) + depth
        if int(levels.min()) < 0:
            raise _bad("json", "the JSON header is not valid JSON: unbalanced brackets")
        if int(levels.max()) > MAX_JSON_DEPTH:
            raise _bad("json", f"the JSON header is nested too deep (more than "
                       f"{MAX_JSON_DEPTH} levels)")
        depth = int(levels[-1])


def parse_spec(desc: Any, limits: ServerContext, where: str,
               accepted: frozenset[str] = frozenset()) -> TensorSpec:
    """Validate one descriptor (see the module docstring) against ``limits``.

    ``desc`` is any JSON value: every field's type is checked before it is
    used (``datatype`` a str, ``shape`` a list of two ints, ``parameters`` an
    object whose ``binary_data_size`` is an int; booleans are not ints). A
    parameter besides ``binary_data_size`` and those in ``accepted`` (the loaded
    extensions' hooks read them) is refused: never served as if it were absent.

    Raises:
        BinaryBodyError: 400 naming what is wrong (``where`` says which value);
            never another exception, whatever the value.
    """
    if not isinstance(desc, dict):
        raise _bad("descriptor", f"{where} must be an object "
                   '{"datatype", "shape", "parameters": {"binary_data_size"}} '
                   "in a binary request body")
    datatype = desc.get("datatype")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise _bad("datatype", f"{where}: datatype {_shown(datatype)} is not one of "
                   f"{', '.join(DATATYPES)} (prompt_embeds must be floating point)")
    shape = desc.get("shape")
    if not isinstance(shape, list) or not all(_is_int(s) for s in shape):
        raise _bad("shape", f"{where}: shape must be a list of integers")
    if len(shape) != 2:
        raise _bad("not_2d", f"{where}: prompt_embeds must be a 2D tensor of shape "
                   f"(num_tokens, hidden_size); got {len(shape)} dimension(s)")
    tokens, hidden = shape
    if hidden != limits.hidden_size:
        raise _bad("hidden_size", f"{where}: prompt_embeds hidden_size {hidden} does not "
                   f"match the model's hidden_size {limits.hidden_size}")
    if tokens < 1:
        raise _bad("empty", f"{where}: prompt_embeds must have at least one token")
    if tokens > limits.max_model_len:
        raise _bad("too_long", f"{where}: {tokens} prompt_embeds tokens exceed the "
                   f"maximum context length of {limits.max_model_len} tokens")
    params = desc.get("parameters")
    size = params.get(wire.BINARY_DATA_SIZE) if isinstance(params, dict) else None
    dtype = DATATYPES[datatype]
    row = hidden * torch.empty((), dtype=dtype).element_size()
    want = tokens * row
    unknown = sorted(k for k in params if k != wire.BINARY_DATA_SIZE and k not in accepted) \
        if isinstance(params, dict) else []
    if unknown:
        raise _bad("parameter", f"{where}: parameter {_shown(unknown[0])} is not one this "
                   "server reads")
    extra = tuple((k, params[k]) for k in sorted(params) if k in accepted) \
        if isinstance(params, dict) else ()
    if extra:  # a continuation: the body holds only the last rows of ``shape``
        if not _is_int(size) or not 0 < size < want or size % row:
            raise _bad("size", f"{where}: a continuation's parameters.binary_data_size must "
                       f"be a whole number of rows ({row} bytes each) fewer than its shape's "
                       f"{tokens}; got {_shown(size)}")
        return TensorSpec(dtype, (tokens, hidden), size, extra)
    if not _is_int(size) or size != want:
        raise _bad("size", f"{where}: parameters.binary_data_size must be {want} "
                   f"({datatype} x {tokens} x {hidden}); got {_shown(size)}")
    return TensorSpec(dtype, (tokens, hidden), want)


def parse_header(
    json_bytes: bytes, route: str, limits: ServerContext, content_length: int | None,
    accepted: frozenset[str] = frozenset(),
) -> ParsedHeader:
    """Parse and validate the JSON header of a binary body; allocates nothing.

    Args:
        json_bytes: the first ``Inference-Header-Content-Length`` body bytes.
        route: ``/v1/completions`` or ``/v1/chat/completions``.
        limits: the served model's limits.
        content_length: the request's ``Content-Length`` (None if chunked).
        accepted: descriptor parameters the loaded extensions read (:func:`parse_spec`);
            with ``wire.PART`` in it, a chat part whose ``data`` is a string starting
            with it (a kept part, ``conversations/chat.py``) is left as it is.
    Returns:
        the body with placeholders, and the specs of the tensors that follow.
    Raises:
        BinaryBodyError: 400 (bad JSON, over the bounds of
            :func:`check_json_bounds`, bad descriptor, more than
            ``settings.BINARY_MAX_TENSORS`` tensors, sizes that do not
            add up to ``Content-Length``), 413 (over
            :attr:`ServerContext.max_body_bytes`); never another exception.
    """
    if not limits.enable_prompt_embeds:
        raise _bad("disabled", "You must set `--enable-prompt-embeds` to input "
                   "`prompt_embeds`.")
    check_json_bounds(json_bytes)
    try:
        body = json.loads(json_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad("json", f"the JSON header is not valid UTF-8 JSON: {str(e)[:120]}")
    except RecursionError:
        raise _bad("json", "the JSON header is nested too deep") from None
    if not isinstance(body, dict):
        raise _bad("json", "the JSON header must be an object")
    token = new_token()
    specs: list[TensorSpec] = []
    slots = list(embeds_slots(route, body))
    if len(slots) > binary_max_tensors():
        raise _bad("too_many", f"the body carries {len(slots)} prompt_embeds tensors, more "
                   f"than the server's limit of {binary_max_tensors()}")
    refs = 0
    for where, container, key in slots:
        value = container.get(key) if isinstance(container, dict) else container[key]
        if (route == CHAT and wire.PART in accepted and isinstance(value, str)
                and value.startswith(wire.PART)):
            refs += 1
            continue
        specs.append(parse_spec(value, limits, where, accepted))
        container[key] = placeholder(token, len(specs) - 1)
    if not specs and not refs:
        raise _bad("no_tensor", "a binary request body needs at least one "
                   "prompt_embeds descriptor in its JSON header")
    total = sum(s.nbytes for s in specs)
    if total > limits.max_body_bytes:
        raise _bad("too_large", f"the body's tensors hold {total} bytes, more than the "
                   f"server's limit of {limits.max_body_bytes} bytes", 413)
    if content_length is not None:
        expected = len(json_bytes) + total
        if content_length < expected:
            raise _bad("short", f"the body is cut short: Content-Length {content_length}"
                       f" but the header and tensors need {expected} bytes")
        if content_length > expected:
            raise _bad("extra", f"{content_length - expected} extra bytes after the "
                       "last tensor (Content-Length larger than header + tensors)")
    return ParsedHeader(body, specs, token)


def frame_header_length(headers: list[tuple[bytes, bytes]]) -> tuple[int, int | None] | None:
    """``(Inference-Header-Content-Length, Content-Length or None)`` of a binary body.

    Returns None when the request is not a binary body (content type not
    ``application/octet-stream`` or no ``Inference-Header-Content-Length``):
    it then goes to stock handling.
    Raises:
        BinaryBodyError: the header values are not byte counts (ASCII digits,
            ``body_limits.byte_count``), or the JSON header is longer than the body
            or than :data:`MAX_JSON_BYTES`.
    """
    h = Headers(raw=headers)
    ctype = content_type(h)
    hlen, clen = h.get(HEADER_NAME), h.get("content-length")
    if ctype != CONTENT_TYPE or hlen is None:
        return None
    n, length = byte_count(hlen), byte_count(clen)
    if n is None or (clen is not None and length is None):
        raise _bad("header", "Inference-Header-Content-Length and Content-Length must "
                   "be byte counts")
    if length is not None and n > length:
        raise _bad("header_too_long", f"Inference-Header-Content-Length {n} is larger "
                   f"than the body ({length} bytes)")
    if n > MAX_JSON_BYTES:
        raise _bad("header_too_long", f"Inference-Header-Content-Length {n} exceeds "
                   f"{MAX_JSON_BYTES} bytes", 413)
    return n, length
