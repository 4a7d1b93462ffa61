# SPDX-License-Identifier: Apache-2.0
"""What the binary and the JSON body paths share in the API server.

* :func:`route`: the two routes whose bodies carry ``prompt_embeds``.
* :class:`ServerContext`: what a body is checked against (vLLM's
  ``VllmConfig`` of the served model).
* :func:`embeds_slots`: the one walk over where vLLM reads ``prompt_embeds``
  in a request body.
* :class:`Upload` and :func:`resolve_placeholder`: a request's tensors, by
  placeholder strings that resolve only in that request's context (the
  patched decode sites, ``sites/renderers.py``, call it).
* :func:`call_with_body`: hand the stock app a replacement body.
* :func:`byte_count`, :func:`receive_body_message` (per-receive timeout and
  overall deadline), :class:`InFlight` (declared bytes the body paths take
  at once): the limits on untrusted bodies (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import hmac
import json
import re
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import torch
from starlette.datastructures import Headers

from vllm._shm_embeds.config import (
    binary_max_bytes,
    body_deadline_s,
    body_timeout_s,
    inflight_bytes,
)
from vllm._shm_embeds.digests import block_tokens_of, forget
from vllm._shm_embeds.transfer import release_streamed

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ROUTES = (COMPLETIONS, CHAT)
PLACEHOLDER_PREFIX = "shm-embeds-binary:"


def route(scope: dict) -> str | None:
    """``/v1/completions`` or ``/v1/chat/completions`` for a POST there, else None
    (``root_path`` stripped)."""
    if scope.get("type") != "http" or scope.get("method") != "POST":
        return None
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or path
    return path if path in ROUTES else None


_BYTE_COUNT = re.compile(r"[0-9]{1,19}")  # ASCII digits only ("²".isdigit() is True)


def byte_count(value: str | None) -> int | None:
    """A header value that is a byte count (ASCII digits, surrounding spaces
    allowed, below 10**19), as an int; None if absent or anything else."""
    if value is None:
        return None
    value = value.strip(" \t")
    return int(value) if _BYTE_COUNT.fullmatch(value) else None


class Stalled(Exception):
    """The client sent no body bytes for ``VLLM_SHM_EMBEDS_BODY_TIMEOUT_S`` seconds,
    or the body took longer in all than :func:`deadline_for` allows."""


def deadline_for(nbytes: int) -> float:
    """The ``time.monotonic()`` by which a body of ``nbytes`` must have arrived
    (``config.body_deadline_s``: timeout plus size over the minimum rate)."""
    return time.monotonic() + body_deadline_s(nbytes)


async def receive_body_message(receive: Receive, deadline: float | None = None) -> dict:
    """The next ASGI message of a request body, waiting at most
    ``VLLM_SHM_EMBEDS_BODY_TIMEOUT_S`` seconds, and never past ``deadline``
    (``time.monotonic()``; :func:`deadline_for`).

    Raises:
        Stalled: nothing came in time, or the deadline passed (the caller
            answers 408 and frees what the body held).
    """
    timeout = body_timeout_s()
    slow = False
    if deadline is not None:
        left = deadline - time.monotonic()
        if left < timeout:
            timeout, slow = max(0.0, left), True
    try:
        return await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        if slow:
            raise Stalled("the request body arrived slower than the server's minimum "
                          "rate") from None
        raise Stalled(f"no request body bytes for {timeout:g} s") from None


class InFlight:
    """Declared bytes of the bodies the body paths are taking now (this process).

    :meth:`take` admits a body if the total stays within
    ``VLLM_SHM_EMBEDS_INFLIGHT_BYTES``; the caller sends a body not admitted
    the stock way and calls :meth:`give_back` for one admitted when it is
    done with it. Thread-safe; only ever touched on the event loop in practice.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.bytes + nbytes > inflight_bytes():
                return False
            self.bytes += nbytes
            return True

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self.bytes -= nbytes


IN_FLIGHT = InFlight()


async def send_error(send: Send, status: int, message: str, err_type: str) -> None:
    """An error response in vLLM's shape (``ErrorResponse``,
    ``vllm/entrypoints/serve/engine/protocol.py``); the connection closes."""
    payload = json.dumps({"error": {"message": message, "type": err_type,
                                    "param": "prompt_embeds", "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def headers(scope: dict) -> Headers:
    """The request's headers (starlette's case-insensitive view of the scope)."""
    return Headers(scope=scope)


def content_type(h: Headers) -> bytes | None:
    """The media type of ``Content-Type`` without parameters, lower case."""
    value = h.get("content-type")
    return value.split(";", 1)[0].strip().lower().encode() if value is not None else None


@dataclasses.dataclass(frozen=True)
class ServerContext:
    """The served model, as the body paths need it (vLLM's ``VllmConfig``).

    Attributes:
        hidden_size: ``model_config.get_hidden_size()``.
        max_model_len: tokens; ``--max-model-len``.
        dtype: the model dtype; tensors of another datatype are cast to it.
        enable_prompt_embeds: ``--enable-prompt-embeds``.
        max_body_bytes: bytes; cap on the tensors of one binary body
            (``VLLM_SHM_EMBEDS_BINARY_MAX_BYTES``).
        hash_block_tokens: rows per prefix-cache digest
            (``cache_config.hash_block_size``, else ``block_size``), or None
            when prefix caching is off (nothing to hash).
        model_config: vLLM's ``ModelConfig`` (for ``safe_load_prompt_embeds``).
    """

    hidden_size: int
    max_model_len: int
    dtype: torch.dtype
    enable_prompt_embeds: bool
    max_body_bytes: int
    hash_block_tokens: int | None = None
    model_config: Any = None

    @classmethod
    def from_model_config(cls, model_config: Any,
                          hash_block_tokens: int | None = None) -> ServerContext:
        hidden = int(model_config.get_hidden_size())
        max_len = int(model_config.max_model_len)
        return cls(hidden, max_len, model_config.dtype,
                   bool(model_config.enable_prompt_embeds),
                   binary_max_bytes(max_len, hidden), hash_block_tokens, model_config)

    @classmethod
    def from_vllm_config(cls, config: Any) -> ServerContext:
        return cls.from_model_config(
            config.model_config, block_tokens_of(getattr(config, "cache_config", None)))

    @classmethod
    def of_app(cls, scope: dict) -> ServerContext | None:
        """The context of the app serving ``scope`` (``app.state.vllm_config``)."""
        config = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
        return None if getattr(config, "model_config", None) is None else \
            cls.from_vllm_config(config)


def embeds_slots(route: str, body: Any) -> Iterator[tuple[str, Any, Any]]:
    """Where vLLM reads ``prompt_embeds`` in ``body``: ``(where, container, key)``,
    in document order, so that ``container[key]`` is the value.

    Completions: the ``prompt_embeds`` field (when present and not null), or
    each item of it when it is a list. Chat: the ``data`` of every content
    part of ``"type": "prompt_embeds"``. ``where`` names the value for
    error messages (e.g. ``messages[0].content[1].data``).
    """
    if not isinstance(body, dict):
        return
    if route == COMPLETIONS:
        value = body.get("prompt_embeds")
        if isinstance(value, list):
            for i in range(len(value)):
                yield f"prompt_embeds[{i}]", value, i
        elif value is not None:
            yield "prompt_embeds", body, "prompt_embeds"
        return
    messages = body.get("messages")
    for i, msg in enumerate(messages if isinstance(messages, list) else ()):
        content = msg.get("content") if isinstance(msg, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "prompt_embeds":
                yield f"messages[{i}].content[{j}].data", part, "data"


# --------------------------------------------------------------------------
# placeholders: a request's tensors, resolved only in that request's context


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
            (:attr:`ServerContext.hash_block_tokens`), None when off.
        made: segment-backed tensors made from these while rendering (a chat
            prompt assembled from parts), released with them.
        leases: ``regions.Lease`` of each registered region the request
            names; their tensors are the regions' (not released with the
            request), the leases end with it.
    """

    token: str
    tensors: list[torch.Tensor | None]
    hash_block_tokens: int | None = None
    made: list[torch.Tensor] = dataclasses.field(default_factory=list)
    leases: list[Any] = dataclasses.field(default_factory=list)

    def release(self) -> None:
        """The request has ended: unlink what vLLM did not take over (hop 1
        hands the rest over), let go of this process's pages of every
        tensor (``transfer.release_streamed``) and end the region leases."""
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
    return upload.tensors[i] if i < len(upload.tensors) else None


DROPPED_HEADERS = {b"content-length", b"inference-header-content-length"}


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
    sent = False

    async def receive_body() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        return await receive()

    token = _current.set(upload) if upload is not None else None
    try:
        await app(dict(scope, headers=hdrs), receive_body, send)
    finally:
        if token is not None:
            _current.reset(token)
