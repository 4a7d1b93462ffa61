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
import dataclasses
import json
import sys
from typing import Any

import torch
from shm_embeds_client import wire
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
from vllm._shm_embeds.ext.binary.common import COMPLETIONS, ServerContext, chat_hook, prefix_hooks
from vllm._shm_embeds.ext.binary.gate import Body, Claim, Disconnected, Outcome, Refused
from vllm._shm_embeds.ext.binary.placeholders import Upload
from vllm._shm_embeds.lifetime.transfer import release_streamed

digests = extensions.require("digests", "digests")
_streamed = extensions.require("digests", "streamed")
StreamedSegment = _streamed.StreamedSegment

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


async def _off_loop(undo: Any, fn: Any, *args: Any, executor: Any = None) -> Any:
    """``fn(*args)`` on a thread (of ``executor``, else the loop's default); if the
    awaiting task is cancelled, what it returns (not None) is handed to ``undo`` once
    it does (nothing it took is left held)."""
    fut = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None
                              or f.result() is None else undo(f.result()))
        raise


async def _resolve(hook: Any, value: Any, body: dict, spec: TensorSpec) -> Any:
    """``hook.resolve``; on a thread when it is a round trip to a sibling API server
    (``hook.is_remote``), so that the event loop never waits on another process: the
    hook's own threads where it has them (``hook.round_trips``)."""
    if getattr(hook, "is_remote", None) is not None and hook.is_remote(value):
        executor = hook.round_trips() if hasattr(hook, "round_trips") else None
        return await _off_loop(lambda p: p.release(), hook.resolve, value, body, spec.dtype,
                               spec.shape[1], executor=executor)
    return hook.resolve(value, body, spec.dtype, spec.shape[1])


def _hook_sink(hooks: dict[str, Any], pre: Any, spec: TensorSpec, keeping: bool) -> Any:
    """Where a prefix hook writes a continuation or a kept tensor (e.g. after its
    kept rows, in place), or None (a segment of its own)."""
    if pre is None and not keeping:
        return None
    for hook in hooks.values():
        if (opener := getattr(hook, "open_sink", None)) is not None:
            if (sink := opener(pre, spec.dtype, spec.shape, keeping)) is not None:
                return sink
    return None


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
        return Claim(length=json_len, in_memory=json_len, when_busy="refuse",
                     state=(framing, h))

    async def prepare(self, path: str, body: Body, ctx: ServerContext | None,
                      claim: Claim) -> Outcome:
        (json_len, content_length), h = claim.state
        hooks, chat = prefix_hooks(), chat_hook()
        turn = None  # a chat turn's kept parts and keep (chat_hook)
        segs: list[StreamedSegment | _Private] = []
        hashers: list[digests.StreamHasher | None] = []
        prefixes: list[Any] = []
        keeps: list[Any] = []
        tensors: list[torch.Tensor] = []  # finished, not yet the upload's
        try:
            header = await _read_exact(body, json_len)
            try:
                parsed = parse_header(header, path, ctx, content_length, frozenset(
                    [*hooks, *([wire.PART] if chat is not None else [])]))
            except Refused:  # e.g. a continuation past --max-model-len: answered, not reset
                await _drain_stated(body, content_length, json_len, ctx)
                raise
            body.extend(sum(s.nbytes for s in parsed.specs))
            try:  # every reference resolved and checked before a byte is read
                keeps = [k for hook in hooks.values() if (k := hook.keep_request(
                    h, path, parsed.body, len(parsed.specs))) is not None]
                if chat is not None and (turn := chat.chat_turn(
                        h, path, parsed.body, ctx.dtype, ctx.hidden_size,
                        sum(s.shape[0] for s in parsed.specs), ctx.max_model_len)) is not None:
                    await turn.ready()
                fulls = []
                for spec in parsed.specs:
                    prefixes.append(None)
                    if spec.extra and (path != COMPLETIONS or len(parsed.specs) != 1):
                        # (one whole tensor per body: the body cap bounds what it makes)
                        raise _bad("parameter", "a continuation (shm_embeds_prefix) is the "
                                   "only prompt_embeds tensor of a /v1/completions request")
                    for name, value in spec.extra:
                        prefixes[-1] = await _resolve(hooks[name], value, parsed.body, spec)
                    fulls.append(_after(spec, prefixes[-1], ctx))
                for pre in prefixes:  # a keep answered while its copy still ran
                    if pre is not None:
                        await pre.ready()
            except Refused:  # the client reads an answer only once it has sent its body
                await _drain(body)
                raise
            for full, pre in zip(fulls, prefixes):
                try:
                    sink = (await _off_loop(lambda s: s.abort(), _hook_sink, hooks, pre, full,
                                            bool(keeps))  # a round trip to a sibling
                            if getattr(pre, "tip", None) is not None
                            and getattr(pre.tip, "remote", None) is not None
                            else _hook_sink(hooks, pre, full, bool(keeps)))
                    segs.append(sink or _open_sink(full))
                except OSError as e:  # (the hook gave back what it took)
                    logger.debug("shm-embeds: a prefix hook's sink failed: %s", e)
                    segs.append(_open_sink(full))
                hashers.append(_hasher(full, ctx, segs[-1], path, pre))
                try:
                    if pre is not None:
                        await _write_prefix(segs[-1], pre, hashers[-1])
                    await _copy_into(body, segs[-1], hashers[-1])
                except OSError as e:  # e.g. ENOSPC midway: go on in private memory
                    if hashers[-1] is not None:
                        hashers[-1].abort()
                        hashers[-1] = None
                    segs[-1] = _fall_back(segs[-1], full, e)
                    if pre is not None and segs[-1].filled == 0:
                        try:
                            await _write_prefix(segs[-1], pre)
                        except OSError:  # the kept rows cannot even be mapped
                            raise _bad("no_memory", "the server is out of memory", 503) from e
                    await _copy_into(body, segs[-1])
            if not await body.at_end():
                raise _bad("extra", "extra bytes after the last tensor")
            # Hashed bytes are mapped read-only: nothing here can change them.
            for s, h in zip(segs, hashers):
                tensors.append(s.finish(writable=h is None))
            segs = []
            for t, hs, pre in zip(tensors, hashers, prefixes):
                if hs is not None:
                    digests.attach(t, _joined(pre, await asyncio.wrap_future(hs.result())))
            hashers = []
            upload = Upload(parsed.token, tensors, ctx.hash_block_tokens)
            made, tensors = tensors, []  # (the upload's from here)
            if turn is not None:
                upload.turn, turn = turn, None
                upload.keeps.append(upload.turn)
            try:
                for keep in keeps:  # a copy, on a thread, while vLLM serves the request
                    keep.start(made[0])
                    upload.keeps.append(keep)
                keeps = []
                if any(t.dtype != ctx.dtype for t in made):
                    await upload.settle()  # the cast lets the source's pages go
                    upload.tensors = await asyncio.get_running_loop().run_in_executor(
                        None, _convert, made, ctx.dtype)
            except BaseException:
                upload.release()
                raise
            count_many({BinaryEvent.BINARY_BODIES: 1,
                        BinaryEvent.BINARY_TENSORS: len(upload.tensors),
                        BinaryEvent.BINARY_BYTES: sum(s.nbytes for s in parsed.specs)})
        finally:  # (before the gate counts: the counter says it is clean)
            for t in tensors:
                release_streamed(t)
            for s in segs:
                s.abort()
            for hs in hashers:
                if hs is not None:
                    hs.abort()
            for pre in prefixes:
                if pre is not None:
                    pre.release()
            for keep in keeps:
                keep.close()
            if turn is not None:
                turn.close()
        return Outcome(json.dumps(parsed.body).encode(), upload,
                       content_type=b"application/json")

    def counted(self, reason: str) -> None:
        count_reason(BinaryEvent.BINARY_REJECTED, reason)


async def _drain(body: Body) -> None:
    """Read and drop the rest of a refused body (its size was validated; the body's
    deadline holds), so that an HTTP/1.1 client that sends its whole body before it
    reads gets the answer, not a reset connection; a stall or a disconnect ends it."""
    try:
        while await body.piece() is not None:
            pass
    except (Refused, Disconnected):
        pass


async def _drain_stated(body: Body, content_length: int | None, json_len: int,
                        ctx: ServerContext) -> None:
    """:func:`_drain` a body refused for its JSON header, when its
    ``Content-Length`` says the rest is within the body cap (a chunked body, or
    one over the cap, is not read: the connection closes on it)."""
    rest = None if content_length is None else content_length - json_len
    if rest is not None and 0 <= rest <= ctx.max_body_bytes:
        body.extend(rest)
        await _drain(body)


def _after(spec: TensorSpec, pre: Any, ctx: ServerContext) -> TensorSpec:
    """The whole tensor of a continuation ``spec`` (its shape's rows: the kept rows
    ``pre``, then the body's), or ``spec`` itself (``pre`` None). Raises
    BinaryBodyError: 400 when the kept rows are not the shape's first rows, 413 when
    the whole tensor is over the body cap."""
    if pre is None:
        return spec
    tokens, row = spec.shape[0], pre.row_bytes  # (same dtype and hidden)
    full = tokens * row
    if spec.nbytes != (tokens - pre.rows) * row:
        raise _bad("prefix_rows", "a continuation's shape must count the kept rows and "
                   "its new rows, and binary_data_size only the new rows")
    if full > ctx.max_body_bytes:
        raise _bad("too_large", "the continuation's whole tensor is over the server's "
                   "limit", 413)
    return dataclasses.replace(spec, nbytes=full, extra=())


def _reused_blocks(pre: Any, block_tokens: int) -> int:
    """Whole blocks of ``pre`` whose kept digests hold for the whole tensor too."""
    d = pre.digests if pre is not None else None
    return pre.rows // block_tokens if d is not None and d.block_tokens == block_tokens else 0


async def _write_prefix(sink: StreamedSegment | _Private, pre: Any,
                        hasher: digests.StreamHasher | None = None) -> None:
    """Write the kept rows into ``sink`` (on a thread: one copy) unless they are its
    first rows already (``has_prefix``: grown in place), and give ``hasher`` the rows
    after the last whole block whose digest is reused."""
    in_place = getattr(sink, "has_prefix", False)
    if in_place and hasher is None:
        return  # (nothing to read: the kept rows are not even mapped)
    data = memoryview(pre.tensor.reshape(-1).view(torch.uint8).numpy())
    if not in_place:
        write = asyncio.get_running_loop().run_in_executor(None, sink.write, data)
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:  # the sink's file stays open until the write is done
            await asyncio.wait([write])
            raise
    if hasher is not None:
        row_bytes = data.nbytes // pre.rows
        tail = data[_reused_blocks(pre, hasher.block_tokens) * hasher.block_tokens * row_bytes:]
        if (wait := hasher.feed(tail)) is not None:
            await asyncio.wrap_future(wait)


def _joined(pre: Any, found: Any) -> Any:
    """The whole tensor's digests: the kept rows' reused, then ``found`` (hashed here)."""
    reused = _reused_blocks(pre, found.block_tokens)
    if not reused:
        return found
    b = found.block_tokens
    return digests.BlockDigests(b, reused * b + found.rows,
                                pre.digests.digests[:reused * digests.DIGEST_BYTES]
                                + found.digests)


def _hasher(spec: TensorSpec, limits: ServerContext, sink: StreamedSegment | _Private,
            path: str, pre: Any = None) -> digests.StreamHasher | None:
    """A hasher for a completions tensor that goes to the EngineCore as it
    arrives (its segment, in the model's dtype, prefix caching on), else None:
    a chat part is hashed once the prompt is assembled
    (``ext/binary/site_renderers.py``); a cast tensor by vLLM in the EngineCore
    (counted there)."""
    if (isinstance(sink, _Private) or spec.dtype != limits.dtype
            or not limits.hash_block_tokens or path != COMPLETIONS):
        return None
    tokens, b = spec.shape[0], limits.hash_block_tokens
    skip = _reused_blocks(pre, b) * b
    return digests.StreamHasher(tokens - skip, spec.nbytes // tokens, b)


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
            dst = _streamed.streamed_tensor_like(dtype, tuple(t.shape))
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
