# SPDX-License-Identifier: Apache-2.0
"""The OpenAI JSON body with ``prompt_embeds``, built with one write per byte.

For a client that must keep the OpenAI JSON wire format (any vLLM server,
with or without the plugin): ``prompt_embeds`` as base64 of
``torch.save(tensor)``, in a ``/v1/completions`` or ``/v1/chat/completions``
body. The stock way, ``base64.b64encode(buf.getvalue()).decode()`` put in a
dict and ``json.dumps``-ed, holds the tensor's bytes up to five times over (the
saved bytes, the base64 bytes, their ``str``, the JSON ``str``, its encoded
bytes) and passes over each of them. :func:`openai_json_body` writes each
byte of the body once, into one ``bytearray``:

* ``torch.save`` writes into a file object whose ``write`` base64-encodes what
  it is given straight into the body (``binascii.b2a_base64``, or
  ``pybase64.b64encode`` where that is installed, over slices of a multiple
  of 3 bytes, a carry of up to 2 bytes between writes, each slice's text put
  in place by slice assignment): the saved bytes are never held; the
  tensor's data is read from its own memory;
* only the small rest of the request goes through ``json.dumps``, with a
  random placeholder where each tensor goes; the body is that JSON split
  around the placeholders, the base64 between the pieces. Base64 text needs
  no JSON escape; every other field is escaped by ``json.dumps`` itself.

The server side needs nothing new: vLLM's own ``safe_load_prompt_embeds``
(``vllm/renderers/embed_utils.py``) decodes it as it decodes the stock body.
"""

from __future__ import annotations

import binascii
import json
import re
import secrets
from typing import Any

import torch

from shm_embeds_client._framing import Continuation, KeptPart, _map_embeds, _request
from shm_embeds_client.wire import JSON_CONTENT_TYPE, PREFIX, PREFIX_DATA, PREFIX_ROWS

__all__ = ["DTYPES", "openai_json_body", "openai_json_request"]

# The dtypes sent (as vLLM casts to the model's dtype, these three cover every
# model; convert others yourself, e.g. ``t.to(torch.float32)``).
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Input bytes per b2a_base64 call: a multiple of 3 (no padding inside the
# text), 48 KiB in, 64 KiB out (fastest of 12 KiB .. 3 MiB measured here).
_CHUNK = 3 << 14
# torch.save's bytes beyond the tensor's (zip records and the pickle; ~1.5 KiB
# for a 2-D tensor). Only sizes the first allocation: more still fits (the
# bytearray grows), the unused tail is cut off at the end.
_SLACK = 1 << 16


def _b2a(data: Any) -> bytes:
    return binascii.b2a_base64(data, newline=False)


try:  # the same text, SIMD-encoded, where pybase64 is installed (vLLM needs it)
    from pybase64 import b64encode as _encode
except ImportError:  # pragma: no cover - pybase64 is optional
    _encode = _b2a


def _checked(t: Any) -> torch.Tensor:
    """``t`` as it is saved: a plain 2-D CPU tensor owning exactly its bytes."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"prompt_embeds must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"prompt_embeds must be a CPU tensor, got one on {t.device} "
                         "(move it with .cpu() first)")
    if t.layout != torch.strided:
        raise ValueError(f"prompt_embeds must be a dense tensor, got layout {t.layout}")
    if t.dtype not in DTYPES:
        raise ValueError(f"prompt_embeds dtype must be float32, float16 or bfloat16, got "
                         f"{t.dtype} (convert it first, e.g. t.to(torch.float32))")
    if t.dim() != 2:
        raise ValueError("prompt_embeds must be 2-D (num_tokens, hidden_size), got shape "
                         f"{tuple(t.shape)}")
    t = t.detach()
    # torch.save writes a tensor's whole storage: a view (a slice of a bigger
    # tensor, a transpose) is compacted first, as the server gets its values only.
    if not (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.nbytes):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


class _Base64Into:
    """A write-only file for ``torch.save``: the base64 of what is written goes
    into ``out`` from ``pos`` on (slice assignment; past the end it appends)."""

    def __init__(self, out: bytearray, pos: int) -> None:
        self.out, self.pos, self.carry = out, pos, b""

    def _put(self, text: bytes) -> None:
        end = self.pos + len(text)
        self.out[self.pos:end] = text
        self.pos = end

    def write(self, data: Any) -> int:
        mv = memoryview(data)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        n = mv.nbytes
        if self.carry:
            need = 3 - len(self.carry)
            if n < need:
                self.carry += bytes(mv)
                return n
            self._put(_encode(self.carry + bytes(mv[:need])))
            self.carry, mv = b"", mv[need:]
        whole = len(mv) - len(mv) % 3
        for i in range(0, whole, _CHUNK):
            self._put(_encode(mv[i:min(i + _CHUNK, whole)]))
        if whole < len(mv):
            self.carry = bytes(mv[whole:])
        return n

    def flush(self) -> None:
        pass

    def finish(self) -> int:
        """Encode the carry (with its ``=`` padding); the position after the text."""
        if self.carry:
            self._put(_encode(self.carry))
            self.carry = b""
        return self.pos


def openai_json_body(model: str, tensor: Any = None, *, route: str = "completions",
                     **fields: Any) -> bytearray:
    """The JSON body of ``POST /v1/completions`` (or ``/v1/chat/completions``)
    with ``prompt_embeds`` as base64 of ``torch.save`` bytes, as vLLM's OpenAI
    server (``--enable-prompt-embeds``) reads it: ``json.loads`` of it equals
    ``{"model": model, **fields, "prompt_embeds": base64.b64encode(buf.getvalue()).decode()}``
    with ``buf`` holding ``torch.save(tensor)`` (for a tensor that owns its
    storage; a view is compacted first: the same values, fewer bytes).

    Args:
        model: the ``model`` field.
        tensor: a ``(num_tokens, hidden_size)`` CPU tensor of float32, float16
            or bfloat16, contiguous or not; for completions also a list of them
            (one prompt each), or a :class:`Continuation` (the object of
            ``docs/conversations.md``: only a server with shm-embeds reads it). Chat: the content of one user message when
            ``fields`` has no ``messages``; with ``messages``, each
            ``{"type": "prompt_embeds", "data": <tensor>}`` part's tensor is
            encoded instead (``tensor`` is then ignored).
        route: ``"completions"`` or ``"chat"``.
        fields: the other request fields (``max_tokens``, ``temperature``,
            ``messages``, ...), anything ``json.dumps`` takes.
    Returns:
        the body, ``4 * ceil(S / 3)`` bytes of base64 per tensor (``S``: its
        ``torch.save`` size, its ``num_tokens * hidden_size * itemsize`` bytes
        plus about 1.5 KiB) plus the JSON of ``fields``; UTF-8 JSON.
    Raises:
        TypeError: a ``prompt_embeds`` value that is not a ``torch.Tensor``
            (e.g. None: no tensor given), or a field ``json.dumps`` rejects.
        ValueError: a tensor not on the CPU, not dense, not 2-D, or of another
            dtype; no tensor at all (an empty list, or chat ``messages``
            without a ``prompt_embeds`` part); an
            unknown ``route``.
    """
    if route not in ("completions", "chat"):
        raise ValueError(f"route must be 'completions' or 'chat', got {route!r}")
    tensors: list[torch.Tensor] = []
    marker = f"shm-embeds-{secrets.token_hex(16)}"
    refs = 0

    def take(t: Any) -> Any:
        nonlocal refs
        if isinstance(t, KeptPart) and route == "chat":  # a kept part, by id
            refs += 1
            return t.ref
        if isinstance(t, Continuation):  # the kept rows by id, then these rows
            if route != "completions":
                raise ValueError("a Continuation is for completions requests")
            return {PREFIX: t.prefix, PREFIX_ROWS: t.prefix_rows, PREFIX_DATA: take(t.rows)}
        tensors.append(_checked(t))
        return f"{marker}-{len(tensors) - 1}"

    skeleton = _map_embeds(_request(route, model, tensor, fields), route, take)
    if not tensors and not refs:
        raise ValueError("no prompt_embeds tensor in the request")
    parts = re.split(rb'"' + marker.encode() + rb'-(\d+)"', json.dumps(skeleton).encode())
    order = [int(i) for i in parts[1::2]]
    if sorted(order) != list(range(len(tensors))):  # a field spelled the marker itself
        raise RuntimeError("placeholder collision; build the body again")
    size = sum(len(p) for p in parts[0::2]) + sum(
        2 + 4 * ((t.nbytes + _SLACK + 2) // 3) for t in tensors)
    out = bytearray(size)
    pos = 0

    def put(text: bytes) -> None:
        nonlocal pos
        out[pos:pos + len(text)] = text
        pos += len(text)

    for piece, i in zip(parts[0::2], order):
        put(piece)
        put(b'"')
        w = _Base64Into(out, pos)
        torch.save(tensors[i], w)
        pos = w.finish()
        put(b'"')
    put(parts[-1])
    del out[pos:]
    return out


def openai_json_request(route: str, model: str, tensor: Any, fields: dict,
                        headers: dict | None = None) -> tuple[dict[str, str], bytearray]:
    """Headers (``Content-Type: application/json``, ``Content-Length``, then
    ``headers``) and body (:func:`openai_json_body`) of the request."""
    body = openai_json_body(model, tensor, route=route, **fields)
    h = {"Content-Type": JSON_CONTENT_TYPE, "Content-Length": str(len(body))}
    h.update(headers or {})
    return h, body
