# SPDX-License-Identifier: Apache-2.0
"""Fuzz targets (hypothesis) for the HTTP body paths.

* the binary middleware as an ASGI app: random chunking, disconnects, bytes
  of the JSON header and of the framing headers: only a 4xx answer or
  exactly one downstream call; no file left in the segment directory and
  no descriptor left open;
* the JSON scanner: its view equals ``json.loads``' and its Python steps are
  bounded by the body's length (CPU per byte);
* the small parsers ``frame_header_length`` and ``parse_header``: only
  their declared error;
* every descriptor field (and the places descriptors sit in) holding any
  JSON value (lists, objects, floats, huge integers, booleans, null, nested):
  ``parse_header`` raises only ``BinaryBodyError`` (or succeeds), and the
  middleware answers 4xx (or calls vLLM once) with no exception escaping it
  (one that does is uvicorn's "Exception in ASGI application" traceback).

Profile "ci" (tests/conftest.py) bounds the examples; ``SHM_EMBEDS_FUZZ=long``
is the long run.
"""

import asyncio
import json
import os

import torch
from helpers import new_fds, open_fds
from hypothesis import given
from hypothesis import strategies as st
from test_binary_framing import LIMITS, _framed, _scope, desc, hdr

from vllm._shm_embeds.ext.binary import binary, common, gate
from vllm._shm_embeds.ext.json import json_strings


def _drive(headers, chunks, end: str, path: str = "/v1/completions"):
    """Run the binary middleware on a POST to ``path``; ``end``: "done",
    "disconnect" or "eof" (the client sends nothing more, the body ends
    short). Returns (responses, downstream calls); an exception the
    middleware lets out propagates."""
    calls, out = [], []

    async def app(scope, receive, send):
        msg = await receive()
        calls.append(json.loads(msg["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    msgs = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    if end == "done":
        msgs.append({"type": "http.request", "body": b"", "more_body": False})
    elif end == "disconnect":
        msgs.append({"type": "http.disconnect"})

    async def receive():
        if msgs:
            return msgs.pop(0)
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(m):
        out.append(m)

    scope = _scope(headers) | {"path": path}
    asyncio.run(gate.BodyGate(app, [binary.BinaryFormat()])(scope, receive, send))
    return [m["status"] for m in out if m["type"] == "http.response.start"], calls


@st.composite
def _binary_requests(draw):
    n = draw(st.integers(1, 3))
    tensors = [torch.randn(draw(st.integers(1, 4)), 8) for _ in range(n)]
    headers, body = _framed(tensors)
    if draw(st.booleans()):  # flip bytes of the JSON header or the tensor bytes
        body = bytearray(body)
        for _ in range(draw(st.integers(1, 4))):
            body[draw(st.integers(0, len(body) - 1))] = draw(st.integers(0, 255))
        body = bytes(body)
    if draw(st.booleans()):
        headers = [headers[0], (headers[1][0], draw(st.binary(max_size=6)))]
    if draw(st.booleans()):
        headers = headers + [(b"content-length", str(draw(
            st.integers(0, len(body) + 8))).encode())]
    cut = draw(st.integers(0, len(body)))
    cuts = sorted(draw(st.lists(st.integers(0, cut), max_size=6)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, cut])]
    end = draw(st.sampled_from(["done", "disconnect", "eof"]))
    return headers, chunks, end


@given(req=_binary_requests())
def test_fuzz_binary_middleware(shm_env, req):
    headers, chunks, end = req
    ok_headers, ok_body = _framed([torch.randn(2, 8)])
    assert _drive(ok_headers, [ok_body], "done")[0] == [200]  # lazily made fds, threads
    before = open_fds()
    statuses, calls = _drive(headers, chunks, end)
    if calls:
        assert len(calls) == 1 and statuses == [200]
    elif statuses:
        assert len(statuses) == 1 and 400 <= statuses[0] < 500, statuses
    else:
        assert end == "disconnect"
    assert os.listdir(shm_env) == []
    assert new_fds(before) == {}


_KEY = st.text(max_size=6)
_STR = st.one_of(st.text(max_size=12), st.text(alphabet='ab"\\\n\u00e9\U0001f600', max_size=40),
                 st.text(alphabet="AB+/=", min_size=8, max_size=64))
_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), _STR),
                     lambda c: st.one_of(st.lists(c, max_size=5),
                                         st.dictionaries(_KEY, c, max_size=5)),
                     max_leaves=25)


def _strings(x):
    if isinstance(x, str):
        yield x
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)
    elif isinstance(x, dict):
        for k, v in x.items():
            yield k
            yield from _strings(v)


def _swap(x, names):
    if isinstance(x, str):
        return names.get(x, x)
    if isinstance(x, list):
        return [_swap(v, names) for v in x]
    if isinstance(x, dict):
        return {names.get(k, k): _swap(v, names) for k, v in x.items()}
    return x


@given(doc=_JSON, ascii_only=st.booleans(), min_len=st.integers(1, 16))
def test_fuzz_json_scanner(doc, ascii_only, min_len):
    """Spans are exactly the escape-free strings of ``min_len`` bytes or more,
    in place; the Python steps are at most ``len // min_len + 2``."""
    raw = json.dumps(doc, ensure_ascii=ascii_only).encode()
    spans, steps = json_strings.scan_strings(raw, min_len)
    assert steps <= len(raw) // min_len + 2
    names = [f"@{i}@" for i in range(len(spans))]
    back = {n: raw[a:b].decode() for n, (a, b) in zip(names, spans)}
    assert _swap(json.loads(json_strings.build_skeleton(raw, spans, names)), back) == json.loads(raw)
    want = [s for s in _strings(doc)
            if "\\" not in (e := json.dumps(s, ensure_ascii=ascii_only)[1:-1])
            and len(e.encode()) >= min_len]
    assert sorted(back.values()) == sorted(want)


@given(raw=st.binary(max_size=300), min_len=st.integers(1, 8))
def test_fuzz_json_scanner_any_bytes(raw, min_len):
    """On any bytes: spans or ``Fallback``, steps bounded."""
    try:
        spans, steps = json_strings.scan_strings(raw, min_len)
    except json_strings.Fallback as f:
        assert f.reason == "unterminated"
        return
    assert steps <= len(raw) // min_len + 2
    assert all(0 < a <= b <= len(raw) for a, b in spans)


_HEADER_VALUES = st.one_of(st.binary(max_size=8), st.integers(-5, 1 << 70).map(
    lambda i: str(i).encode()), st.sampled_from([b"\xb2", b" 7 ", b"0x10", b"1e3"]))


@given(hlen=st.one_of(st.none(), _HEADER_VALUES), clen=st.one_of(st.none(), _HEADER_VALUES),
       ctype=st.sampled_from([b"application/octet-stream", b"Application/Octet-Stream; x=1",
                              b"application/json", b"\xff"]))
def test_fuzz_frame_header_length(hlen, clen, ctype):
    headers = [(b"content-type", ctype)]
    if hlen is not None:
        headers.append((b"inference-header-content-length", hlen))
    if clen is not None:
        headers.append((b"content-length", clen))
    try:
        got = binary.frame_header_length(headers)
    except binary.BinaryBodyError as e:
        assert e.status in (400, 413)
        return
    if got is not None:
        n, length = got
        assert 0 <= n <= binary.MAX_JSON_BYTES and (length is None or n <= length)


_DESC = st.one_of(st.builds(desc, st.integers(-2, 20), st.sampled_from([8, 9]),
                            st.sampled_from(["FP32", "FP16", "BF16", "INT8"])),
                  _JSON)


@given(body=st.one_of(st.binary(max_size=200),
                      st.builds(lambda d, extra: hdr({"prompt_embeds": d, **extra}),
                                st.one_of(_DESC, st.lists(_DESC, max_size=4)),
                                st.dictionaries(_KEY, _JSON, max_size=3)),
                      st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n)),
       route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       clen=st.one_of(st.none(), st.integers(0, 5000)))
def test_fuzz_parse_header(body, route, clen):
    try:
        parsed = binary.parse_header(body, route, LIMITS, clen)
    except binary.BinaryBodyError as e:
        assert e.status in (400, 413)
        return
    assert parsed.specs and sum(s.nbytes for s in parsed.specs) <= LIMITS.max_body_bytes


# Any JSON value: also floats (NaN, infinities), integers
# far past int64 and below zero, and containers of them.
_ANY = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(10 ** 60), 10 ** 60),
              st.floats(), st.sampled_from(["FP32", "BF16", "", "fp32"]), _STR),
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(_KEY, c, max_size=4)),
    max_leaves=12)


_FIELDS = ("datatype", "shape", "shape[0]", "shape[1]", "parameters", "binary_data_size",
           "no datatype", "no shape", "no parameters", "descriptor")
_PLACES = ("prompt_embeds", "messages", "message", "content", "part", "type")


@st.composite
def _descriptor(draw):
    """A valid descriptor with a few (often no) fields replaced by any JSON
    value or removed, or the descriptor itself any value."""
    d = desc(draw(st.integers(1, 4)), 8, draw(st.sampled_from(["FP32", "FP16", "BF16"])))
    for field in draw(st.sets(st.sampled_from(_FIELDS), max_size=3)):
        if field.startswith("no "):
            d.pop(field[3:], None)
        elif field.startswith("shape["):
            shape = d.get("shape")
            if isinstance(shape, list) and len(shape) > int(field[6]):
                shape[int(field[6])] = draw(_ANY)
        elif field == "binary_data_size" and isinstance(d.get("parameters"), dict):
            d["parameters"][field] = draw(_ANY)
        elif field == "descriptor":
            return draw(_ANY)
        elif field in d:
            d[field] = draw(_ANY)
    return d


@st.composite
def _descriptor_bodies(draw):
    """``(route, header body)`` with descriptors where vLLM reads them, and a
    few (often none) of the containers around them any JSON value."""
    descs = draw(st.lists(_descriptor(), min_size=1, max_size=3))
    places = draw(st.sets(st.sampled_from(_PLACES), max_size=2))

    def at(place, value):
        return draw(_ANY) if place in places else value
    if draw(st.booleans()):
        embeds = descs if len(descs) > 1 or draw(st.booleans()) else descs[0]
        return common.COMPLETIONS, {"model": "m", "prompt_embeds": at("prompt_embeds", embeds)}
    parts = [at("part", {"type": at("type", "prompt_embeds"), "data": d}) for d in descs]
    message = at("message", {"role": "user", "content": at("content", parts)})
    return common.CHAT, {"model": "m", "messages": at("messages", [message])}


@given(req=_descriptor_bodies(), clen=st.one_of(st.none(), st.integers(0, 2000)))
def test_fuzz_descriptor_fields(req, clen):
    """Any JSON value in any descriptor field: the module's own error, or success."""
    route, body = req
    try:
        parsed = binary.parse_header(hdr(body), route, LIMITS, clen)
    except binary.BinaryBodyError as e:
        assert 400 <= e.status < 500 and len(e.message) < 400
        return
    assert parsed.specs and all(s.shape[1] == LIMITS.hidden_size for s in parsed.specs)


@given(req=_descriptor_bodies(), data=st.data(), end=st.sampled_from(["done", "eof"]))
def test_fuzz_middleware_descriptor_fields(shm_env, req, data, end):
    """The middleware on those headers: a 4xx, or one call of vLLM's app;
    nothing escapes it, nothing is left in the segment directory."""
    route, body = req
    h = hdr(body)
    try:  # the tensor bytes the header asks for, if it is valid
        need = sum(s.nbytes for s in binary.parse_header(h, route, LIMITS, None).specs)
    except binary.BinaryBodyError:
        need = 0
    tail = data.draw(st.sampled_from([need, need, max(0, need - 1), need + 1])
                     | st.integers(0, 600))
    headers = [(b"content-type", b"application/octet-stream"),
               (b"inference-header-content-length", str(len(h)).encode())]
    statuses, calls = _drive(headers, [h, bytes(tail)], end, path=route)
    if calls:
        assert len(calls) == 1 and statuses == [200] and tail == need
    else:
        assert len(statuses) == 1 and 400 <= statuses[0] < 500, statuses
    assert os.listdir(shm_env) == []


# -- the binary JSON header's bounds, judged piece by piece

_TEXT = st.text(alphabet='{}[],:"\\ab', max_size=6)  # strings full of structure characters
_JSON = st.recursive(st.none() | st.integers() | _TEXT,
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(_TEXT, c, max_size=4),
                     max_leaves=40)


def _depth(structure: str) -> int:
    depth = deepest = 0
    for ch in structure:
        depth += 1 if ch in "[{" else -1 if ch in "]}" else 0
        deepest = max(deepest, depth)
    return deepest


@given(v=_JSON, piece=st.integers(1, 16), indent=st.sampled_from([None, 1]))
def test_header_bounds_piece_by_piece(monkeypatch, v, piece, indent):
    """``check_json_bounds`` on generated JSON whose strings are full of quotes,
    backslashes and brackets, judged ``piece`` bytes at a time: it refuses
    exactly the headers nested deeper than the bound, or with more values and
    keys (as the structure counts them) than the limit, or, past the cheap
    count, with more than twice the limit of ``"``; it raises nothing else."""
    from vllm._shm_embeds.ext.binary import binary_header as bh

    monkeypatch.setattr(bh, "STRUCTURE_PIECE", piece)
    monkeypatch.setattr(bh, "MAX_JSON_DEPTH", 4)
    monkeypatch.setattr(bh, "max_json_values", lambda: 20)
    raw = json.dumps(v, indent=indent).encode()
    structure = _structure(v)  # from the object: no string of it can be misread
    depth = _depth(structure)
    estimate = 1 + sum(structure.count(c) for c in "[{,:")
    cheap = raw.count(b"{") + raw.count(b"[")
    passes_cheap = cheap <= 4 and (len(raw) <= 20 or 1 + cheap + raw.count(b",")
                                   + raw.count(b":") <= 20)
    try:
        bh.check_json_bounds(raw)
        refused = False
    except bh.BinaryBodyError:
        refused = True
    want = not passes_cheap and (depth > 4 or estimate > 20 or raw.count(b'"') > 40)
    assert refused == want, (raw, depth, estimate)


def _structure(v) -> str:
    """The structure characters of ``json.dumps(v)`` outside its strings."""
    if isinstance(v, list):
        return "[" + ",".join(_structure(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(":" + _structure(x) for x in v.values()) + "}"
    return ""
