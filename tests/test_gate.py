# SPDX-License-Identifier: Apache-2.0
"""The one body gate (``ext/binary/gate.py``), driven with a format of the test's
own: what the gate does for every format (the in-flight cap, the deadline,
refusals, disconnects, offering a body on, the upload's end, lifespan) holds
whatever the format is."""

import asyncio
import json

import pytest
from helpers import asgi_peer, read_whole_body, set_limits

from vllm._shm_embeds.ext.binary import gate
from vllm._shm_embeds.ext.binary.body_limits import IN_FLIGHT

PATH = "/v1/completions"


class Upper:
    """A format of ``text/x-upper`` bodies: vLLM's app gets them upper-cased."""

    name = "upper"

    def __init__(self, when_busy="refuse", offer_on=False, refuse_claim=None):
        self.when_busy, self.offer_on, self.refuse_claim = when_busy, offer_on, refuse_claim
        self.counts, self.events, self.upload = [], [], None

    def claim(self, path, h, ctx):
        if h.get("content-type") != "text/x-upper":
            return None
        if self.refuse_claim:
            raise gate.Refused(*self.refuse_claim)
        n = int(h["content-length"])
        return gate.Claim(length=n, in_memory=n, when_busy=self.when_busy)

    async def prepare(self, path, body, ctx, claim):
        self.in_flight = [IN_FLIGHT.bytes]
        raw = await body.rest(1 << 20)
        self.in_flight.append(IN_FLIGHT.bytes)
        if self.offer_on:
            return gate.Outcome(raw, offer_on=True)
        self.upload = _Upload()
        return gate.Outcome(raw.upper(), self.upload)

    def counted(self, reason):
        self.counts.append(reason)

    def startup(self, scope):
        self.events.append("startup")

    def shutdown(self):
        self.events.append("shutdown")


class Echo(Upper):
    """Takes what ``Upper`` offers on."""

    name = "echo"

    async def prepare(self, path, body, ctx, claim):
        return gate.Outcome(b"echo:" + await body.rest(1 << 20))


class _Upload:
    released = False
    leases = ()
    keeps = ()

    async def settle(self):
        pass

    def release(self):
        self.released = True


def _run(formats, messages, ctype=b"text/x-upper", length=None, scope_type="http"):
    """Drive the gate with one request: (responses sent, body vLLM's app got)."""
    body = b"".join(m.get("body", b"") for m in messages)
    scope = {"type": scope_type, "method": "POST", "path": PATH, "headers": [
        (b"content-type", ctype), (b"content-length", str(length or len(body)).encode())]}
    seen = {}

    async def app(scope, receive, send):
        seen["body"] = await read_whole_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    receive, send, sent = asgi_peer(messages)
    asyncio.run(asyncio.wait_for(gate.BodyGate(app, formats)(scope, receive, send), 30))
    assert IN_FLIGHT.bytes == 0  # every charge given back
    statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
    return statuses, seen.get("body"), sent


def _body(*pieces):
    return [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
            for i, p in enumerate(pieces)]


def test_a_claimed_body_is_prepared_charged_and_its_upload_ended():
    fmt = Upper()
    statuses, got, _ = _run([fmt], _body(b"ab", b"c"))
    assert statuses == [200] and got == b"ABC"
    assert fmt.in_flight == [0, 3] and fmt.upload.released and fmt.counts == []


def test_a_body_no_format_claims_passes_untouched():
    fmt = Upper()
    statuses, got, _ = _run([fmt], _body(b"abc"), ctype=b"application/json")
    assert statuses == [200] and got == b"abc" and fmt.upload is None


@pytest.mark.parametrize("when_busy", ["refuse", "stock"])
def test_over_the_in_flight_cap(monkeypatch, when_busy):
    set_limits(monkeypatch, INFLIGHT_BYTES=2)
    fmt = Upper(when_busy)
    statuses, got, sent = _run([fmt], _body(b"abc"))
    assert fmt.counts == ["busy"] and fmt.upload is None
    if when_busy == "refuse":
        assert statuses == [503] and got is None
        assert json.loads(sent[1]["body"])["error"]["type"] == "ServiceUnavailable"
    else:
        assert statuses == [200] and got == b"abc"  # vLLM's own path


@pytest.mark.parametrize("when_busy", ["refuse", "stock"])
def test_the_cap_is_charged_by_what_arrived_and_reached_midway(monkeypatch, when_busy):
    """A body is charged as its bytes arrive, never by its Content-Length: one
    declaring far more than the cap starts; reaching the cap midway it gets
    503, or vLLM's own path with every byte (those read and the rest)."""
    set_limits(monkeypatch, INFLIGHT_BYTES=5)
    fmt = Upper(when_busy)
    statuses, got, _ = _run([fmt], _body(b"ab", b"cd", b"ef", b"gh"), length=8)
    assert fmt.counts == ["busy"] and fmt.upload is None
    if when_busy == "refuse":
        assert statuses == [503] and got is None
    else:
        assert statuses == [200] and got == b"abcdefgh"


def test_a_stalled_body_gets_408(monkeypatch):
    set_limits(monkeypatch, BODY_TIMEOUT_S=0.2)
    fmt = Upper()
    statuses, got, sent = _run([fmt], [{"type": "http.request", "body": b"ab",
                                        "more_body": True}], length=10)
    assert statuses == [408] and got is None and fmt.counts == ["timeout"]
    assert json.loads(sent[1]["body"])["error"]["type"] == "RequestTimeout"


def test_a_disconnect_is_counted_and_answers_nothing():
    fmt = Upper()
    statuses, got, _ = _run([fmt], [{"type": "http.request", "body": b"ab", "more_body": True},
                                    {"type": "http.disconnect"}], length=10)
    assert statuses == [] and got is None and fmt.counts == ["disconnect"]


def test_a_refused_claim_reads_nothing():
    fmt = Upper(refuse_claim=(413, "too_large", "too large"))
    statuses, got, sent = _run([fmt], _body(b"abc"))
    assert statuses == [413] and got is None and fmt.counts == ["too_large"]
    assert json.loads(sent[1]["body"])["error"]["message"] == "too large"


def test_more_than_the_format_reads_gets_413():
    fmt = Upper()
    statuses, _, _ = _run([fmt], _body(b"a" * ((1 << 20) + 1)))
    assert statuses == [413] and fmt.counts == ["too_large"]


def test_a_body_offered_on_reaches_the_next_format_whole():
    first, second = Upper(offer_on=True), Echo()
    statuses, got, _ = _run([first, second], _body(b"ab", b"c"))
    assert statuses == [200] and got == b"echo:abc"


def test_lifespan_events_reach_the_formats():
    fmt = Upper()
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def app(scope, receive, send):
        await receive()
        await receive()

    async def receive():
        return messages.pop(0)

    asyncio.run(gate.BodyGate(app, [fmt])({"type": "lifespan"}, receive, None))
    assert fmt.events == ["startup", "shutdown"]


def test_the_registry_formats_implement_the_protocol():
    from vllm._shm_embeds.ext.binary.formats import formats as all_formats

    for f in all_formats():
        fmt = f.load()
        assert fmt.name == f.name
        for method in ("claim", "prepare", "counted"):
            assert callable(getattr(fmt, method)), (f.name, method)


def test_leases_settle_at_the_first_response_body_byte():
    """A request's region leases stop counting against the cap when vLLM's app
    sends its first response body message (after the request's first output),
    not when a slow client has read the whole answer; they end with it."""
    from vllm._shm_embeds.ext.binary.placeholders import Upload, call_with_body

    events = []

    class Lease:
        tensor = None

        def settle(self):
            events.append("settle")

        def release(self):
            events.append("release")

    upload = Upload("t", [], leases=[Lease()])

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        events.append("started")
        for chunk in (b"a", b"b"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            events.append(f"sent {chunk.decode()}")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    receive, send, _ = asgi_peer([])
    asyncio.run(call_with_body(app, {"type": "http", "headers": []}, receive, send, b"{}",
                               upload))
    upload.release()
    assert events == ["started", "settle", "sent a", "settle", "sent b", "settle", "release"]
