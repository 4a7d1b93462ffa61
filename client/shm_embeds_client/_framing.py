# SPDX-License-Identifier: Apache-2.0
"""Request bodies shared by the sync (``http.py``) and async (``aio.py``)
clients: a binary body framed from tensors (:func:`frame`), or a plain JSON
body of :class:`~shm_embeds_client.regions.Region` references. torch only.

A :class:`Continuation` in place of a completions tensor sends only the rows
after a kept prefix (``docs/conversations.md``; ``conversation.py`` keeps the
history and the id)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from shm_embeds_client._tensors import _bytes_of, _wire
from shm_embeds_client.regions import Region
from shm_embeds_client.wire import CONTENT_TYPE, HEADER_LENGTH, JSON_CONTENT_TYPE, PART, PREFIX

_CHUNK = 1 << 20


@dataclass(frozen=True, eq=False)
class Continuation:
    """The rows of a completions request's ``prompt_embeds`` that follow a kept
    prefix: the server serves the kept rows (``prefix``, the id a response's
    ``Shm-Embeds-Kept`` header gave) then ``rows`` as the whole tensor.

    Accepted by :func:`frame` (and ``complete``/``acomplete``) wherever a
    completions tensor is, as the request's only tensor. Its descriptor's
    ``shape`` is the whole tensor's (``prefix_rows`` + ``rows``) and its
    ``binary_data_size`` the bytes of ``rows`` only, with
    ``parameters["shm_embeds_prefix"] = prefix``: a server that does not read
    that parameter refuses the sizes (400), never serves ``rows`` alone. The
    request must carry the ``cache_salt`` of the request that was kept (or none).
    """

    prefix: str
    rows: torch.Tensor = field(repr=False)
    prefix_rows: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix:
            raise ValueError("Continuation.prefix must be a non-empty kept id (str)")
        if not isinstance(self.prefix_rows, int) or self.prefix_rows < 1:
            raise ValueError("Continuation.prefix_rows must be the kept rows' count (>= 1)")


@dataclass(frozen=True)
class KeptPart:
    """Embeds part ``index`` (0-based, in document order) of a chat request the server
    kept (``kept_id``: its ``Shm-Embeds-Kept`` header), in place of a chat part's tensor:
    sent as the string :attr:`ref` (``docs/conversations.md``; stock vLLM refuses it)."""

    kept_id: str
    index: int

    def __post_init__(self) -> None:
        if not isinstance(self.kept_id, str) or not self.kept_id:
            raise ValueError("KeptPart.kept_id must be a non-empty kept id (str)")
        if not isinstance(self.index, int) or self.index < 0:
            raise ValueError("KeptPart.index must be an int >= 0")

    @property
    def ref(self) -> str:
        return f"{PART}{self.kept_id}.{self.index}"


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
        ValueError: no tensor, or a tensor that is not 2-D floating point; a
            :class:`Continuation` in a chat request or beside another tensor.
    """
    tensors: list[torch.Tensor] = []
    continued, refs = False, 0

    def take(t: Any) -> Any:
        nonlocal continued, refs
        if isinstance(t, KeptPart) and route == "chat":
            refs += 1
            return t.ref
        if isinstance(t, Continuation):
            if route != "completions":
                raise ValueError("a Continuation (rows after a kept prefix) is for "
                                 "/v1/completions only")
            wire, desc = _wire(t.rows)
            desc["shape"][0] += t.prefix_rows
            desc["parameters"][PREFIX] = t.prefix
            continued = True
        else:
            wire, desc = _wire(t)
        tensors.append(wire)
        return desc

    body = _map_embeds(body, route, take)
    if not tensors and not refs:
        raise ValueError("no prompt_embeds tensor in the request")
    if continued and len(tensors) > 1:
        raise ValueError("a Continuation must be the request's only prompt_embeds tensor")
    header = json.dumps(body).encode()
    pieces: list = [header]
    for t in tensors:
        if t.nbytes:
            pieces.append(_bytes_of(t))
    length = len(header) + sum(t.nbytes for t in tensors)
    headers = {"Content-Type": CONTENT_TYPE,
               HEADER_LENGTH: str(len(header)),
               "Content-Length": str(length)}
    return headers, pieces, length


def _map_embeds(body: dict, route: str, fn: Callable[[Any], Any]) -> dict:
    """A copy of ``body`` with each ``prompt_embeds`` value ``v`` replaced by
    ``fn(v)``, in body order. Completions: the ``prompt_embeds`` field, or each
    item of a list (or tuple) of them; chat: the ``data`` of each
    ``{"type": "prompt_embeds"}`` content part. ``body`` is not changed."""
    body = dict(body)
    if route == "completions":
        pe = body.get("prompt_embeds")
        body["prompt_embeds"] = [fn(t) for t in pe] if isinstance(pe, (list, tuple)) else fn(pe)
    else:
        messages = []
        for msg in body.get("messages", []):
            msg = dict(msg)
            if isinstance(msg.get("content"), list):
                msg["content"] = [
                    dict(p, data=fn(p["data"])) if isinstance(p, dict)
                    and p.get("type") == "prompt_embeds" else p
                    for p in msg["content"]]
            messages.append(msg)
        body["messages"] = messages
    return body


def _region_body(body: dict, route: str) -> dict | None:
    """``body`` with each :class:`Region` replaced by its reference
    (:meth:`Region.to_json`), or None if no ``prompt_embeds`` value is a Region.

    Raises:
        ValueError: some values are Regions and others are not (tensors go
            in a binary body, references in a JSON one: send them apart).
    """
    values: list[Any] = []
    _map_embeds(body, route, values.append)
    regions = sum(isinstance(v, Region) for v in values)
    if not regions:
        return None
    if regions != len(values):
        raise ValueError("prompt_embeds mixes Region references and tensors in one request; "
                         "send them in separate requests (or register every tensor)")
    return _map_embeds(body, route, Region.to_json)


def _chunks(pieces: list) -> Iterator[memoryview | bytes]:
    for p in pieces:
        for i in range(0, len(p), _CHUNK):
            yield p[i : i + _CHUNK]


async def _achunks(pieces: list):
    for c in _chunks(pieces):
        yield c


def _request(route: str, model: str, tensor: Any, kwargs: dict) -> dict:
    body = {"model": model, **kwargs}
    if route == "completions":
        # No "prompt": vLLM would answer an empty text prompt as one more choice.
        body["prompt_embeds"] = tensor
    elif "messages" not in body:
        body["messages"] = [{"role": "user",
                             "content": [{"type": "prompt_embeds", "data": tensor}]}]
    return body


def _body(route: str, model: str, tensor: Any, kwargs: dict, headers: dict | None,
          is_async: bool) -> tuple[dict[str, str], Any]:
    """Headers and content of the request: a plain JSON body if its
    ``prompt_embeds`` are :class:`Region` references, else a binary body."""
    body = _request(route, model, tensor, kwargs)
    refs = _region_body(body, route)
    if refs is not None:
        content: Any = json.dumps(refs).encode()
        h = {"Content-Type": JSON_CONTENT_TYPE, "Content-Length": str(len(content))}
    else:
        h, pieces, _ = frame(body, route)
        content = _achunks(pieces) if is_async else _chunks(pieces)
    h.update(headers or {})
    return h, content

