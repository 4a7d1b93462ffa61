# SPDX-License-Identifier: Apache-2.0
"""A chat whose ``prompt_embeds`` parts the server keeps: :class:`ChatConversation`.

Each turn is a ``POST /v1/chat/completions`` with ``Shm-Embeds-Keep``; the answer's
``Shm-Embeds-Kept`` id names that request's embeds parts, and the next turn sends them
as :class:`~shm_embeds_client._framing.KeptPart` references (``wire.PART`` strings)
and only its new parts as data. A ``PrefixNotFound`` (404: expired, evicted, another
API server's, a restart) costs one whole resend. ``docs/conversations.md``, "Chat".
"""

from __future__ import annotations

from typing import Any

import httpx
import torch

from shm_embeds_client._framing import KeptPart
from shm_embeds_client.conversation import _kept, _seconds, prefix_missing
from shm_embeds_client.http import _post, _result, _url
from shm_embeds_client.openai_json import openai_json_request
from shm_embeds_client.pool import default_client
from shm_embeds_client.wire import KEEP_HEADER


def _parts(content: Any) -> list:
    """A message's content as a list of parts: a tensor is one embeds part, a str
    one text part; a list may mix them (and part dicts, sent as they are)."""
    items = content if isinstance(content, list) else [content]
    out = []
    for item in items:
        if isinstance(item, torch.Tensor):
            out.append({"type": "prompt_embeds", "data": item})
        elif isinstance(item, str):
            out.append({"type": "text", "text": item})
        elif isinstance(item, dict):
            out.append(item)
        else:
            raise TypeError(f"a content part is a tensor, a str or a dict, not {type(item)}")
    return out


class ChatConversation:
    """A chat over ``/v1/chat/completions`` (sync, ``httpx``) that sends each
    turn's new embeds parts only.

    Args:
        url, model, ttl_s, cache_salt, timeout, headers: as
            :class:`~shm_embeds_client.conversation.Conversation`.
        client: an ``httpx.Client`` to send through (default: the process's shared one).
        body: ``"json"`` (base64 parts) or ``"binary"`` (binary bodies).
    Attributes:
        messages: the history (parts' tensors as given, replies as text).
        kept_id: the id of the last turn's kept parts, or None.
        misses: whole resends after ``PrefixNotFound``; ``last_sent_rows``: embeds
            rows the last call sent as data.
    """

    def __init__(self, url: str, model: str, *, ttl_s: float = 600,
                 cache_salt: str | None = None, timeout: float | None = 600,
                 headers: dict | None = None, client: httpx.Client | None = None,
                 body: str = "json") -> None:
        if body not in ("json", "binary"):
            raise ValueError(f"body must be 'json' or 'binary', got {body!r}")
        self.url, self.model, self.ttl_s, self.cache_salt = url, model, ttl_s, cache_salt
        self.timeout, self.headers, self.client, self.body = timeout, dict(headers or {}), \
            client, body
        self.messages: list[dict] = []
        self.kept_id: str | None = None
        self._kept_parts = 0
        self.misses = self.last_sent_rows = 0

    def send(self, content: Any, *, role: str = "user", **chat_args: Any) -> Any:
        """Append a ``role`` message of ``content`` (a tensor, a str, or a list of
        them) and post the whole conversation; the reply is appended as the
        assistant's message. Returns the response JSON. Raises ValueError
        (``messages``, ``cache_salt`` or ``stream`` in ``chat_args``),
        ``httpx.HTTPStatusError`` (a 4xx/5xx other than one ``PrefixNotFound``;
        the history is then unchanged)."""
        for key in ("messages", "cache_salt", "stream"):
            if key in chat_args:
                raise ValueError(f"{key} is the conversation's own")
        messages = [*self.messages, {"role": role, "content": _parts(content)}]
        args = dict(chat_args)
        if self.cache_salt is not None:
            args["cache_salt"] = self.cache_salt
        r = None
        if self.kept_id is not None:
            r = self._post(self._referenced(messages), args)
            if prefix_missing(r):
                self.misses += 1
                self.kept_id, r = None, None
        if r is None:
            r = self._post(messages, args)
        out = _result(r, False)
        reply = out["choices"][0]["message"].get("content") or ""
        self.messages = [*messages, {"role": "assistant", "content": reply}]
        self.kept_id = _kept(r)
        self._kept_parts = sum(1 for _ in self._embeds(messages))
        return out

    @staticmethod
    def _embeds(messages: list[dict]):
        for m in messages:
            for p in m["content"] if isinstance(m["content"], list) else ():
                if p.get("type") == "prompt_embeds":
                    yield p

    def _referenced(self, messages: list[dict]) -> list[dict]:
        """``messages`` with the kept turn's parts as :class:`KeptPart`."""
        out, k = [], 0
        for m in messages:
            if not isinstance(m["content"], list):
                out.append(m)
                continue
            parts = []
            for p in m["content"]:
                if p.get("type") == "prompt_embeds" and k < self._kept_parts:
                    p = dict(p, data=KeptPart(self.kept_id, k))
                k += p.get("type") == "prompt_embeds"
                parts.append(p)
            out.append(dict(m, content=parts))
        return out

    def _post(self, messages: list[dict], args: dict) -> httpx.Response:
        self.last_sent_rows = sum(p["data"].shape[0] for p in self._embeds(messages)
                                  if isinstance(p["data"], torch.Tensor))
        headers = {**self.headers, KEEP_HEADER: _seconds(self.ttl_s)}
        fields = {**args, "messages": messages}
        if self.body == "json":
            h, content = openai_json_request("chat", self.model, None, fields, headers)
            return (self.client or default_client()).post(
                _url(self.url, "chat"), content=bytes(content), headers=h, timeout=self.timeout)
        return _post("chat", self.url, self.model, None, self.timeout, headers, fields,
                     self.client)
