# SPDX-License-Identifier: Apache-2.0
"""Binary ``prompt_embeds`` request bodies streamed into shared memory.

Wire format: KServe v2 / Triton "binary tensor data" framing on ``POST
/v1/completions`` and ``POST /v1/chat/completions`` (``Content-Type:
application/octet-stream`` and ``Inference-Header-Content-Length: <n>``: a JSON
header whose ``prompt_embeds`` are descriptors, then each tensor's raw bytes).
:class:`BinaryFormat`, a body format of the one body gate (``gate.BodyGate``),
claims only such requests, validates every descriptor against the served model
before allocating anything, writes the tensor bytes straight into segments and
calls the stock app with placeholders that resolve only in this request's context
(``ext/binary/site_renderers.py``). Hop 1 then sends the segment itself by handle.

Knows HTTP (ASGI) and nothing of vLLM's classes.
Design notes: docs/design.md, "Module notes"; docs/binary-protocol.md.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch
from starlette.datastructures import Headers
from vllm.logger import init_logger

from vllm._shm_embeds import extensions
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.counters import count, count_many, count_reason
from vllm._shm_embeds.ext.binary.events import BinaryEvent
from vllm._shm_embeds.ext.binary.binary_header import (  # noqa: F401 (re-exported)
    CONTENT_TYPE,
    DATATYPES,
    HEADER_NAME,
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    BinaryBodyError,
    ParsedHeader,
    TensorSpec,
    _bad,
    check_json_bounds,
    frame_header_length,
    max_json_values,
    parse_header,
    parse_spec,
)
from vllm._shm_embeds.ext.binary.common import COMPLETIONS, ServerContext
from vllm._shm_embeds.ext.binary.gate import Body, Claim, Outcome
from vllm._shm_embeds.ext.binary.placeholders import Upload
from vllm._shm_embeds.lifetime.streamed import (
    StreamedSegment,
    release_streamed,
    streamed_tensor_like,
)

digests = extensions.require("digests", "digests")

logger = init_logger(__name__)


# --------------------------------------------------------------------------
# the format (``gate.BodyFormat``)

class _Private:
    """A tensor in this process's memory that a body is written into: the stock
    way, for a tensor that cannot go to shared memory (budget, ENOSPC, a failed
    write). Same interface as ``streamed.StreamedSegment``."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.tensor = torch.empty(shape, dtype=dtype)
        self.nbytes = self.tensor.nbytes
        self.filled = 0
        self._bytes = memoryview(self.tensor.view(-1).view(torch.uint8).numpy())

    def write(self, data: bytes | memoryview) -> None:
        if self.filled + len(data) > self.nbytes:
            raise ValueError("more bytes than the tensor holds")
        self._bytes[self.filled:self.filled + len(data)] = data
        self.filled += len(data)

    def finish(self, writable: bool = True) -> torch.Tensor:
        return self.tensor

    def abort(self) -> None:
        pass


def _open_sink(spec: TensorSpec) -> StreamedSegment | _Private:
    """A segment for the tensor ``spec`` describes, else private memory (counted)."""
    try:
        return StreamedSegment(spec.dtype, spec.shape)
    except OSError as e:
        return _fall_back(None, spec, e)


def _fall_back(segment: StreamedSegment | None, spec: TensorSpec, e: OSError) -> _Private:
    """Move a tensor's body bytes from a segment that failed to private memory."""
    reason = seg.fallback_reason(e)
    count_reason(BinaryEvent.BINARY_FALLBACK, reason)
    logger.debug("shm-embeds: a binary body's tensor goes the stock way (%s): %s", reason, e)
    private = _Private(spec.dtype, spec.shape)
    if segment is not None:
        try:
            segment.read_back(private._bytes)
            private.filled = segment.filled
        finally:
            segment.abort()
    return private


async def _read_exact(body: Body, n: int) -> bytearray:
    """Exactly ``n`` body bytes (for the JSON header only), in one buffer that
    grows with the bytes that arrived (never by ``n`` before they do)."""
    out = bytearray()
    while len(out) < n:
        piece = await body.take(n - len(out))
        if piece is None:
            raise _bad("short", f"the body is cut short: ended inside the {n}-byte JSON header")
        out += piece
    return out


async def _copy_into(body: Body, sink: StreamedSegment | _Private,
                     hasher: digests.StreamHasher | None = None) -> None:
    """Write the next ``sink.nbytes`` body bytes into ``sink``, piece by piece
    as they arrive, and give each piece written to ``hasher``. On an OSError
    of the sink the piece comes again (``Body.untake``) for the next sink."""
    while sink.filled < sink.nbytes:
        piece = await body.take(sink.nbytes - sink.filled)
        if piece is None:
            raise _bad("short", f"the body is cut short: a tensor got {sink.filled} "
                       f"of its {sink.nbytes} bytes")
        try:
            sink.write(piece)
        except OSError:
            body.untake()
            raise
        if hasher is not None and (wait := hasher.feed(piece)) is not None:
            await asyncio.wrap_future(wait)  # the pool is behind: bounded memory


class BinaryFormat:
    """The binary body format (``gate.BodyFormat``): see the module docstring
    for the wire format and the design."""

    name = "binary"

    def claim(self, path: str, h: Headers, ctx: ServerContext | None) -> Claim | None:
        """A request with the binary framing's headers: its JSON header is
        held in memory while the body arrives (``in_memory``; over the cap:
        503), the tensors go to segments. Raises ``BinaryBodyError``: bad
        framing, the server not ready (503), ``--enable-prompt-embeds`` off."""
        framing = frame_header_length(h.raw)
        if framing is None:
            return None
        if ctx is None:
            raise _bad("not_ready", "the server is not ready", 503)
        if not ctx.enable_prompt_embeds:  # nothing read: refused as stock refuses it
            raise _bad("disabled", "You must set `--enable-prompt-embeds` to input "
                       "`prompt_embeds`.")
        json_len, content_length = framing
        # A deadline (timeout + size / minimum rate) for the JSON header first,
        # then for the tensor bytes the validated header says follow: sizes
        # the server bounds, never the client's Content-Length.
        return Claim(length=json_len, in_memory=json_len, when_busy="refuse", state=framing)

    async def prepare(self, path: str, body: Body, ctx: ServerContext | None,
                      claim: Claim) -> Outcome:
        json_len, content_length = claim.state
        segs: list[StreamedSegment | _Private] = []
        hashers: list[digests.StreamHasher | None] = []
        try:
            parsed = parse_header(await _read_exact(body, json_len), path, ctx, content_length)
            body.extend(sum(s.nbytes for s in parsed.specs))
            for spec in parsed.specs:
                segs.append(_open_sink(spec))
                hashers.append(_hasher(spec, ctx, segs[-1], path))
                try:
                    await _copy_into(body, segs[-1], hashers[-1])
                except OSError as e:  # e.g. ENOSPC midway: go on in private memory
                    if hashers[-1] is not None:
                        hashers[-1].abort()
                        hashers[-1] = None
                    segs[-1] = _fall_back(segs[-1], spec, e)
                    await _copy_into(body, segs[-1])
            if not await body.at_end():
                raise _bad("extra", "extra bytes after the last tensor")
            # Hashed bytes are mapped read-only: nothing here can change them.
            tensors = [s.finish(writable=h is None) for s, h in zip(segs, hashers)]
            segs = []
            for t, h in zip(tensors, hashers):
                if h is not None:
                    digests.attach(t, await asyncio.wrap_future(h.result()))
            hashers = []
            upload = Upload(parsed.token, tensors, ctx.hash_block_tokens)
            if any(t.dtype != ctx.dtype for t in tensors):
                upload.tensors = await asyncio.get_running_loop().run_in_executor(
                    None, _convert, tensors, ctx.dtype)
            count_many({BinaryEvent.BINARY_BODIES: 1, BinaryEvent.BINARY_TENSORS: len(tensors),
                        BinaryEvent.BINARY_BYTES: sum(t.nbytes for t in tensors)})
            del tensors
        finally:  # (before the gate counts: the counter says it is clean)
            for s in segs:
                s.abort()
            for h in hashers:
                if h is not None:
                    h.abort()
        return Outcome(json.dumps(parsed.body).encode(), upload,
                       content_type=b"application/json")

    def counted(self, reason: str) -> None:
        count_reason(BinaryEvent.BINARY_REJECTED, reason)


def _hasher(spec: TensorSpec, limits: ServerContext, sink: StreamedSegment | _Private,
            path: str) -> digests.StreamHasher | None:
    """A hasher for a completions tensor that goes to the EngineCore as it
    arrives (its segment, in the model's dtype, prefix caching on), else None:
    a chat part is hashed once the prompt is assembled
    (``ext/binary/site_renderers.py``); a cast tensor by vLLM in the EngineCore
    (counted there)."""
    if (isinstance(sink, _Private) or spec.dtype != limits.dtype
            or not limits.hash_block_tokens or path != COMPLETIONS):
        return None
    tokens = spec.shape[0]
    return digests.StreamHasher(tokens, spec.nbytes // tokens, limits.hash_block_tokens)


def _convert(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Cast each tensor not of ``dtype`` into a new segment (one more counted
    copy), or into private memory when there is no room (counted fallback).

    Runs in a thread. The source segments are released as their tensors go.
    """
    out = []
    for t in tensors:
        if t.dtype == dtype:
            out.append(t)
            continue
        try:
            dst = streamed_tensor_like(dtype, tuple(t.shape))
        except OSError as e:  # no room: cast in private memory, the stock way
            count_reason(BinaryEvent.BINARY_FALLBACK, seg.fallback_reason(e))
            dst = t.to(dtype)
        else:
            dst.copy_(t)
        count(BinaryEvent.BINARY_CONVERTED_BYTES, dst.nbytes)
        release_streamed(t)
        out.append(dst)
    return out


if sys.byteorder != "little":  # the wire format is little-endian; so is every vLLM host
    logger.warning("shm-embeds: big-endian host; binary bodies are not supported")
