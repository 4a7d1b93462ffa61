# SPDX-License-Identifier: Apache-2.0
"""Synchronous client: :func:`complete` and :func:`chat` over ``httpx``.

``prompt_embeds`` go as a binary body (KServe v2 binary-data framing), or as
region references in a plain JSON body (``regions.py``); or, with
:func:`complete_openai_json` and :func:`chat_openai_json`, as the OpenAI JSON
body any vLLM server reads (base64 of ``torch.save``, ``openai_json.py``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from shm_embeds_client._framing import _body, _chunks
from shm_embeds_client.openai_json import openai_json_request
from shm_embeds_client.pool import default_client

__all__ = ["chat", "chat_openai_json", "complete", "complete_openai_json"]


def _url(url: str, route: str) -> str:
    base = url.rstrip("/").removesuffix("/v1")
    return f"{base}/v1/{'completions' if route == 'completions' else 'chat/completions'}"


def _result(r: httpx.Response, stream: bool) -> Any:
    if r.status_code >= 400:
        raise httpx.HTTPStatusError(f"{r.status_code}: {r.text[:2000]}", request=r.request,
                                    response=r)
    if not stream:
        return r.json()
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _post(route: str, url: str, model: str, tensor: Any, timeout: float | None,
          headers: dict | None, kwargs: dict,
          client: httpx.Client | None = None) -> httpx.Response:
    """The response to the request, whatever its status (read whole, not
    streamed): through ``client`` if given, else the process's shared one
    (``pool.default_client``; connections reused)."""
    h, content = _body(route, model, tensor, kwargs, headers, False)
    return (client or default_client()).post(_url(url, route), content=content, headers=h,
                                             timeout=timeout)


def _send(route, url, model, tensor, timeout, headers, kwargs):
    r = _post(route, url, model, tensor, timeout, headers, kwargs)
    return _result(r, bool(kwargs.get("stream")))


def complete(url: str, model: str, tensor: Any, *, timeout: float | None = 600,
             headers: dict | None = None, **completion_args: Any) -> Any:
    """``POST /v1/completions`` with ``prompt_embeds`` as a binary body, or as
    references to registered regions in a plain JSON body.

    Args:
        url: server base URL (``http://host:port``, ``/v1`` optional).
        tensor: ``(T, H)`` tensor, or a list of them (one choice set per
            prompt); or a :class:`Region`, or a list of Regions (sent as
            references, ``application/json``; no tensor byte is sent); or a
            :class:`~shm_embeds_client._framing.Continuation` (the rows after
            a kept prefix; ``conversation.py`` does the bookkeeping).
        completion_args: the usual fields (``max_tokens``, ``temperature``, ...).
    Returns:
        the response JSON (a dict), or with ``stream=True`` the list of chunks.
    Raises:
        ValueError: no tensor, a tensor that is not 2-D floating point, or
            Regions mixed with tensors in one request.
        httpx.HTTPStatusError: a 4xx/5xx, with vLLM's error message (e.g. 400
            for a region that is not registered, or whose producer died).
    """
    return _send("completions", url, model, tensor, timeout, headers, completion_args)


def chat(url: str, model: str, tensor: Any = None, *, timeout: float | None = 600,
         headers: dict | None = None, **chat_args: Any) -> Any:
    """``POST /v1/chat/completions`` with ``prompt_embeds`` content parts as binary.

    Without ``messages``, sends one user message whose content is ``tensor``;
    with ``messages``, each ``{"type": "prompt_embeds", "data": <tensor>}``
    part is sent binary (``tensor`` is then ignored). If every such value is a
    :class:`Region`, the request is plain JSON with the references instead.
    Same returns and errors as :func:`complete`.
    """
    return _send("chat", url, model, tensor, timeout, headers, chat_args)



def _send_openai_json(route, url, model, tensor, timeout, headers, kwargs):
    h, body = openai_json_request(route, model, tensor, kwargs, headers)
    r = default_client().post(_url(url, route), content=_chunks([memoryview(body)]),
                              headers=h, timeout=timeout)  # the body's own memory, in 1 MiB views
    return _result(r, bool(kwargs.get("stream")))


def complete_openai_json(url: str, model: str, tensor: Any, *, timeout: float | None = 600,
                         headers: dict | None = None, **completion_args: Any) -> Any:
    """``POST /v1/completions`` with ``prompt_embeds`` in the OpenAI JSON wire
    format (base64 of ``torch.save``), for a server without the plugin or a
    path that must stay JSON; the body from
    :func:`~shm_embeds_client.openai_json.openai_json_body` (each byte written
    once), sent from its own memory.

    Args:
        url: server base URL (``http://host:port``, ``/v1`` optional).
        tensor: ``(num_tokens, hidden_size)`` CPU tensor of float32, float16
            or bfloat16, contiguous or not; or a list of them.
        completion_args: the usual fields (``max_tokens``, ``temperature``, ...).
    Returns:
        the response JSON (a dict), or with ``stream=True`` the list of chunks.
    Raises:
        TypeError, ValueError: as ``openai_json_body`` (not a tensor; not
            CPU, not 2-D, or another dtype).
        httpx.HTTPStatusError: a 4xx/5xx, with vLLM's error message.
    """
    return _send_openai_json("completions", url, model, tensor, timeout, headers,
                             completion_args)


def chat_openai_json(url: str, model: str, tensor: Any = None, *,
                     timeout: float | None = 600, headers: dict | None = None,
                     **chat_args: Any) -> Any:
    """``POST /v1/chat/completions`` with ``prompt_embeds`` content parts in the
    OpenAI JSON wire format (``{"type": "prompt_embeds", "data": <base64>}``).

    Without ``messages``, one user message whose content is ``tensor``; with
    ``messages``, each ``{"type": "prompt_embeds", "data": <tensor>}`` part's
    tensor is encoded. Same returns and errors as :func:`complete_openai_json`.
    """
    return _send_openai_json("chat", url, model, tensor, timeout, headers, chat_args)
