# SPDX-License-Identifier: Apache-2.0
"""What every body path of the API server shares: routes, errors, the served model.

* :func:`route`: the two routes whose bodies carry ``prompt_embeds``.
* :class:`ServerContext`: what a body is checked against (vLLM's
  ``VllmConfig`` of the served model).
* :func:`embeds_slots`: the one walk over where vLLM reads ``prompt_embeds``
  in a request body.
* :func:`send_error`, :func:`headers`, :func:`content_type`: answering and
  reading a request in vLLM's shape.

A request's tensors by placeholder are ``placeholders.py``; the limits on
untrusted bodies (timeouts, deadlines, bytes in flight) ``body_limits.py``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import torch
from starlette.datastructures import Headers
from vllm.logger import init_logger

from vllm._shm_embeds import extensions
from vllm._shm_embeds.ext.binary.settings import binary_max_bytes

_digests = extensions.require("digests", "digests")
block_tokens_of = _digests.block_tokens_of
logger = init_logger(__name__)

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ROUTES = (COMPLETIONS, CHAT)


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
            (``settings.binary_max_bytes``).
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
        global _api_servers
        count = getattr(getattr(config, "parallel_config", None), "_api_process_count", 1)
        _api_servers = count if type(count) is int and count > 0 else 1
        return cls.from_model_config(
            config.model_config, block_tokens_of(getattr(config, "cache_config", None)))

    @classmethod
    def of_app(cls, scope: dict) -> ServerContext | None:
        """The context of the app serving ``scope`` (``app.state.vllm_config``)."""
        config = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
        return None if getattr(config, "model_config", None) is None else \
            cls.from_vllm_config(config)


_api_servers = 1


def api_servers() -> int:
    """How many API servers this ``vllm serve`` runs (``--api-server-count``; DP starts
    one per rank): vLLM's ``parallel_config._api_process_count`` (set by
    vllm/entrypoints/launchers/api_server/entry.py, 0.32) as this process's last
    served config said; 1 before any."""
    return _api_servers


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


_LOADED: dict[str, list[Any]] = {}
_PREFIX_HOOKS: dict[str, Any] | None = None


def _hooks_of(registry: str) -> list[Any]:
    """The hooks the loaded extensions provide to ``registry`` (entries
    ``{"target": "<module>:<attr>"}``), imported once; one that fails to load is
    left out (and logged)."""
    if registry not in _LOADED:
        hooks = []
        for ext, entry in extensions.provided(registry):
            module, _, attr = entry["target"].partition(":")
            try:
                hooks.append(getattr(importlib.import_module(
                    f"{extensions.package_of(ext)}.{module}"), attr))
            except Exception:
                logger.warning("shm-embeds: extension %s's %s hook not loaded", ext,
                               registry, exc_info=True)
        _LOADED[registry] = hooks
    return _LOADED[registry]


def prefix_hooks() -> dict[str, Any]:
    """Descriptor parameter -> the hook of the extension that provides it
    (``binary_prefixes`` entries: ``{"target": "<module>:<attr>"}``), for every
    body format. A hook has ``parameter``; ``resolve(value, body, dtype, hidden)``
    (the kept rows a tensor starts with: ``.rows``, ``.row_bytes``, then after
    ``await .ready()`` or ``.wait()`` ``.tensor`` and ``.digests``; ``.release()``;
    raises ``gate.Refused``); ``assemble(prefix, new, block_tokens)``
    (the whole tensor, in a segment, digests attached); optionally ``open_sink(prefix,
    dtype, shape, keeping)`` (a sink for the whole tensor, or None); and ``keep_request(headers,
    path, body, ntensors)`` (None, or ``.start(tensor)``, then ``async settled()`` (its
    work on the tensor's bytes done), ``async response_headers(status)``,
    ``.close()``). One that fails to load is left out (its parameter is then refused)."""
    global _PREFIX_HOOKS
    if _PREFIX_HOOKS is None:
        _PREFIX_HOOKS = {hook.parameter: hook for hook in _hooks_of("binary_prefixes")}
    return _PREFIX_HOOKS


def chat_hook() -> Any:
    """The hook of the extension that provides ``chat_turns`` (conversations), or None:
    ``chat_turn(headers, path, body, dtype, hidden, new_rows, max_rows)`` (``new_rows``:
    at most the rows of the body's own parts) -> None or a turn with ``async
    ready()``/``wait()``, ``part(data)``, ``build(token_ids, tensors, positions)``,
    ``async hash(tensor, block)``, ``rendered(prompt)`` and the keep interface of
    :func:`prefix_hooks` (``response_headers``, ``settled``, ``close``); raises
    ``gate.Refused``. Parts it names are strings ``wire.PART...`` in a part's ``data``."""
    hooks = _hooks_of("chat_turns")
    return hooks[0] if hooks else None
