# SPDX-License-Identifier: Apache-2.0
"""The HTTP body paths: hostile bodies cost no more than stock.

Without a server: the JSON and binary middlewares driven as ASGI apps.
Memory follows the bytes that arrived (not the declared ``Content-Length``),
declared sizes and bytes in flight are capped (above: the stock path), a
body that trickles gets 408 in bounded time, the segment budget charges an
upload by what it wrote, tensors per binary body are capped, and the small
parser cases (deep nesting, non-ASCII digits, escape-heavy JSON) are bounded.
What ``json.loads`` builds from a binary body's JSON header
is bounded before it runs, and binary headers count as bytes in flight.
"""

import asyncio
import dataclasses
import json
import os
import time
import tracemalloc
import types

import pytest
import torch
from helpers import encode_embeds, proc_status_bytes, read_whole_body, set_limits
from test_binary_framing import LIMITS, _framed, _run_middleware, _scope, desc, hdr

from vllm._shm_embeds import counters
from vllm._shm_embeds.config import shm_dir
from vllm._shm_embeds.files import census as census_mod
from vllm._shm_embeds.files import segment
from vllm._shm_embeds.ext.binary import binary, body_limits, common, gate
from vllm._shm_embeds.ext.json import json_body, json_strings
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.ext.digests import streamed


def _json_scope(length: int, hidden=64, max_len=2048, enable=True, ctype=b"application/json",
                clen: bytes | None = None):
    mc = types.SimpleNamespace(enable_prompt_embeds=enable, dtype=torch.float32,
                               max_model_len=max_len, get_hidden_size=lambda: hidden)
    config = types.SimpleNamespace(model_config=mc, cache_config=None)
    return {"type": "http", "method": "POST", "path": "/v1/completions",
            "app": types.SimpleNamespace(state=types.SimpleNamespace(vllm_config=config)),
            "headers": [(b"content-type", ctype),
                        (b"content-length", clen or str(length).encode())]}


def _run_json(scope, chunks, stall=False, timeout=10.0):
    """Drive the JSON format (through the body gate); returns (responses sent, what the app received, seconds)."""
    got, sent = {}, []
    msgs = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    if not stall:
        msgs.append({"type": "http.request", "body": b"", "more_body": False})

    async def receive():
        if msgs:
            return msgs.pop(0)
        await asyncio.sleep(3600)

    async def send(m):
        sent.append(m)

    async def app(scope, receive, send):
        parts, more = [], True
        while more:
            m = await receive()
            parts.append(m.get("body", b""))
            more = m.get("more_body", False)
        got["body"] = b"".join(parts)

    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(gate.BodyGate(app, [json_body.JsonFormat()])(scope, receive, send),
                                 timeout))
    return sent, got, time.monotonic() - t0


def test_stalled_json_bodies_hold_only_what_arrived(shm_env, monkeypatch):
    """Bodies that declare 512 MiB, send 64 KiB and stall: the server holds about
    what arrived (a 64 KiB look-ahead each), never the declared size, and the
    in-flight cap is charged exactly what arrived."""
    set_limits(monkeypatch, INFLIGHT_BYTES=4 << 30)
    declared = 512 << 20
    head = b'{"model": "m", "prompt_embeds": "' + b"A" * (64 << 10)
    scope = _json_scope(declared, hidden=4096, max_len=65536)
    assert declared <= json_body.max_json_body_bytes(common.ServerContext.of_app(scope))
    grown = {}

    async def one(receive):
        await gate.BodyGate(None, [json_body.JsonFormat()])(scope, receive, _ignore)

    async def main():
        r0 = proc_status_bytes("VmRSS")
        tasks = []
        for _ in range(3):
            msgs = [{"type": "http.request", "body": head, "more_body": True}]

            async def receive(msgs=msgs):
                if msgs:
                    return msgs.pop(0)
                await asyncio.sleep(3600)
            tasks.append(asyncio.create_task(one(receive)))
        await asyncio.sleep(1.5)
        grown["rss"] = proc_status_bytes("VmRSS") - r0
        assert body_limits.IN_FLIGHT.bytes == 3 * len(head)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    assert grown["rss"] < 48 << 20, grown
    assert body_limits.IN_FLIGHT.bytes == 0


async def _ignore(m):
    pass


def test_json_disabled_or_too_large_takes_the_stock_path(shm_env, monkeypatch):
    """``--enable-prompt-embeds`` off: not taken at all; a Content-Length above
    the model-derived cap: the stock app gets the body untouched (counted)."""
    body = json.dumps({"model": "m", "prompt_embeds": encode_embeds(torch.randn(60, 64))})
    body = body.encode()
    chunks = [body[i:i + 4096] for i in range(0, len(body), 4096)]
    _, got, _ = _run_json(_json_scope(len(body), enable=False), chunks)
    assert got["body"] == body
    assert not any(k.startswith("json_") for k in counters.stats())
    set_limits(monkeypatch, BINARY_MAX_BYTES=1024)
    big = body[:-2] + b'", "pad": "' + b"x" * (1 << 20) + b'"}'
    ctx = common.ServerContext.of_app(_json_scope(len(big)))
    assert len(big) > json_body.max_json_body_bytes(ctx)
    _, got, _ = _run_json(_json_scope(len(big)), [big])
    assert got["body"] == big
    assert counters.stats().get("json_fallback.too_large") == 1
    assert "json_tensors" not in counters.stats()


def test_json_bytes_in_flight_capped(shm_env, monkeypatch):
    """Over ``INFLIGHT_BYTES`` a body goes the stock way; the
    count goes back to zero after every kind of end."""
    body = json.dumps({"model": "m", "prompt_embeds": encode_embeds(torch.randn(60, 64))})
    body = body.encode()
    set_limits(monkeypatch, INFLIGHT_BYTES=len(body) - 1)
    _, got, _ = _run_json(_json_scope(len(body)), [body])
    assert got["body"] == body and counters.stats()["json_fallback.busy"] == 1
    set_limits(monkeypatch, INFLIGHT_BYTES=len(body))
    _, got, _ = _run_json(_json_scope(len(body)), [body])
    assert counters.stats()["json_tensors"] == 1 and body_limits.IN_FLIGHT.bytes == 0
    set_limits(monkeypatch, BODY_TIMEOUT_S=0.2)
    sent, _, _ = _run_json(_json_scope(len(body)), [body[:100]], stall=True)
    assert sent[0]["status"] == 408 and body_limits.IN_FLIGHT.bytes == 0


def _trickle(every: float, first: bytes):
    """A receive() that sends ``first`` and then one byte every ``every`` seconds."""
    state = {"n": 0}

    async def receive():
        state["n"] += 1
        if state["n"] == 1:
            return {"type": "http.request", "body": first, "more_body": True}
        await asyncio.sleep(every)
        return {"type": "http.request", "body": b"x", "more_body": True}
    return receive


@pytest.mark.parametrize("path", ["json", "binary"])
def test_trickling_body_gets_408_in_bounded_time(shm_env, monkeypatch, path):
    """One byte every 0.2 s never trips the 1 s per-receive timeout, but the
    whole body must arrive within timeout + size / ``BODY_MIN_RATE``
    (here about 1.1 s): 408, nothing left, no wait without end."""
    set_limits(monkeypatch, BODY_TIMEOUT_S=1, BODY_MIN_RATE=1 << 20)
    sent = []

    async def send(m):
        sent.append(m)

    if path == "json":
        body = json.dumps({"model": "m", "prompt_embeds": encode_embeds(torch.randn(60, 64))})
        scope = _json_scope(len(body))
        app = gate.BodyGate(None, [json_body.JsonFormat()])
        receive = _trickle(0.2, body.encode()[:100])
    else:
        headers, body = _framed([torch.randn(16, 8)])
        scope = _scope(headers + [(b"content-length", str(len(body)).encode())])
        app = gate.BodyGate(None, [binary.BinaryFormat()])
        receive = _trickle(0.2, body[:len(body) // 2])
    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 8))
    assert sent[0]["status"] == 408 and time.monotonic() - t0 < 4
    assert os.listdir(shm_env) == []


def test_upload_charged_by_what_it_wrote(shm_env, monkeypatch):
    """The budget charges a streamed upload by what it wrote plus a bounded
    grant, not its declared size: a second upload starts while the first
    trickles; when the first later meets the budget its write fails cleanly
    (BudgetExceeded, nothing written) and abort leaves nothing."""
    monkeypatch.setattr(streamed, "STREAM_GRANT_BYTES", 64 << 10)
    monkeypatch.setenv("VLLM_SHM_EMBEDS_MAX_BYTES", str(1 << 20))
    # No walk of the directory during the test: one overlapping a write counts
    # that write twice until the next walk (on the safe side, files/census.py), which
    # would take the budget before the grants this test is about.
    monkeypatch.setattr(census_mod, "MIN_INTERVAL_S", 1e9)
    assert process.current().census(shm_dir()).settle() == 0
    a = streamed.StreamedSegment(torch.uint8, (768 << 10,))
    a.write(b"\1" * 4096)
    b = streamed.StreamedSegment(torch.uint8, (768 << 10,))  # charged as it fills
    for _ in range(12):
        b.write(b"\2" * (64 << 10))
    with pytest.raises(segment.BudgetExceeded):
        for _ in range(12):
            a.write(b"\1" * (64 << 10))
    filled = a.filled
    with pytest.raises(segment.BudgetExceeded):
        a.write(b"\1" * (64 << 10))
    assert a.filled == filled  # nothing written by the refused write
    a.abort()
    b.abort()
    assert os.listdir(shm_env) == []


def test_binary_upload_meeting_the_budget_finishes_privately(shm_env, monkeypatch):
    """A binary tensor whose grant is refused midway goes on in private memory
    (``binary_fallback.budget``); the request gets the right tensor."""
    t = torch.randn(16, 8)
    headers, body = _framed([t])
    real = transfer.check_budget
    calls = {"n": 0}

    def budget(n):
        calls["n"] += 1
        if calls["n"] > 1:  # room at the start, none later
            raise segment.BudgetExceeded(n, 0, 0)
        real(n)
    monkeypatch.setattr(transfer, "check_budget", budget)
    monkeypatch.setattr(streamed, "STREAM_GRANT_BYTES", 128)
    status, _, seen = _run_middleware(headers, [body[i:i + 100] for i in range(0, len(body), 100)])
    assert status == 200 and torch.equal(seen["tensors"][0], t)
    assert counters.stats()["binary_fallback.budget"] == 1
    del seen
    assert os.listdir(shm_env) == []


def test_tensors_per_binary_body_capped(shm_env, monkeypatch):
    set_limits(monkeypatch, BINARY_MAX_TENSORS=2)
    h = hdr({"prompt_embeds": [desc(1), desc(1), desc(1)]})
    with pytest.raises(binary.BinaryBodyError) as e:
        binary.parse_header(h, "/v1/completions", LIMITS, None)
    assert (e.value.status, e.value.reason) == (400, "too_many")
    headers, body = _framed([torch.randn(1, 8)] * 3)
    status, msg, _ = _run_middleware(headers, [body])
    assert status == 400 and b"limit of 2" in msg
    assert os.listdir(shm_env) == []


def test_deeply_nested_header_is_400(shm_env):
    """A JSON header nested 100,000 deep: 400, not RecursionError (a 500)."""
    h = b'{"prompt_embeds": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(binary.BinaryBodyError) as e:
        binary.parse_header(h, "/v1/completions", LIMITS, None)
    assert (e.value.status, e.value.reason) == (400, "json")
    headers = [(b"content-type", b"application/octet-stream"),
               (b"inference-header-content-length", str(len(h)).encode())]
    status, _, _ = _run_middleware(headers, [h])
    assert status == 400


@pytest.mark.parametrize("value", [b"\xb2", b"1\xb2", b"\xd9\xa3", b"1" * 30, b"+5", b" 5 x"])
def test_non_ascii_digits_are_not_byte_counts(shm_env, value):
    """``Inference-Header-Content-Length: ²`` passes ``str.isdigit`` and
    ``int()`` raises: 400 here; on the JSON path the stock app gets it."""
    ok = [(b"content-type", b"application/octet-stream")]
    with pytest.raises(binary.BinaryBodyError) as e:
        binary.frame_header_length(ok + [(b"inference-header-content-length", value)])
    assert e.value.status == 400
    with pytest.raises(binary.BinaryBodyError):
        binary.frame_header_length(ok + [(b"inference-header-content-length", b"5"),
                                         (b"content-length", value)])
    assert body_limits.byte_count(" 12 ") == 12
    assert body_limits.byte_count(value.decode("latin-1")) is None
    body = b'{"model": "m"}'
    _, got, _ = _run_json(_json_scope(0, clen=value), [body])
    assert got["body"] == body


def test_escapes_next_to_embeds_scan_in_bounded_time():
    """A body carrying embeds and 8 MiB of escapes: the scan takes a bounded
    multiple of ``json.loads`` (a scan in Python would be ~30x)."""
    emb = encode_embeds(torch.randn(256, 1024))
    raw = json.dumps({"prompt_embeds": emb, "user": '\\"' * (2 << 20),
                      "stop": ["a"] * (1 << 19)}).encode()
    json.loads(raw)

    def best(f):  # the least of 5: what a busy machine adds to one run does not count
        out = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            f(raw)
            out = min(out, time.perf_counter() - t0)
        return out
    spans = json_strings.find_long_strings(raw)
    assert [raw[a:b].decode() for a, b in spans] == [emb]
    assert best(json_strings.find_long_strings) < 10 * best(json.loads) + 0.02


def _peak_bytes(f, *args):
    """(the ``BinaryBodyError`` ``f(*args)`` raised or None, peak bytes of Python
    allocations during the call)."""
    tracemalloc.start()
    try:
        f(*args)
        raised = None
    except binary.BinaryBodyError as e:
        raised = e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return raised, peak


@pytest.mark.parametrize("filler", [b"{}", b"[]", b"0", b'""', b'{"":0}'])
def test_header_values_bounded_before_json_loads(shm_env, filler):
    """A 4 MiB header of tiny values (``[{},{},...]``: a million dicts, ~100 MB):
    400 (``json``) from the pre-scan, holding about the header's bytes, not
    what ``json.loads`` would build."""
    n = (4 << 20) // (len(filler) + 1)
    h = b'{"prompt_embeds": ' + hdr(desc()) + b', "x": [' + b",".join([filler] * n) + b"]}"
    raised, peak = _peak_bytes(binary.parse_header, h, "/v1/completions", LIMITS, None)
    assert isinstance(raised, binary.BinaryBodyError), raised
    assert (raised.status, raised.reason) == (400, "json") and "values" in raised.message
    assert peak < 3 * len(h), peak
    headers = [(b"content-type", b"application/octet-stream"),
               (b"inference-header-content-length", str(len(h)).encode())]
    status, msg, _ = _run_middleware(headers, [h])
    assert status == 400 and b"values" in msg


def test_header_bound_counts_structure_not_text(shm_env):
    """Commas, colons and brackets inside strings (a long text part next to the
    embeds) are not values: such a header is served; the same count of
    values outside strings is not."""
    limit = binary.max_json_values()
    text = "a, b: [c], {d}, " * (limit // 4)
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "prompt_embeds", "data": desc()}]}]}
    p = binary.parse_header(hdr(body), "/v1/chat/completions", LIMITS, None)
    assert p.body["messages"][0]["content"][0]["text"] == text
    body["stop"] = [0] * limit
    with pytest.raises(binary.BinaryBodyError) as e:
        binary.parse_header(hdr(body), "/v1/chat/completions", LIMITS, None)
    assert (e.value.status, e.value.reason) == (400, "json")


def test_header_bound_grows_with_the_tensor_cap(shm_env, monkeypatch):
    """``BINARY_MAX_TENSORS`` chat messages of a text part and a
    descriptor each are within the bound; one more tensor is ``too_many``."""
    set_limits(monkeypatch, BINARY_MAX_TENSORS=4000)
    big = dataclasses.replace(LIMITS, max_body_bytes=1 << 30)
    message = {"role": "user", "content": [{"type": "text", "text": "a, b"},
                                           {"type": "prompt_embeds", "data": desc(1)}]}
    body = {"model": "m", "max_tokens": 8, "messages": [message] * 4000}
    assert len(binary.parse_header(hdr(body), "/v1/chat/completions", big, None).specs) == 4000
    body["messages"].append(message)
    with pytest.raises(binary.BinaryBodyError) as e:
        binary.parse_header(hdr(body), "/v1/chat/completions", big, None)
    assert e.value.reason == "too_many"


@pytest.mark.parametrize("depth", [binary.MAX_JSON_DEPTH + 1, 900])
def test_header_depth_bounded(shm_env, depth):
    """Nesting past ``MAX_JSON_DEPTH`` is 400 before parsing (below the
    recursion limit ``json.loads`` took it, and the JSON handed to vLLM
    was as deep); ``MAX_JSON_DEPTH`` itself is served."""
    def nested(d):  # d containers open at once: the body's object and d - 1 in "y"
        return (b'{"prompt_embeds": ' + hdr(desc()) + b', "y": ' + b'{"a": ' * (d - 1)
                + b"0" + b"}" * (d - 1) + b"}")
    ok = nested(binary.MAX_JSON_DEPTH)
    assert len(binary.parse_header(ok, "/v1/completions", LIMITS, None).specs) == 1
    with pytest.raises(binary.BinaryBodyError) as e:
        binary.parse_header(nested(depth), "/v1/completions", LIMITS, None)
    assert (e.value.status, e.value.reason) == (400, "json") and "deep" in e.value.message


@pytest.mark.parametrize("h", [b"]" * 100_000, b'{"a": ' + b"}" * 100_000,
                               b'"' + b"\\" * 100_000, b'["' + b",:" * 100_000])
def test_header_prescan_on_garbage(h):
    """Unbalanced brackets, unterminated strings: 400, the pre-scan's or the parser's."""
    with pytest.raises(binary.BinaryBodyError) as e:
        binary.parse_header(h, "/v1/completions", LIMITS, None)
    assert (e.value.status, e.value.reason) == (400, "json")


def test_binary_headers_count_in_flight(shm_env, monkeypatch):
    """A binary body's JSON header counts against ``INFLIGHT_BYTES``
    from before it is read until the body has arrived (as a JSON body's
    declared bytes do): over the cap a body gets 503 (``busy``) with nothing
    read; the count is back to zero after every kind of end."""
    headers, body = _framed([torch.randn(8, 8)])
    json_len = int(headers[1][1])
    set_limits(monkeypatch, INFLIGHT_BYTES=json_len, BODY_TIMEOUT_S=0.5)
    state = {}

    async def run():
        sent, second = [], []
        msgs = [{"type": "http.request", "body": body[:-100], "more_body": True}]

        async def receive():
            if msgs:
                return msgs.pop(0)
            state["held"] = body_limits.IN_FLIGHT.bytes
            # meanwhile a second body: over the cap, refused before reading it
            await gate.BodyGate(None, [binary.BinaryFormat()])(_scope(headers), _no_receive,
                                                    _appender(second))
            await asyncio.sleep(3600)  # the first client stalls

        async def send(m):
            sent.append(m)

        await gate.BodyGate(None, [binary.BinaryFormat()])(_scope(headers), receive, send)
        return sent, second

    sent, second = asyncio.run(run())
    assert state["held"] == json_len and body_limits.IN_FLIGHT.bytes == 0
    assert sent[0]["status"] == 408 and second[0]["status"] == 503
    assert json.loads(second[1]["body"])["error"]["type"] == "ServiceUnavailable"
    assert counters.stats()["binary_rejected.busy"] == 1
    for case in ("ok", "bad", "short"):  # served, rejected by the header, cut short
        b = body if case == "ok" else body[:-1]
        hs = headers if case != "bad" else [headers[0], (headers[1][0], b"5")]
        status, _, _ = _run_middleware(hs, [b])
        assert status == (200 if case == "ok" else 400)
        assert body_limits.IN_FLIGHT.bytes == 0
    assert os.listdir(shm_env) == []


async def _no_receive():
    raise AssertionError("a body over the in-flight cap must not be read")


def _appender(out):
    async def send(m):
        out.append(m)
    return send


# -- charged by what arrived, deadlines from sizes the server bounds


def test_binary_deadline_ignores_the_clients_content_length():
    """A binary body's deadline is set for its JSON header, then for the tensor
    bytes the validated header says follow: a Content-Length of 19 digits
    buys no time (a body dripping one byte now and then gets 408)."""
    headers, body = _framed([torch.randn(8, 8)])
    json_len = int(headers[1][1])
    huge = headers + [(b"content-length", b"9" * 19)]
    from starlette.datastructures import Headers

    claim = binary.BinaryFormat().claim("/v1/completions", Headers(raw=huge), LIMITS)
    assert claim.length == json_len and claim.in_memory == json_len


def test_json_body_reaching_the_cap_midway_goes_to_vllm_whole(shm_env, monkeypatch):
    """A JSON body charged as it arrives reaches the in-flight cap midway: vLLM's
    own path gets every byte (those read into the body buffer, then the rest),
    counted ``json_fallback.busy``; nothing is left charged."""
    body = json.dumps({"model": "m", "prompt": "",
                       "prompt_embeds": encode_embeds(torch.randn(600, 64))}).encode()
    set_limits(monkeypatch, INFLIGHT_BYTES=len(body) // 2)
    seen = {}

    async def app(scope, receive, send):
        seen["body"] = await read_whole_body(receive)

    msgs = [{"type": "http.request", "body": body[i:i + 8192],
             "more_body": i + 8192 < len(body)} for i in range(0, len(body), 8192)]

    async def receive():
        return msgs.pop(0)

    asyncio.run(gate.BodyGate(app, [json_body.JsonFormat()])(
        _json_scope(len(body)), receive, _ignore))
    assert seen["body"] == body
    assert counters.stats()["json_fallback.busy"] == 1 and body_limits.IN_FLIGHT.bytes == 0
    assert os.listdir(shm_env) == []


def test_a_header_of_empty_objects_is_judged_in_bounded_memory():
    """16 MiB of ``[{}, {}, ...]`` (a binary JSON header at its cap): refused
    after the first bound is passed, in memory a small multiple of
    ``STRUCTURE_PIECE``, not of the header (it was four copies of it)."""
    from vllm._shm_embeds.ext.binary import binary_header

    raw = b"[" + b"{}," * ((binary_header.MAX_JSON_BYTES - 2) // 3) + b"{}]"
    tracemalloc.start()
    try:
        with pytest.raises(binary.BinaryBodyError):
            binary_header.check_json_bounds(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * binary_header.STRUCTURE_PIECE, peak
