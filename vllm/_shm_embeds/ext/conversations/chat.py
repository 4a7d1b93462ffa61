# SPDX-License-Identifier: Apache-2.0
"""Chat conversations: the ``chat_turns`` hook (:data:`HOOK`), docs/conversations.md.

A ``/v1/chat/completions`` request with ``Shm-Embeds-Keep`` has its rendered prompt
kept (the embeds tensor vLLM builds, token ids, the parts' rows; :class:`Rendered`),
answered ``Shm-Embeds-Kept: <id>``. A later request names that turn's embeds part
``k`` as the ``data`` of a ``prompt_embeds`` part, ``wire.PART + id + "." + k``: served
from the kept rows (not sent, decoded or copied). When the new rendered prompt begins
with the kept one (same token ids, the kept parts at their rows), its new rows are
written after the kept ones in their tip and only they are hashed (:meth:`ChatTurn.build`).
May import: the core; ``binary`` (common, gate) and ``digests`` via ``extensions.require``.
"""

from __future__ import annotations

import array
import asyncio
import json
import threading
from typing import Any

import torch
from shm_embeds_client import wire
from vllm.logger import init_logger

from vllm._shm_embeds import extensions
from vllm._shm_embeds.counters import count, count_many, count_reason
from vllm._shm_embeds.ext.conversations.events import ConversationEvent
from vllm._shm_embeds.ext.conversations import remote
from vllm._shm_embeds.ext.conversations.keeps import KeepRequest
from vllm._shm_embeds.ext.conversations.local import max_bytes, new_tip, store
from vllm._shm_embeds.ext.conversations.rendered import Rendered
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.ext.conversations.prefixes import HOOK as _prefixes
from vllm._shm_embeds.ext.conversations.prefixes import (KEEP_HEADER, Prefix, PrefixNotFound,
                                                         TipSink, keep_ttl, salt_of)

logger = init_logger(__name__)

_common = extensions.require("binary", "common")
_gate = extensions.require("binary", "gate")
_digests = extensions.require("digests", "digests")

MAX_REFS = 256  # part references one request may make (each is a pin)
MAX_TURNS = 16  # kept turns one request may name (each a pin, a sibling's a connection)
TEMPLATE_ROWS = 128  # rows a chat template may add beyond its messages' text (_bound)


def is_ref(value: Any) -> bool:
    """``value`` is a part reference (``wire.PART`` + id + ``.`` + index)."""
    return isinstance(value, str) and value.startswith(wire.PART)


def _parse(value: str) -> tuple[str, int]:
    """``(id, index)`` of a reference. Raises Refused (400): not id.index."""
    kid, dot, k = value[len(wire.PART):].rpartition(".")
    if not dot or not (k.isascii() and k.isdigit()) or len(k) > 6 or k != str(int(k)):
        raise _gate.Refused(400, "part_ref", f"a kept part is named {wire.PART}<id>.<index>")
    return kid, int(k)


def _ids(token_ids: Any) -> array.array | None:
    """``token_ids`` as ``array('i')``, or None (not 32-bit ids)."""
    try:
        return array.array("i", token_ids)
    except (OverflowError, TypeError):
        return None


class ChatTurn:
    """One chat request's kept parts (pinned until :meth:`close`) and keep; in the
    upload as ``Upload.turn`` and among ``Upload.keeps``. Turns a sibling API server
    kept (``far``) are pinned there by :meth:`ready` / :meth:`wait`; when the first
    is the base, rows after it are claimed there at once, up to ``bound`` more rows
    (what this prompt may add, :func:`_bound`): :meth:`build` runs on the event loop,
    where no round trip may wait, and trims the claim to the rendered size."""

    def __init__(self, keep: KeepRequest | None, pins: dict[str, Prefix],
                 refs: list[tuple[str, int]], far: list[str],
                 need: tuple[str | None, torch.dtype, int, int, int]) -> None:
        self.keep, self._pins, self._refs, self._far = keep, pins, refs, far
        self._need = need  # (salt, dtype, hidden, bound, --max-model-len)
        self._base = _base_of(refs, pins)
        self._parts: dict[str, torch.Tensor] = {}
        # a grown prompt: (tensor, the kept digests, kept rows, the kept token ids' array)
        self._grown: tuple[torch.Tensor, Any, int, array.array] | None = None
        self._positions: tuple[tuple[int, int], ...] = ()
        self._claimed: int | None = None  # a sibling base's claim: its end (rows)
        self._lock = threading.Lock()
        self._closed = False

    async def ready(self) -> None:
        """Wait for kept turns whose copy still runs, and pin those of siblings (on
        ``remote.round_trips``, never the event loop). Raises Refused: PrefixNotFound
        (the copy failed, not held), 400 (no such part, another datatype or hidden
        size), 503 (the rows cannot be mapped)."""
        for p in list(self._pins.values()):
            await p.ready()
        if self._far:  # (cancelled: close() lets go of what the thread pinned)
            await asyncio.shield(asyncio.get_running_loop().run_in_executor(
                remote.round_trips(), self._pin_far))
        self._map()

    def wait(self) -> None:
        """:meth:`ready` on this thread."""
        for p in list(self._pins.values()):
            p.wait()
        self._pin_far()
        self._map()

    def _pin_far(self) -> None:
        far, self._far = self._far, []
        salt, dtype, hidden, bound, max_rows = self._need
        for kid in far:
            prefix = _prefixes.pin_sibling(kid, salt, chat=True)
            if not self._hold(kid, prefix):
                raise PrefixNotFound()  # (closed meanwhile: nobody reads this)
            count_many({ConversationEvent.PREFIX_HITS: 1, ConversationEvent.SIBLING_HITS: 1})
            if prefix.tip.dtype != dtype or prefix.tip.hidden != hidden:
                raise _dtype_refused()
        base = self._base = self._base or _base_of(self._refs, self._pins)
        if base in far and bound > 0:  # (every turn pinned: their parts count too)
            lease, rows = self._pins[base].tip.remote, self._pins[base].rows
            end = min(max_rows, rows + bound + sum(
                self._pins[kid].chat.positions[k][1] for kid, k in self._refs
                if kid != base and k < len(self._pins[kid].chat.positions)))
            if end > rows and lease.claim(end) == "ok" and not self._hold_claim(end):
                lease.unclaim(end)
                lease.let_go()

    def _hold(self, kid: str, prefix: Prefix) -> bool:
        with self._lock:
            if not self._closed:
                self._pins[kid] = prefix
                return True
        prefix.release()
        return False

    def _hold_claim(self, end: int) -> bool:
        with self._lock:
            if not self._closed:
                self._claimed = end
            return not self._closed

    def _map(self) -> None:
        for kid, k in self._refs:
            chat = self._pins[kid].chat
            if k >= len(chat.positions):
                raise _gate.Refused(400, "part_ref", "a kept turn has no embeds part of "
                                    "that index")
            start, rows = chat.positions[k]
            try:
                view = self._pins[kid].tensor  # (mapped on first use)
            except OSError:
                raise _gate.Refused(503, "no_memory", "the server is out of memory") from None
            self._parts[f"{wire.PART}{kid}.{k}"] = view[start:start + rows]
        count_many({ConversationEvent.CHAT_PARTS: len(self._refs),
                    ConversationEvent.PREFIX_ROWS: sum(p.shape[0] for p in self._parts.values())})

    def part(self, data: Any) -> torch.Tensor | None:
        """The kept part a content part's ``data`` names in this request, or None."""
        if isinstance(data, (bytes, bytearray)):
            data = bytes(data).decode("ascii", "replace")
        return self._parts.get(data) if isinstance(data, str) else None

    def build(self, token_ids: list[int], tensors: list[torch.Tensor],
              positions: list[tuple[int, int]]) -> tuple[torch.Tensor, list[bool]] | None:
        """``_build_mixed_prompt_embeds``'s ``(embeds, is_token_ids)``, written into a
        tip: after the kept turn's rows when this prompt begins with them (only the new
        rows written; :meth:`hash` then hashes only them), else a new tip when the turn
        is kept; None: not ours to build (the caller assembles it in a segment)."""
        self._positions = ()  # (kept only with positions that are vLLM's own and valid)
        spans = tuple((int(s), int(n)) for s, n in positions)
        total = len(token_ids)
        if not tensors or len(spans) != len(tensors) or any(
                t.dim() != 2 or t.shape[1] != tensors[0].shape[1]
                or t.dtype != tensors[0].dtype for t in tensors):
            return None
        dtype, hidden = tensors[0].dtype, tensors[0].shape[1]
        at = 0
        for (start, rows), t in zip(spans, tensors, strict=True):
            if start < at or t.shape[0] != rows or start + rows > total:
                return None
            at = start + rows
        self._positions = spans
        sink = None
        try:
            sink, start = self._grow(token_ids, tensors, dtype, total), 0
            if sink is not None:
                start = sink.start
            else:  # the kept parts are copied: into a new tip here, or by the caller
                count(ConversationEvent.KEPT_COPIED_BYTES,
                      sum(p.nbytes for p in self._parts.values()))
                if self.keep is not None and (tip := new_tip(dtype, total, hidden)) is not None:
                    sink = TipSink(tip, 0, total)
            if sink is None:
                return None
            row, at = hidden * dtype.itemsize, start
            for (s, rows), t in zip(self._positions, tensors, strict=True):
                if s < start:
                    continue  # (a kept part, in the tip already)
                seg.write_zeros(sink.write, (s - at) * row)
                sink.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
                at = s + rows
            seg.write_zeros(sink.write, (total - at) * row)
            out = sink.finish()
        except Exception:  # e.g. no memory: the caller assembles it (a segment, or vLLM's)
            if sink is not None:  # (TipSink gives back what it claimed; finish did too)
                sink.abort()
            logger.debug("shm-embeds: a chat prompt's tip failed", exc_info=True)
            return None
        if start:
            base = self._pins[self._base]
            self._grown = (out, base.digests, start, base.chat.token_ids)
        mask = [True] * total
        for s, rows in self._positions:
            mask[s:s + rows] = [False] * rows
        return out, mask

    def _grow(self, token_ids: list[int], tensors: list[torch.Tensor], dtype: torch.dtype,
              total: int) -> TipSink | None:
        """A sink after the kept turn's rows, if this prompt begins with that turn's."""
        if self._base not in self._pins:  # (none, or unpinned: a build after rendering)
            return None
        prefix = self._pins[self._base]
        chat: Rendered = prefix.chat
        m, kept_rows = len(chat.positions), prefix.rows
        named = [self._parts.get(f"{wire.PART}{self._base}.{k}") for k in range(m)]
        why = None
        if total <= kept_rows or prefix.tip.dtype != dtype:
            why = "shape"
        elif (len(tensors) < m or any(tensors[k] is not named[k] for k in range(m))
              or self._positions[:m] != chat.positions
              or (len(tensors) > m and self._positions[m][0] < kept_rows)):
            why = "parts"
        elif _ids(token_ids[:kept_rows]) != chat.token_ids[:kept_rows]:
            why = "tokens"  # e.g. a template that drops or rewrites earlier turns
        lease = prefix.tip.remote
        if lease is not None:  # a sibling's turn: its rows claimed by ready()
            with self._lock:
                claimed, self._claimed = self._claimed, None
            if why is None and claimed is None:
                why = "full"  # (or taken: another branch grew it first)
            elif why is None and total > claimed:
                why = "bound"  # rendered longer than the bound the claim allowed
            if why is None and total < claimed:
                lease.trim(claimed, total)
            elif why is not None and claimed is not None:
                lease.unclaim(claimed)
                lease.let_go()
        elif why is None and (got := store().claim(prefix.tip, kept_rows, total,
                                                   max_bytes())) is not None:
            why = got  # "taken": another branch grew it first; "full": no room
        if why is not None:
            count_reason(ConversationEvent.CHAT_REBUILT, why)
            return None
        count(ConversationEvent.CHAT_GROWN)
        return TipSink(prefix.tip, kept_rows, total)

    async def hash(self, tensor: torch.Tensor, block: int) -> Any:
        """Digests of a prompt :meth:`build` grew: the kept turn's whole blocks as kept,
        the rest hashed on the hash pool; None for any other tensor (hash it all)."""
        if self._grown is None or self._grown[0] is not tensor:
            return None
        _, kept, rows, _ = self._grown
        reused = rows // block if kept is not None and kept.block_tokens == block else 0
        found = await asyncio.wrap_future(_digests.hash_tensor(tensor[reused * block:], block))
        if not reused:
            return found
        return _digests.BlockDigests(block, tensor.shape[0], kept.digests[
            :reused * _digests.DIGEST_BYTES] + found.digests)

    def rendered(self, prompt: Any) -> None:
        """vLLM rendered the prompt (digests attached): keep it if asked (a prompt in a
        tip as it is, any other copied into one on a thread). The kept turns it named
        are unpinned now (their rows are fixed bytes; a part's view stays mapped), so
        that a long generation holds no entry from eviction."""
        try:
            self._keep(prompt)
        finally:
            self._unpin()

    def _keep(self, prompt: Any) -> None:
        tensor = prompt.get("prompt_embeds") if isinstance(prompt, dict) else None
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if (self.keep is None or not isinstance(tensor, torch.Tensor) or ids is None
                or len(ids) != tensor.shape[0] or not self._positions):
            return
        token_ids = _ids(ids)
        if token_ids is None:
            return
        if self._grown is not None and self._grown[0] is tensor:
            # One array for the tip: only this request claimed the rows after the
            # kept ones, and no entry of this tip reaches past them.
            rows, shared = self._grown[2], self._grown[3]
            del shared[rows:]
            shared.extend(token_ids[rows:])
            token_ids = shared
        self.keep.chat = Rendered(token_ids, self._positions, len(ids))
        self.keep.start(tensor)

    def _unpin(self) -> None:
        with self._lock:
            pins, self._pins = self._pins, {}
            claimed, self._claimed = self._claimed, None
        if claimed is not None:  # a sibling's claim no prompt was written into
            lease = pins[self._base].tip.remote
            lease.unclaim(claimed)
            lease.let_go()
        for p in pins.values():
            p.release()

    async def response_headers(self, status: int) -> list[tuple[bytes, bytes]]:
        return [] if self.keep is None else await self.keep.response_headers(status)

    async def settled(self) -> None:
        if self.keep is not None:
            await self.keep.settled()

    def close(self) -> None:
        """The request has ended: its keep closed, its pins let go (idempotent)."""
        with self._lock:
            self._closed = True  # (a pin still on its thread lets go by itself)
        if self.keep is not None:
            self.keep.close()
        self._parts.clear()
        self._unpin()


class Hook:
    """The binary extension's ``chat_turns`` hook (see the module docstring)."""

    def chat_turn(self, headers: Any, path: str, body: dict, dtype: torch.dtype,
                  hidden: int, new_rows: int = 0, max_rows: int | None = None
                  ) -> ChatTurn | None:
        """The chat turn of a request that keeps or names kept parts, its references
        pinned (their bytes after ``ready``/``wait``; a sibling's pinned there), or
        None. ``new_rows``: at most the rows of the body's own embeds parts;
        ``max_rows``: ``--max-model-len``. Raises Refused: 404 ``PrefixNotFound`` (a
        turn not held, one message for every cause), 400 (a bad keep header or
        reference, another datatype or hidden size, too many)."""
        if path != _common.CHAT:
            return None
        raw = headers.get(KEEP_HEADER)
        refs = [_parse(v) for _, c, key in _common.embeds_slots(path, body)
                if is_ref(v := c.get(key))]
        if raw is None and not refs:
            return None
        if len(refs) > MAX_REFS or len({kid for kid, _ in refs}) > MAX_TURNS:
            raise _gate.Refused(400, "part_ref", f"at most {MAX_REFS} kept parts of "
                                f"{MAX_TURNS} kept turns a request")
        keep = None if raw is None else KeepRequest(keep_ttl(raw), salt_of(body))
        salt, pins, far = salt_of(body), {}, []
        try:
            for kid, _ in refs:
                if kid in pins or kid in far:
                    continue
                kept = store().pin(kid, salt, chat=True)
                if kept is None and _prefixes.is_remote(kid):
                    far.append(kid)  # a sibling's: pinned there by ready() / wait()
                    continue
                if kept is None:
                    count(ConversationEvent.PREFIX_MISSES)
                    raise PrefixNotFound()
                pins[kid] = Prefix(kept)
                if kept.dtype != dtype or kept.shape[1] != hidden:
                    raise _dtype_refused()
        except BaseException:
            for p in pins.values():
                p.release()
            raise
        if pins:
            count(ConversationEvent.PREFIX_HITS, len(pins))
        bound = _bound(body, refs[0][0], new_rows) if far and refs[0][0] in far else 0
        return ChatTurn(keep, pins, refs, far, (salt, dtype, hidden, bound,
                                                max_rows if max_rows is not None else 1 << 62))


def _dtype_refused() -> Exception:
    return _gate.Refused(400, "prefix_dtype", "a kept part must have the served model's "
                         "datatype and hidden size")


def _base_of(refs: list[tuple[str, int]], pins: dict[str, Prefix]) -> str | None:
    """The kept turn this prompt may grow: the first one named, if the request names
    all its parts first, in order (None: not pinned yet, or none)."""
    first = refs[0][0] if refs else None
    if first not in pins:
        return None
    m = len(pins[first].chat.positions)
    return first if refs[:m] == [(first, k) for k in range(m)] else None


def _bound(body: dict, base: str, new_rows: int) -> int:
    """About the most rows a prompt adds after its kept turn ``base``'s (not counting
    other kept turns' parts): the body's own embeds rows, a token per character (no
    tokenizer makes more tokens than UTF-8 bytes) of the body as JSON from the last
    message naming a part of ``base`` on (the messages before it are rendered in the
    kept rows; the other fields, ``tools`` say, a template may render anywhere), and
    :data:`TEMPLATE_ROWS` for the template's own text. A prompt longer than that is
    built whole (``chat_rebuilt.bound``), never wrong."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0  # (vLLM refuses it; nothing claimed up front)
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and isinstance(
        m.get("content"), list) and any(isinstance(p, dict) and isinstance(
            d := p.get("data"), str) and d.startswith(f"{wire.PART}{base}.")
            for p in m["content"])), default=0)
    rest = {k: v for k, v in body.items() if k != "messages"}
    try:
        text = len(json.dumps([rest, messages[last:]], default=str))
    except (TypeError, ValueError, RecursionError):
        return 0
    return new_rows + text + TEMPLATE_ROWS


HOOK = Hook()
