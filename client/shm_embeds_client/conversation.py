# SPDX-License-Identifier: Apache-2.0
"""Conversations: the server keeps a request's ``prompt_embeds``, and the next
turn sends only the rows after them (``docs/conversations.md``)::

    conv = sec.Conversation("http://localhost:8000", "my-model", ttl_s=600)
    out = conv.complete(turn1, max_tokens=32)   # sends turn1 whole, asks to keep it
    out = conv.complete(turn2, max_tokens=32)   # sends turn2's rows after the kept id
    branch = conv.fork()                        # continues from the same kept prefix

Each call sends ``Shm-Embeds-Keep: <ttl_s>``; a 200 whose ``Shm-Embeds-Kept``
header names an id lets the next call send a
:class:`~shm_embeds_client._framing.Continuation` (that id and the new rows)
instead of the whole history. No header (a server without the feature, or
no room) and the next call sends the whole history again. A 404 whose error
type is ``PrefixNotFound`` (expired, evicted, server restarted) is answered
by one resend of the whole history (``misses`` counts them); any other error
raises ``httpx.HTTPStatusError`` and leaves the conversation as it was.

The history is what the caller appended (``new_rows`` of each call, e.g. the
embeddings of the user's turn and of the model's previous answer): the
model's output is not added by itself. A conversation is not thread-safe;
:meth:`Conversation.fork` gives an independent branch that shares the
history's tensors (do not change them in place).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import httpx
import torch

from shm_embeds_client._framing import Continuation
from shm_embeds_client._tensors import _wire
from shm_embeds_client.aio import _apost
from shm_embeds_client.http import _post, _result, _url
from shm_embeds_client.openai_json import openai_json_request
from shm_embeds_client.pool import Pool
from shm_embeds_client.wire import KEEP_HEADER, KEPT_HEADER, PREFIX_NOT_FOUND

__all__ = ["AsyncConversation", "Conversation", "prefix_missing"]

_CLOSED = Pool(lambda: None)  # a closed conversation's: get() raises
_CLOSED.release()


def prefix_missing(r: httpx.Response) -> bool:
    """Whether ``r`` is the server's answer to a kept prefix it cannot resolve:
    HTTP 404 with error type ``PrefixNotFound`` (``{"error": {"type": ...}}``
    or the type at top level)."""
    if r.status_code != 404:
        return False
    try:
        body = r.json()
    except ValueError:
        return False
    if not isinstance(body, dict):
        return False
    err = body.get("error")
    return ((isinstance(err, dict) and err.get("type") == PREFIX_NOT_FOUND)
            or body.get("type") == PREFIX_NOT_FOUND)


def _kept(r: httpx.Response) -> str | None:
    kept = r.headers.get(KEPT_HEADER, "").strip()
    return kept or None


def _seconds(ttl_s: float) -> str:
    return str(int(ttl_s)) if float(ttl_s).is_integer() else repr(float(ttl_s))


class _Conversation:
    """State and bookkeeping shared by :class:`Conversation` and
    :class:`AsyncConversation` (no I/O here)."""

    def __init__(self, url: str, model: str, *, ttl_s: float = 600,
                 cache_salt: str | None = None, timeout: float | None = 600,
                 headers: dict | None = None, client: Any = None,
                 body: str = "binary") -> None:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) \
                or not math.isfinite(ttl_s) or ttl_s <= 0:
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
        if body not in ("binary", "json"):
            raise ValueError(f"body must be 'binary' or 'json', got {body!r}")
        self.body = body
        self.url = url
        self.model = model
        self.ttl_s = ttl_s
        self.cache_salt = cache_salt
        self.timeout = timeout
        # The keep header is the conversation's own: a caller's spelling of it is dropped.
        self.headers = {k: v for k, v in (headers or {}).items()
                        if k.lower() != KEEP_HEADER.lower()}
        self.client = client  # the caller's (left open), else the pool's
        self._pool: Pool | None = None if client is not None else Pool(self._make_client)
        self.kept_id: str | None = None  # the server's id of the whole history, if kept
        self.last_sent_rows = 0  # rows sent by the last call (both requests of a miss)
        self.misses = 0  # whole-history resends after a PrefixNotFound
        self._pieces: list[torch.Tensor] = []
        self._rows = 0
        self._dtype: torch.dtype | None = None

    @property
    def rows(self) -> int:
        """The history's length in rows (tokens)."""
        return self._rows

    @property
    def pieces(self) -> tuple[torch.Tensor, ...]:
        """The history as appended, one tensor per successful call (as sent:
        CPU, contiguous, FP32/FP16/BF16)."""
        return tuple(self._pieces)

    def history(self) -> torch.Tensor | None:
        """The whole history as one tensor (a ``torch.cat``), None if empty."""
        if not self._pieces:
            return None
        return self._pieces[0] if len(self._pieces) == 1 else torch.cat(self._pieces)

    def reset(self) -> None:
        """Forget the kept id: the next call sends the whole history."""
        self.kept_id = None

    def fork(self):
        """A branch: a new conversation with the same history (the same
        tensors, a list of its own), kept id, settings and connections (closed
        once every branch is); its counters start at 0. Both may continue from
        the kept prefix."""
        other = copy.copy(self)
        other._pool = self._pool.share() if self._pool is not None else None
        other.headers = dict(self.headers)
        other._pieces = list(self._pieces)
        other.last_sent_rows = 0
        other.misses = 0
        return other

    def _client(self) -> Any:
        """The client to send through: the caller's, else this conversation's pool's.
        Raises RuntimeError once closed."""
        return self.client if self._pool is None else self._pool.get()

    def _prepare(self, new_rows: Any, completion_args: dict) -> tuple[torch.Tensor, dict]:
        if completion_args.get("stream"):
            raise ValueError("a conversation does not stream (stream=True)")
        for key in ("prompt_embeds", "cache_salt"):
            if key in completion_args:
                raise ValueError(f"{key} is the conversation's own (cache_salt: set it "
                                 "on the conversation)")
        new, _ = _wire(new_rows)  # ValueError unless 2-D floating point
        if self._pieces:
            hidden = self._pieces[0].shape[1]
            if new_rows.dtype != self._dtype or new.shape[1] != hidden:
                raise ValueError(f"new_rows must be (T, {hidden}) {self._dtype} like the "
                                 f"history, got {tuple(new_rows.shape)} {new_rows.dtype}")
        args = dict(completion_args)
        if self.cache_salt is not None:
            args["cache_salt"] = self.cache_salt
        return new, args

    def _request_headers(self) -> dict:
        return {**self.headers, KEEP_HEADER: _seconds(self.ttl_s)}

    def _sent(self, tensor: Any) -> Any:
        """``tensor`` (or a continuation), its rows counted in ``last_sent_rows``."""
        self.last_sent_rows += (tensor.rows if isinstance(tensor, Continuation)
                                else tensor).shape[0]
        return tensor

    def _answered(self, r: httpx.Response) -> httpx.Response | None:
        """The continuation's answer, or None (the id forgotten) if it missed."""
        if not prefix_missing(r):
            return r
        self.misses += 1
        self.kept_id = None
        return None

    def _whole(self, new: torch.Tensor) -> torch.Tensor:
        return torch.cat([*self._pieces, new]) if self._pieces else new

    def _commit(self, new: torch.Tensor, new_rows: torch.Tensor, r: httpx.Response) -> None:
        if not self._pieces:
            self._dtype = new_rows.dtype
        self._pieces.append(new)
        self._rows += new.shape[0]
        self.kept_id = _kept(r)


class Conversation(_Conversation):
    """A conversation over ``/v1/completions`` (sync, ``httpx``).

    Args:
        url: server base URL (``http://host:port``, ``/v1`` optional).
        model: the model name.
        ttl_s: seconds the server is asked to keep each request's prompt_embeds.
        cache_salt: sent in every request (a kept id is bound to it).
        timeout: per request, seconds.
        headers: more request headers.
        client: an ``httpx.Client`` to send through (left open); default, one
            of the conversation's own, made on first use and kept for every turn
            (its connections reused), closed by :meth:`close` or ``with``.
        body: ``"binary"`` (binary bodies) or ``"json"`` (base64 JSON, the
            continuation as the JSON object of ``docs/conversations.md``).
    Attributes:
        kept_id: the id of the kept history, or None (the next call sends it whole).
        rows: the history's length; ``last_sent_rows``: rows sent by the last
            call; ``misses``: whole resends after ``PrefixNotFound``.
    """

    @staticmethod
    def _make_client() -> httpx.Client:
        return httpx.Client()  # (looked up per conversation: a caller may replace it)

    def close(self) -> None:
        """Close the conversation's own connections (once every fork is closed
        too); a client passed in is left open. The conversation sends no more."""
        if self._pool is not None and self._pool is not _CLOSED:
            client = self._pool.release()
            self._pool = _CLOSED
            if client is not None:
                client.close()

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def complete(self, new_rows: torch.Tensor, **completion_args: Any) -> Any:
        """Append ``new_rows`` (``(T, H)``, the history's dtype and H) and
        ``POST /v1/completions`` with the whole history as ``prompt_embeds``:
        sent as the kept id plus ``new_rows`` if an id is held, else whole.

        Returns:
            the response JSON (a dict), as :func:`~shm_embeds_client.http.complete`.
        Raises:
            ValueError: ``stream=True``, ``prompt_embeds`` or ``cache_salt`` in
                ``completion_args``, or ``new_rows`` not like the history.
            httpx.HTTPStatusError: a 4xx/5xx (other than one ``PrefixNotFound``,
                answered by a whole resend); the history is then unchanged.
        """
        new, args = self._prepare(new_rows, completion_args)
        self.last_sent_rows = 0
        r = None
        if self.kept_id is not None and self.rows:
            r = self._answered(self._post(self._sent(Continuation(self.kept_id, new, self.rows)), args))
        if r is None:
            r = self._post(self._sent(self._whole(new)), args)
        out = _result(r, False)
        self._commit(new, new_rows, r)
        return out

    def _post(self, tensor: Any, args: dict) -> httpx.Response:
        if self.body == "json":
            h, content = openai_json_request("completions", self.model, tensor, args,
                                             self._request_headers())
            return self._client().post(_url(self.url, "completions"), content=bytes(content),
                                       headers=h, timeout=self.timeout)
        return _post("completions", self.url, self.model, tensor, self.timeout,
                     self._request_headers(), args, self._client())


class AsyncConversation(_Conversation):
    """Async :class:`Conversation` (``client``: an ``httpx.AsyncClient``; its own
    otherwise, closed by :meth:`aclose` or ``async with``)."""

    @staticmethod
    def _make_client() -> httpx.AsyncClient:
        return httpx.AsyncClient()

    async def aclose(self) -> None:
        """Async :meth:`Conversation.close`."""
        if self._pool is not None and self._pool is not _CLOSED:
            client = self._pool.release()
            self._pool = _CLOSED
            if client is not None:
                await client.aclose()

    async def __aenter__(self) -> AsyncConversation:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def acomplete(self, new_rows: torch.Tensor, **completion_args: Any) -> Any:
        """Async :meth:`Conversation.complete`."""
        new, args = self._prepare(new_rows, completion_args)
        self.last_sent_rows = 0
        r = None
        if self.kept_id is not None and self.rows:
            r = self._answered(await self._apost(self._sent(Continuation(self.kept_id, new, self.rows)), args))
        if r is None:
            r = await self._apost(self._sent(self._whole(new)), args)
        out = _result(r, False)
        self._commit(new, new_rows, r)
        return out

    async def _apost(self, tensor: Any, args: dict) -> httpx.Response:
        if self.body == "json":
            h, content = openai_json_request("completions", self.model, tensor, args,
                                             self._request_headers())
            return await self._client().post(_url(self.url, "completions"),
                                             content=bytes(content), headers=h,
                                             timeout=self.timeout)
        return await _apost("completions", self.url, self.model, tensor, self.timeout,
                            self._request_headers(), args, self._client())
