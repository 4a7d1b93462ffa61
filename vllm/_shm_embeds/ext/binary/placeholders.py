# SPDX-License-Identifier: Apache-2.0
"""A request's segment-backed tensors, by placeholder strings.

A body path puts :func:`placeholder` strings where the request's
``prompt_embeds`` were and hands vLLM's app the new body with the
request's :class:`Upload` (:func:`call_with_body`); the patched decode
sites (``ext/binary/site_renderers.py``) call :func:`resolve_placeholder`, which
resolves only a placeholder of the request served in this context.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hmac
import secrets
from collections.abc import Callable
from typing import Any

import torch
from shm_embeds_client.wire import HEADER_LENGTH

from vllm._shm_embeds import extensions
from vllm._shm_embeds.ext.binary.common import Receive, Send
from vllm._shm_embeds.lifetime.transfer import release_streamed

_digests = extensions.require("digests", "digests")
forget = _digests.forget

PLACEHOLDER_PREFIX = "shm-embeds-binary:"


def new_token() -> str:
    """A fresh random placeholder token (128 bits, hex)."""
    return secrets.token_hex(16)


def placeholder(token: str, index: int) -> str:
    """The string that stands for tensor ``index`` of the upload with ``token``."""
    return f"{PLACEHOLDER_PREFIX}{token}.{index}"


@dataclasses.dataclass
class Upload:
    """A request's segment-backed tensors, by placeholder index.

    Attributes:
        token: the request's random placeholder token.
        tensors: tensor ``i`` stands for ``placeholder(token, i)`` (None:
            that index is not a tensor of ours).
        hash_block_tokens: rows per prefix-cache digest
            (``common.ServerContext.hash_block_tokens``), None when off.
        made: segment-backed tensors made from these while rendering (a chat
            prompt assembled from parts), released with them.
        leases: ``regions.registry.Lease`` of each registered region the request
            names; their tensors are the regions' (not released with the
            request), the leases end with it.
        errors: index -> the error vLLM's own decode raised for that payload
            (the JSON path decoded it once already): its placeholder raises
            it again where vLLM would have decoded it, so vLLM answers as
            stock without decoding the payload a second time.
        keeps: what an extension's hook does with the request's tensors while
            vLLM serves it (``binary.prefix_hooks``): headers at the response's
            start, closed before the tensors' pages go.
        turn: a chat turn of ``common.chat_hook()`` (kept parts this request names,
            its rendered prompt built and kept), also among ``keeps``; or None.
    """

    token: str
    tensors: list[torch.Tensor | None]
    hash_block_tokens: int | None = None
    made: list[torch.Tensor] = dataclasses.field(default_factory=list)
    leases: list[Any] = dataclasses.field(default_factory=list)
    errors: dict[int, BaseException] = dataclasses.field(default_factory=dict)
    keeps: list[Any] = dataclasses.field(default_factory=list)
    turn: Any = None

    def responding(self) -> None:
        """vLLM has started the response body (the request's engines hold what
        they need by then): the region leases stop counting against the
        server's cap (``Lease.settle``); they still end with the request."""
        for lease in self.leases:
            lease.settle()

    async def settle(self) -> None:
        """Wait (without blocking the event loop) until every keep's copy is done, so
        that :meth:`release` does not wait for one."""
        for keep in self.keeps:
            await keep.settled()

    def release(self) -> None:
        """The request has ended: unlink what vLLM did not take over (hop 1
        hands the rest over), let go of this process's pages of every
        tensor (``transfer.release_streamed``) and end the region leases."""
        for keep in self.keeps:
            keep.close()  # its copy done before the pages go
        self.keeps.clear()
        self.turn = None
        borrowed = {id(lease.tensor) for lease in self.leases}
        for t in [*self.tensors, *self.made]:
            if t is not None and id(t) not in borrowed:
                forget(t)  # it reads zeros from here on: no digests of other bytes
                release_streamed(t)
        for lease in self.leases:
            lease.release()
        self.tensors.clear()
        self.made.clear()
        self.leases.clear()
        self.errors.clear()


_current: contextvars.ContextVar[Upload | None] = contextvars.ContextVar(
    "shm_embeds_upload", default=None
)


def current_upload() -> Upload | None:
    """The upload of the request being served in this context, or None."""
    return _current.get()


def resolve_placeholder(data: Any) -> torch.Tensor | None:
    """The tensor a placeholder stands for in the *current* request, or None.

    Only a placeholder whose token equals that of the body being served in
    this context (set by :func:`call_with_body`) resolves; anything else (a
    JSON client's bytes, another request's token) gives None, and the caller
    takes vLLM's stock decode path.

    Raises:
        the error vLLM's decode raised for that payload (``Upload.errors``).
    """
    upload = _current.get()
    if upload is None:
        return None
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(data, str) or not data.startswith(PLACEHOLDER_PREFIX):
        return None
    token, _, index = data[len(PLACEHOLDER_PREFIX):].partition(".")
    if not hmac.compare_digest(token, upload.token) or not index.isdigit():
        return None
    i = int(index)
    if i in upload.errors:
        raise upload.errors[i]
    return upload.tensors[i] if i < len(upload.tensors) else None


DROPPED_HEADERS = {b"content-length", HEADER_LENGTH.lower().encode()}


def replay(payload: bytes, receive: Receive) -> Receive:
    """``receive`` with ``payload`` as the whole request body first (then
    ``receive`` as is: only ``http.disconnect`` once a body was read)."""
    return prefixed(payload, False, receive)


def prefixed(received: bytes, more: bool, receive: Receive) -> Receive:
    """``receive`` of a body of which ``received`` was read already: those
    bytes first (``more``: the rest follows from ``receive`` as is)."""
    sent = False

    async def rest() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": received, "more_body": more}
        return await receive()

    return rest


def _settling(send: Send, upload: Upload) -> Send:
    """``send`` that settles ``upload``'s leases at the first response body
    message: vLLM sends none before the request's first output (an error
    answer aside), so its engines hold the regions by then; and adds the
    headers of ``upload.keeps`` to the response's start."""

    async def settling_send(message: dict) -> None:
        kind = message.get("type")
        if kind == "http.response.start" and upload.keeps:
            added = [hv for keep in upload.keeps
                     for hv in await keep.response_headers(message.get("status", 0))]
            if added:
                message = dict(message, headers=[*message.get("headers", ()), *added])
        if kind == "http.response.body":
            upload.responding()
        await send(message)

    return settling_send


async def call_with_body(app: Callable, scope: dict, receive: Receive, send: Send,
                         payload: bytes, upload: Upload | None,
                         content_type: bytes | None = None) -> None:
    """Call ``app`` with ``payload`` as the whole request body (Content-Length
    set, ``content_type`` if given, the binary framing header dropped) and
    ``upload`` as this request's placeholders; after the body, ``receive`` as
    is (only ``http.disconnect`` then)."""
    drop = DROPPED_HEADERS | ({b"content-type"} if content_type else set())
    hdrs = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in drop]
    if content_type:
        hdrs.append((b"content-type", content_type))
    hdrs.append((b"content-length", str(len(payload)).encode()))
    token = _current.set(upload) if upload is not None else None
    try:
        await app(dict(scope, headers=hdrs), replay(payload, receive),
                  _settling(send, upload) if upload is not None
                  and (upload.leases or upload.keeps) else send)
    finally:
        if token is not None:
            _current.reset(token)
