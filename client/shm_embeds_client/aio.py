# SPDX-License-Identifier: Apache-2.0
"""Asynchronous client: :func:`acomplete` and :func:`achat` over ``httpx``
(the same requests as ``http.py``'s, the body streamed from an async iterator)."""

from __future__ import annotations

from typing import Any

import httpx

from shm_embeds_client._framing import _achunks, _body
from shm_embeds_client.http import _result, _url
from shm_embeds_client.openai_json import openai_json_request
from shm_embeds_client.pool import default_async_client

__all__ = ["achat", "achat_openai_json", "acomplete", "acomplete_openai_json"]


async def _apost(route: str, url: str, model: str, tensor: Any, timeout: float | None,
                 headers: dict | None, kwargs: dict,
                 client: httpx.AsyncClient | None = None) -> httpx.Response:
    """Async :func:`~shm_embeds_client.http._post`: the response, whatever its status
    (through ``client``, else the loop's shared one, ``pool.default_async_client``)."""
    h, content = _body(route, model, tensor, kwargs, headers, True)
    return await (client or default_async_client()).post(
        _url(url, route), content=content, headers=h, timeout=timeout)


async def _asend(route, url, model, tensor, timeout, headers, kwargs):
    r = await _apost(route, url, model, tensor, timeout, headers, kwargs)
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



async def _asend_openai_json(route, url, model, tensor, timeout, headers, kwargs):
    h, body = openai_json_request(route, model, tensor, kwargs, headers)
    r = await default_async_client().post(_url(url, route), content=_achunks([memoryview(body)]),
                                          headers=h, timeout=timeout)
    return _result(r, bool(kwargs.get("stream")))


async def acomplete_openai_json(url: str, model: str, tensor: Any, *,
                                timeout: float | None = 600, headers: dict | None = None,
                                **completion_args: Any) -> Any:
    """Async :func:`~shm_embeds_client.http.complete_openai_json`."""
    return await _asend_openai_json("completions", url, model, tensor, timeout, headers,
                                    completion_args)


async def achat_openai_json(url: str, model: str, tensor: Any = None, *,
                            timeout: float | None = 600, headers: dict | None = None,
                            **chat_args: Any) -> Any:
    """Async :func:`~shm_embeds_client.http.chat_openai_json`."""
    return await _asend_openai_json("chat", url, model, tensor, timeout, headers, chat_args)
