# SPDX-License-Identifier: Apache-2.0
"""The one gate every request body of ours passes: :class:`BodyGate`.

A body format (one file each: ``binary.py``, ``region_refs.py``, ``json_body.py``;
their one registry is ``formats.py``) says only what is its own, as a
:class:`BodyFormat`: whether a request is its (:meth:`~BodyFormat.claim`, from the
headers alone) and what to make of its bytes (:meth:`~BodyFormat.prepare`). The
gate does the rest once for all of them: the routes and served model, the bytes in
flight against ``settings.inflight_bytes()``, the one reader (:class:`Body`)
with its timeouts, refusals (:class:`Refused`) in vLLM's error shape, and calling
vLLM's app with the prepared body. A format may hand a body back
(:attr:`Outcome.offer_on`) for the next format of the registry.

Knows HTTP (ASGI) and nothing of vLLM's classes.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any, Literal, Protocol

from starlette.datastructures import Headers
from vllm.logger import init_logger

from vllm._shm_embeds.ext.binary.body_limits import IN_FLIGHT, Stalled, deadline_for, receive_body_message
from vllm._shm_embeds.ext.binary.common import Receive, Send, ServerContext, headers, route, send_error
from vllm._shm_embeds.ext.binary.placeholders import Upload, call_with_body, prefixed, replay
from vllm._shm_embeds.ext.binary.settings import body_deadline_s

logger = init_logger(__name__)


class Refused(Exception):
    """A body the server refuses: the gate answers ``status`` in vLLM's error shape.

    Attributes:
        status: HTTP status (400, 408, 413, 429 or 503).
        reason: the counter label (the format's ``<counter>.<reason>``).
        message: for the client; never names a segment, a path or an id.
    """

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message

    @property
    def err_type(self) -> str:
        """vLLM's ``type`` of the error: ``BadRequestError`` for 400, else the
        status phrase without spaces (``RequestTimeout``, ``TooManyRequests``)."""
        return "BadRequestError" if self.status == 400 else \
            HTTPStatus(self.status).phrase.replace(" ", "")


class Disconnected(Exception):
    """The client went away before its body was in."""


BUSY_MESSAGE = "the server is receiving too many request bodies at once; retry later"


class Busy(Refused):
    """The in-flight cap is reached while a body arrives: 503 (``busy``), or,
    for a format whose :attr:`Claim.when_busy` is ``"stock"``, vLLM's own
    path with ``received`` (every body byte read so far, in order) ahead of
    the rest; ``more``: whether body bytes follow ``received``. Whoever holds
    bytes read before (:meth:`Body.rest`, ``json_read.read_body``) raises it
    again with them in front."""

    def __init__(self, received: bytes = b"", more: bool = True) -> None:
        super().__init__(503, "busy", BUSY_MESSAGE)
        self.received, self.more = received, more


BUSY = Busy()


@dataclasses.dataclass(frozen=True)
class Claim:
    """A format's claim on a request, from its headers.

    Attributes:
        length: bytes the body's deadline is set for (``Content-Length``, or
            what the framing announces so far: :meth:`Body.extend`).
        in_memory: bytes of it held in this process's memory while it
            arrives (charged to ``IN_FLIGHT``; 0: none, e.g. all to segments).
        when_busy: over the in-flight cap: ``"refuse"`` (503) or ``"stock"``
            (vLLM's own path, counted ``busy``).
        state: what the format learned from the headers, for :meth:`BodyFormat.prepare`.
    """

    length: int
    in_memory: int = 0
    when_busy: Literal["refuse", "stock"] = "refuse"
    state: Any = None


@dataclasses.dataclass
class Outcome:
    """What a format made of a body.

    Attributes:
        payload: the body vLLM's app gets (or, with ``offer_on``, the bytes as
            they arrived, for the next format).
        upload: this request's tensors by placeholder, or None (vLLM decodes).
        content_type: the ``Content-Type`` for vLLM's app, if it changes.
        offer_on: not this format's body after all: offer it to the next one.
    """

    payload: bytes
    upload: Upload | None = None
    content_type: bytes | None = None
    offer_on: bool = False


class BodyFormat(Protocol):
    """One input format of the API server (a file of ``http/``, an entry of
    ``formats.formats()``)."""

    name: str

    def claim(self, path: str, h: Headers, ctx: ServerContext | None) -> Claim | None:
        """This request's claim (headers only; nothing read), or None if it is
        not this format's. Raises :class:`Refused` (e.g. bad framing)."""

    async def prepare(self, path: str, body: Body, ctx: ServerContext | None,
                      claim: Claim) -> Outcome:
        """Read ``body`` and make the request for vLLM's app. Raises
        :class:`Refused` or :class:`Disconnected` (the gate answers; whatever
        the format holds is its to free first)."""

    def counted(self, reason: str) -> None:
        """Count (and log) a body refused (``Refused.reason``), sent the stock
        way when busy (``busy``), or lost (``disconnect``)."""


class Body:
    """The request body from ``receive()``, piece by piece, never joined.

    Each ``receive()`` waits at most ``settings.BODY_TIMEOUT_S``
    seconds and never past the deadline of a body of ``nbytes``
    (``body_limits.deadline_for``); either raises :class:`Refused` (408).
    A disconnect raises :class:`Disconnected`. The first ``charge`` bytes
    are charged to ``IN_FLIGHT`` as they arrive (:attr:`charged`; the gate
    gives them back); past the cap :class:`Busy` carries the piece not
    handed out.
    """

    def __init__(self, receive: Receive, nbytes: int, charge: int = 0) -> None:
        self._receive = receive
        self._buf = memoryview(b"")
        self._before = self._buf  # before the last take (``untake``)
        self.more = True
        self.deadline = deadline_for(nbytes)
        self._charge_left = charge
        self.charged = 0

    def extend(self, nbytes: int) -> None:
        """The body holds ``nbytes`` more than its deadline was set for."""
        self.deadline += body_deadline_s(nbytes) - body_deadline_s(0)

    async def _fill(self) -> bool:
        while not self._buf and self.more:
            try:
                msg = await receive_body_message(self._receive, self.deadline)
            except Stalled as e:
                raise Refused(408, "timeout", f"{e}; request timed out") from None
            if msg["type"] == "http.disconnect":
                raise Disconnected
            data = msg.get("body", b"")
            data = data if isinstance(data, bytes) else bytes(data)
            more = bool(msg.get("more_body", False))
            if self._charge_left and data:  # charged by what arrived
                n = min(len(data), self._charge_left)
                if not IN_FLIGHT.take(n):
                    raise Busy(data, more)
                self._charge_left -= n
                self.charged += n
            # Pieces may be hashed after they are handed out: they must not change.
            self._buf = memoryview(data)
            self.more = more
        return bool(self._buf)

    async def take(self, n: int) -> memoryview | None:
        """The next at most ``n`` bytes (as they arrived: maybe fewer), or None
        at the end of the body."""
        if not await self._fill():
            return None
        self._before = self._buf
        piece, self._buf = self._buf[:n], self._buf[n:]
        return piece

    async def piece(self) -> memoryview | None:
        """The next piece as it arrived, or None at the end of the body."""
        if not await self._fill():
            return None
        piece, self._buf = self._buf, memoryview(b"")
        return piece

    def untake(self) -> None:
        """Undo the last :meth:`take`: its bytes come again next."""
        self._buf = self._before

    async def rest(self, limit: int) -> bytes:
        """The rest of the body, joined (for small bodies). Raises
        :class:`Refused` (413) past ``limit`` bytes; :class:`Busy` with every
        byte read so far."""
        parts, n = [], 0
        while True:
            try:
                piece = await self.take(limit + 1 - n)
            except Busy as e:  # what was read, ahead of the rest (vLLM's path)
                raise Busy(b"".join(parts) + e.received, e.more) from None
            if piece is None:
                break
            parts.append(bytes(piece))
            n += len(piece)
            if n > limit:
                raise Refused(413, "too_large", f"the request body exceeds {limit} bytes")
        return b"".join(parts)

    async def at_end(self) -> bool:
        """True when no byte is left."""
        return not await self._fill()


class BodyGate:
    """Pure ASGI middleware: the body formats ``formats`` on the completion
    routes, tried in order (see the module doc); every other request passes
    through untouched. A format with ``startup(scope)`` / ``shutdown()``
    methods gets the app's lifespan events (they must not raise)."""

    def __init__(self, app: Callable, formats: Sequence[BodyFormat] = ()) -> None:
        self.app = app
        self.formats = tuple(formats)

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope.get("type") == "lifespan":
            return await self.app(scope, self._lifespan(scope, receive), send)
        path = route(scope)
        if path is None or not self.formats:
            return await self.app(scope, receive, send)
        h, ctx = headers(scope), ServerContext.of_app(scope)
        for fmt in self.formats:
            try:
                claim = fmt.claim(path, h, ctx)
            except Refused as e:
                return await self._refuse(send, fmt, e)
            if claim is None:
                continue
            offered = await self._serve(fmt, claim, scope, receive, send, path, ctx)
            if offered is None:
                return
            receive = replay(offered, receive)  # the next format reads the same bytes
        return await self.app(scope, receive, send)

    async def _serve(self, fmt: BodyFormat, claim: Claim, scope: dict, receive: Receive,
                     send: Send, path: str, ctx: ServerContext | None) -> bytes | None:
        """``fmt``'s request, answered here or by vLLM's app; the bytes as they
        arrived if ``fmt`` offers them on (else None)."""
        if claim.in_memory and not IN_FLIGHT.room():  # full: nothing read
            return await self._busy(fmt, claim, BUSY, scope, receive, send)
        body = Body(receive, claim.length, charge=claim.in_memory)
        try:
            try:
                outcome = await fmt.prepare(path, body, ctx, claim)
            finally:
                IN_FLIGHT.give_back(body.charged)  # the body is in (or never will be)
        except Busy as e:
            return await self._busy(fmt, claim, e, scope, receive, send)
        except Refused as e:
            await self._refuse(send, fmt, e)
            return None
        except Disconnected:
            fmt.counted("disconnect")
            logger.info("shm-embeds: client disconnected while sending a %s body", fmt.name)
            return None
        if outcome.offer_on:
            return outcome.payload
        try:
            await call_with_body(self.app, scope, receive, send, outcome.payload,
                                 outcome.upload, content_type=outcome.content_type)
        finally:
            if outcome.upload is not None:
                try:
                    await outcome.upload.settle()
                finally:  # (cancelled: release waits for a keep's copy itself)
                    outcome.upload.release()  # what vLLM did not take over: remove now
        return None

    async def _busy(self, fmt: BodyFormat, claim: Claim, e: Busy, scope: dict,
                    receive: Receive, send: Send) -> None:
        """Over the in-flight cap: 503, or vLLM's own path with the bytes read so far."""
        if claim.when_busy != "stock":
            return await self._refuse(send, fmt, e)
        fmt.counted("busy")
        await self.app(scope, prefixed(e.received, e.more, receive), send)
        return None

    @staticmethod
    async def _refuse(send: Send, fmt: BodyFormat, e: Refused) -> None:
        fmt.counted(e.reason)
        logger.info("shm-embeds: %s body refused (%s, %d): %r", fmt.name, e.reason, e.status,
                    e.message)
        await send_error(send, e.status, e.message, e.err_type)

    def _lifespan(self, scope: dict, receive: Receive) -> Receive:
        """``receive`` of the lifespan protocol, telling the formats of
        ``lifespan.startup`` and ``lifespan.shutdown``."""

        async def lifespan_receive() -> dict:
            message = await receive()
            kind = message.get("type")
            for fmt in self.formats:
                if kind == "lifespan.startup" and hasattr(fmt, "startup"):
                    fmt.startup(scope)
                elif kind == "lifespan.shutdown" and hasattr(fmt, "shutdown"):
                    fmt.shutdown()
            return message

        return lifespan_receive
