# SPDX-License-Identifier: Apache-2.0
"""Asynchronous client: :func:`acomplete` and :func:`achat` over ``httpx``
(the same requests as ``http.py``'s, the body streamed from an async iterator)."""

from __future__ import annotations

from typing import Any

import httpx

from shm_embeds_client._framing import _body
from shm_embeds_client.http import _result, _url

__all__ = ["achat", "acomplete"]


async def _asend(route, url, model, tensor, timeout, headers, kwargs):
    h, content = _body(route, model, tensor, kwargs, headers, True)
    async with httpx.AsyncClient(timeout=timeout) as c:
        r = await c.post(_url(url, route), content=content, headers=h)
    return _result(r, bool(kwargs.get("stream")))


async def acomplete(url: str, model: str, tensor: Any, *, timeout: float | None = 600,
                    headers: dict | None = None, **completion_args: Any) -> Any:
    """Async :func:`complete`."""
    return await _asend("completions", url, model, tensor, timeout, headers,
                        completion_args)


async def achat(url: str, model: str, tensor: Any = None, *, timeout: float | None = 600,
                headers: dict | None = None, **chat_args: Any) -> Any:
    """Async :func:`chat`."""
    return await _asend("chat", url, model, tensor, timeout, headers, chat_args)

