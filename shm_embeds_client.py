# SPDX-License-Identifier: Apache-2.0
"""One-line client for binary ``prompt_embeds`` bodies.

A vLLM OpenAI server with the shm-embeds plugin (``VLLM_SHM_EMBEDS=1``,
``--enable-prompt-embeds``) accepts the tensor as raw bytes after the JSON
request (KServe v2 binary-data framing) instead of base64 of ``torch.save``::

    import shm_embeds_client as sec
    out = sec.complete("http://localhost:8000", "my-model", embeds, max_tokens=16)
    out = sec.chat("http://localhost:8000", "my-model", embeds, max_tokens=16)
    out = await sec.acomplete(...)   # and sec.achat(...)

``embeds`` is a ``(num_tokens, hidden_size)`` CPU tensor of float32, float16
or bfloat16 (other float dtypes are sent as float32); a list of tensors is a
batch for ``complete``. Its bytes are sent from the tensor's own memory (no
copy unless it is not contiguous). Every other keyword is the usual request
field (``max_tokens``, ``temperature``, ``logprobs``, ``n``, ``cache_salt``,
``stream``, ...). The result is the response JSON; with ``stream=True`` the
list of streamed chunk objects.

The same with ``curl`` (a 5 x 4096 float32 tensor in ``embeds.bin``, i.e.
81920 raw little-endian bytes; the JSON is 120 bytes here, count yours)::

    printf '%s' '{"model":"m","max_tokens":8,"prompt_embeds":{"datatype":"FP32",'\
    '"shape":[5,4096],"parameters":{"binary_data_size":81920}}}' > header.json
    cat header.json embeds.bin > body.bin
    curl http://localhost:8000/v1/completions \\
      -H 'Content-Type: application/octet-stream' \\
      -H "Inference-Header-Content-Length: $(stat -c %s header.json)" \\
      --data-binary @body.bin
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import torch

__all__ = ["frame", "complete", "chat", "acomplete", "achat"]

_DATATYPES = {torch.float32: "FP32", torch.float16: "FP16", torch.bfloat16: "BF16"}
_CHUNK = 1 << 20


def _wire(tensor: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The tensor as sent (CPU, contiguous, FP32/FP16/BF16) and its descriptor."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
        raise ValueError("prompt_embeds must be a 2-D torch.Tensor (num_tokens, hidden_size)")
    t = tensor.detach().cpu()
    if t.dtype not in _DATATYPES:
        if not t.is_floating_point():
            raise ValueError(f"prompt_embeds must be floating point, got {t.dtype}")
        t = t.to(torch.float32)
    t = t.contiguous()
    desc = {"datatype": _DATATYPES[t.dtype], "shape": list(t.shape),
            "parameters": {"binary_data_size": t.nbytes}}
    return t, desc


def frame(body: dict, route: str = "completions") -> tuple[dict[str, str], list, int]:
    """Frame a request whose ``prompt_embeds`` values are tensors.

    Args:
        body: the request; tensors in ``body["prompt_embeds"]`` (completions: a
            tensor or a list) or as ``data`` of ``{"type": "prompt_embeds"}``
            content parts (chat) are replaced by descriptors.
        route: ``"completions"`` or ``"chat"``.
    Returns:
        ``(headers, pieces, length)``: the body is the concatenation of
        ``pieces`` (the JSON bytes, then each tensor's bytes as a memoryview
        over the tensor's own memory), ``length`` bytes in all.
    Raises:
        ValueError: no tensor, or a tensor that is not 2-D floating point.
    """
    body = dict(body)
    tensors: list[torch.Tensor] = []

    def take(t: Any) -> dict:
        wire, desc = _wire(t)
        tensors.append(wire)
        return desc

    if route == "completions":
        pe = body.get("prompt_embeds")
        body["prompt_embeds"] = [take(t) for t in pe] if isinstance(pe, (list, tuple)) else take(pe)
    else:
        messages = []
        for msg in body.get("messages", []):
            msg = dict(msg)
            if isinstance(msg.get("content"), list):
                msg["content"] = [
                    dict(p, data=take(p["data"])) if isinstance(p, dict)
                    and p.get("type") == "prompt_embeds" else p
                    for p in msg["content"]]
            messages.append(msg)
        body["messages"] = messages
    if not tensors:
        raise ValueError("no prompt_embeds tensor in the request")
    header = json.dumps(body).encode()
    pieces: list = [header]
    for t in tensors:
        if t.nbytes:
            pieces.append(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
    length = len(header) + sum(t.nbytes for t in tensors)
    headers = {"Content-Type": "application/octet-stream",
               "Inference-Header-Content-Length": str(len(header)),
               "Content-Length": str(length)}
    return headers, pieces, length


def _chunks(pieces: list) -> Iterator[memoryview | bytes]:
    for p in pieces:
        for i in range(0, len(p), _CHUNK):
            yield p[i : i + _CHUNK]


async def _achunks(pieces: list):
    for c in _chunks(pieces):
        yield c


def _url(url: str, route: str) -> str:
    base = url.rstrip("/").removesuffix("/v1")
    return f"{base}/v1/{'completions' if route == 'completions' else 'chat/completions'}"


def _request(route: str, model: str, tensor: Any, kwargs: dict) -> dict:
    body = {"model": model, **kwargs}
    if route == "completions":
        body.setdefault("prompt", "")
        body["prompt_embeds"] = tensor
    elif "messages" not in body:
        body["messages"] = [{"role": "user",
                             "content": [{"type": "prompt_embeds", "data": tensor}]}]
    return body


def _result(r: httpx.Response, stream: bool) -> Any:
    if r.status_code >= 400:
        raise httpx.HTTPStatusError(f"{r.status_code}: {r.text[:2000]}", request=r.request,
                                    response=r)
    if not stream:
        return r.json()
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _send(route, url, model, tensor, timeout, headers, kwargs):
    h, pieces, _ = frame(_request(route, model, tensor, kwargs), route)
    h.update(headers or {})
    with httpx.Client(timeout=timeout) as c:
        r = c.post(_url(url, route), content=_chunks(pieces), headers=h)
    return _result(r, bool(kwargs.get("stream")))


async def _asend(route, url, model, tensor, timeout, headers, kwargs):
    h, pieces, _ = frame(_request(route, model, tensor, kwargs), route)
    h.update(headers or {})
    async with httpx.AsyncClient(timeout=timeout) as c:
        r = await c.post(_url(url, route), content=_achunks(pieces), headers=h)
    return _result(r, bool(kwargs.get("stream")))


def complete(url: str, model: str, tensor: Any, *, timeout: float | None = 600,
             headers: dict | None = None, **completion_args: Any) -> Any:
    """``POST /v1/completions`` with ``prompt_embeds`` as a binary body.

    Args:
        url: server base URL (``http://host:port``, ``/v1`` optional).
        tensor: ``(T, H)`` tensor, or a list of them (one choice set per prompt).
        completion_args: the usual fields (``max_tokens``, ``temperature``, ...).
    Returns:
        the response JSON (a dict), or with ``stream=True`` the list of chunks.
    Raises:
        httpx.HTTPStatusError: a 4xx/5xx, with vLLM's error message.
    """
    return _send("completions", url, model, tensor, timeout, headers, completion_args)


def chat(url: str, model: str, tensor: Any = None, *, timeout: float | None = 600,
         headers: dict | None = None, **chat_args: Any) -> Any:
    """``POST /v1/chat/completions`` with ``prompt_embeds`` content parts as binary.

    Without ``messages``, sends one user message whose content is ``tensor``;
    with ``messages``, each ``{"type": "prompt_embeds", "data": <tensor>}``
    part is sent binary (``tensor`` is then ignored). Same returns and errors
    as :func:`complete`.
    """
    return _send("chat", url, model, tensor, timeout, headers, chat_args)


async def acomplete(url: str, model: str, tensor: Any, *, timeout: float | None = 600,
                    headers: dict | None = None, **completion_args: Any) -> Any:
    """Async :func:`complete`."""
    return await _asend("completions", url, model, tensor, timeout, headers,
                        completion_args)


async def achat(url: str, model: str, tensor: Any = None, *, timeout: float | None = 600,
                headers: dict | None = None, **chat_args: Any) -> Any:
    """Async :func:`chat`."""
    return await _asend("chat", url, model, tensor, timeout, headers, chat_args)
