# SPDX-License-Identifier: Apache-2.0
"""The base64 JSON ``prompt_embeds`` path and API-server prefix-cache digests.

Unit part (no engine): the body scan, :func:`prepare` against vLLM's own
decode, digests equal to what vLLM's block hasher computes for the same
tensor, hop 1 through vLLM's msgpack carrying them, malformed digests
refused. Integration part (one TP=2 server, only ``VLLM_SHM_EMBEDS=1`` and
the test's dirs): same tokens as the stock path, bad payloads answered as
stock does, the EngineCore hashing no embeds block itself, prefix-cache hits
for a repeated request and a shared prefix, and counters proving the fast
path ran (a silent fallback fails).
"""

import base64
import inspect
import json
import os
import types

import pytest
import torch
from helpers import asgi_peer, delta, encode_embeds, prefix_cache_hits, set_limits, wait_until

from vllm._shm_embeds import counters, handle
from vllm._shm_embeds.ext.json import torch_save
from vllm._shm_embeds.ext.digests import digests
from vllm._shm_embeds.hops import hop1
from vllm._shm_embeds.ext.binary import common, gate
from vllm._shm_embeds.ext.json import json_body, json_strings
from vllm._shm_embeds.ext.binary.placeholders import resolve_placeholder
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.ext.digests import streamed
from vllm._shm_embeds.sites import core_client

HIDDEN = 64


def _ctx(block=16, dtype=torch.float32, max_len=2048):
    mc = types.SimpleNamespace(enable_prompt_embeds=True, dtype=dtype, max_model_len=max_len,
                               get_hidden_size=lambda: HIDDEN)
    return common.ServerContext.from_model_config(mc, block)


def _body(**fields) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 1, **fields}).encode()


def _stock_block_hashes(embeds: torch.Tensor, block: int, extra_tokens: int = 0):
    """vLLM's own block hashes (``Request`` + ``get_request_block_hasher``)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    req = Request("r", None, SamplingParams(max_tokens=4), None, prompt_embeds=embeds,
                  block_hasher=get_request_block_hasher(block, sha256))
    if extra_tokens:
        req.append_output_token_ids(list(range(extra_tokens)))
    return req.block_hashes, req


# -- unit: the body scan and prepare()


def test_find_long_strings_skips_escapes_and_short_strings():
    long = "A" * 5000
    raw = json.dumps({"a": "x", "b": long, "c": "q\"" + long, "d": [long]}).encode()
    spans = json_strings.find_long_strings(raw)
    assert [raw[a:b].decode() for a, b in spans] == [long, long]  # "c" has an escape
    with pytest.raises(json_strings.Fallback):
        json_strings.find_long_strings(b'{"a": "' + b"A" * 5000)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_prepare_equals_vllm_decode_and_digests(shm_env, route):
    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    tensor = torch.randn(100, HIDDEN, dtype=torch.float16)  # cast to fp32, as vLLM does
    b64 = encode_embeds(tensor)
    body = (_body(prompt="p" * 5000, prompt_embeds=b64) if route == "/v1/completions"
            else _body(messages=[{"role": "user", "content": [
                {"type": "text", "text": "t" * 5000},
                {"type": "prompt_embeds", "data": b64}]}]))
    out = json_body.prepare(body, route, _ctx())
    assert out.reason is None
    skeleton = json.loads(out.body)
    assert len(out.body) < 6000  # the embeds are out; the long prompt text stayed
    value = (skeleton["prompt_embeds"] if route == "/v1/completions"
             else skeleton["messages"][0]["content"][1]["data"])
    assert ("p" * 5000 in out.body.decode()) == (route == "/v1/completions")
    # Only this request's context resolves the placeholder.
    assert resolve_placeholder(value) is None
    from vllm._shm_embeds.ext.binary.placeholders import _current

    token = _current.set(out.upload)
    try:
        got = resolve_placeholder(value)
    finally:
        _current.reset(token)
    want = safe_load_prompt_embeds(_ctx().model_config, b64.encode())
    assert torch.equal(got, want) and got.dtype == torch.float32
    assert transfer.is_streamed(got)
    d = digests.attached(got)
    stock, req = _stock_block_hashes(want, 16)
    assert d.digests == b"".join(req._prompt_embeds_per_block_hashes[(i, i + 16)]
                                 for i in range(0, 96, 16)) + d.digests[-32:]
    assert len(d.digests) == 7 * 32  # 6 full blocks and the short tail
    assert counters.stats()["json_tensors"] == 1
    transfer.release_streamed(got)
    del got


BAD = {
    "not-base64": lambda: "not base64!!" * 500,
    "truncated": lambda: encode_embeds(torch.randn(50, HIDDEN))[:-40],
    "wrong-hidden": lambda: encode_embeds(torch.randn(50, HIDDEN + 1)),
    "int-dtype": lambda: encode_embeds(torch.ones(50, HIDDEN, dtype=torch.int64)),
    "zero-tokens": lambda: encode_embeds(torch.randn(0, HIDDEN)) + "A" * 0,
    "pickle-not-a-tensor": lambda: base64.b64encode(
        b"\x80\x04" + b"N" * 6000).decode(),
}


def _in_context(out, fn):
    """``fn()`` with ``out``'s upload as the request served in this context."""
    from vllm._shm_embeds.ext.binary.placeholders import _current

    token = _current.set(out.upload)
    try:
        return fn()
    finally:
        _current.reset(token)


def _answer_of(fn):
    """``("ok", tensor)`` or ``("error", type name, message)`` of ``fn()``."""
    try:
        return ("ok", fn())
    except Exception as e:
        return ("error", type(e).__name__, str(e))


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_payloads_are_answered_as_vllm_after_one_decode(shm_env, name, monkeypatch):
    """A payload vLLM's loader refuses: either judged before any decode (bad
    base64: the original body goes to vLLM), or decoded once by vLLM's own
    loader, whose error the placeholder raises where vLLM would decode it
    (same type, same message; the loader is not called again); nothing is
    written to a segment or hashed."""
    from vllm.renderers import embed_utils

    payload = BAD[name]()
    want = _answer_of(lambda: embed_utils.safe_load_prompt_embeds(
        _ctx().model_config, payload.encode()))
    calls = []
    real = embed_utils.safe_load_prompt_embeds
    monkeypatch.setattr(embed_utils, "safe_load_prompt_embeds",
                        lambda *a: calls.append(1) or real(*a))
    body = _body(prompt="", prompt_embeds=payload)
    out = json_body.prepare(body, "/v1/completions", _ctx())
    assert os.listdir(shm_env) == [] and counters.stats().get("json_tensors", 0) == 0
    if out.upload is None:  # judged before any decode
        assert out.reason in ("base64", "no_embeds") and out.body == body and calls == []
        assert want[0] == "error"
        return
    assert len(calls) == 1 and out.reason in ("rejected", "empty")
    value = json.loads(out.body)["prompt_embeds"]
    got = _answer_of(lambda: _in_context(out, lambda: resolve_placeholder(value)))
    assert got[0] == want[0] and got[1:] == want[1:] if want[0] == "error" else \
        torch.equal(got[1], want[1])
    out.upload.release()


def test_a_large_skeleton_is_parsed_once_by_vllm_not_by_us(shm_env, monkeypatch):
    """A body of embeds plus more than ``JSON_SLACK_BYTES`` of other JSON (e.g. a
    ``[{}, {}, ...]`` skeleton): ``json.loads`` never runs on it here, the
    original body goes to vLLM (which parses it once, as stock does)."""
    loads = []
    monkeypatch.setattr(json_body.json, "loads", lambda *a, **k: loads.append(1) or {})
    t = torch.randn(40, HIDDEN)
    skeleton = [{}] * ((json_body.JSON_SLACK_BYTES // 4) + 1)
    body = _body(prompt="", prompt_embeds=encode_embeds(t), extra=skeleton)
    out = json_body.prepare(body, "/v1/completions", _ctx())
    assert out.reason == "skeleton" and out.upload is None and out.body == body
    assert loads == []
    assert os.listdir(shm_env) == []


def test_prepare_leaves_other_long_strings_and_non_json_alone(shm_env):
    body = _body(prompt="p" * 9000)
    assert json_body.prepare(body, "/v1/completions", _ctx()).reason == "no_embeds"
    bad = body[:-1] + b",,}"
    assert json_body.prepare(bad, "/v1/completions", _ctx()).reason == "not_json"
    # A client's own "digest" fields are just unknown JSON to vLLM: never read.
    t = torch.randn(40, HIDDEN)
    body = _body(prompt="", prompt_embeds=encode_embeds(t),
                 block_sha256={"block": 16, "rows": 40, "digests": "00" * 96})
    out = json_body.prepare(body, "/v1/completions", _ctx())
    [got] = [x for x in out.upload.tensors if x is not None]
    assert digests.attached(got).digests == b"".join(
        __import__("hashlib").sha256(t[i:i + 16].numpy().tobytes()).digest()
        for i in range(0, 40, 16))
    transfer.release_streamed(got)


@pytest.mark.parametrize("late", [False, True])
def test_read_body_fills_a_prefaulted_buffer(monkeypatch, late):
    """Chunks go into the buffer while a thread faults in its next pages, before
    or after they arrive; the bytes are never changed by it."""
    import asyncio
    import threading

    from vllm._shm_embeds.ext.json import json_read

    body = bytes(range(256)) * 1000
    faulted = threading.Event()
    real = json_read.populate

    def slow_populate(*a):
        if late:
            faulted.wait(10)  # every chunk arrives before the pages are faulted in
        return real(*a)

    monkeypatch.setattr(json_read, "populate", slow_populate)

    async def run(pieces, length, disconnect=False):
        msgs = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
                for i, p in enumerate(pieces)]
        if disconnect:
            msgs = msgs[:1] + [{"type": "http.disconnect"}]

        async def receive():
            await asyncio.sleep(0.001)
            if len(msgs) == 1:
                faulted.set()
            return msgs.pop(0)

        try:
            return await json_body.read_body(gate.Body(receive, length), length)
        except gate.Disconnected:
            return None

    pieces = [body[i:i + 7000] for i in range(0, len(body), 7000)]
    got = asyncio.run(run(pieces, len(body)))
    assert not isinstance(got, bytes) and got[:] == body
    got.close()
    assert asyncio.run(run(pieces, len(body), disconnect=True)) is None
    # Not what Content-Length announced: handed back whole, for stock to judge.
    assert asyncio.run(run(pieces, len(body) - 5)) == body
    assert asyncio.run(run(pieces, len(body) + 5)) == body


def _asgi(body: bytes, ctype=b"application/json", path="/v1/completions", cut=False):
    """Run the JSON format (through the body gate) on one request; return what the app saw."""
    import asyncio

    seen = {}

    async def app(scope, receive, send):
        parts, more = [], True
        while more:
            msg = await receive()
            parts.append(msg["body"])
            more = msg.get("more_body", False)
        seen["body"] = b"".join(parts)
        value = json.loads(seen["body"]).get("prompt_embeds")
        try:
            tensor = resolve_placeholder(value) if isinstance(value, str) else None
        except Exception as e:  # vLLM's own decode error, raised where vLLM decodes
            seen["error"] = str(e)
            return
        seen["tensor"] = None if tensor is None else tensor.clone()

    config = types.SimpleNamespace(model_config=_ctx().model_config, cache_config=None)
    scope = {"type": "http", "method": "POST", "path": path,
             "app": types.SimpleNamespace(state=types.SimpleNamespace(vllm_config=config)),
             "headers": [(b"content-type", ctype),
                         (b"content-length", str(len(body)).encode())]}
    msgs = [{"type": "http.request", "body": body[i:i + 4096],
             "more_body": i + 4096 < len(body)} for i in range(0, len(body), 4096)]
    if cut:
        msgs = msgs[:2] + [{"type": "http.disconnect"}]

    async def receive():
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(msg):
        pass

    asyncio.run(gate.BodyGate(app, [json_body.JsonFormat()])(scope, receive, send))
    return seen


def test_middleware_takes_json_and_passes_the_rest(shm_env):
    t = torch.randn(60, HIDDEN)
    body = _body(prompt="", prompt_embeds=encode_embeds(t))
    seen = _asgi(body)
    assert torch.equal(seen["tensor"], t) and len(seen["body"]) < 300
    assert counters.stats()["json_tensors"] == 1
    # Not JSON content, another route, or an upload cut short: untouched / nothing.
    assert _asgi(body, ctype=b"text/plain")["body"] == body
    assert _asgi(body, path="/v1/embeddings")["body"] == body
    assert _asgi(body, cut=True) == {}
    assert counters.stats()["json_fallback.disconnect"] == 1
    # A payload vLLM's loader refuses: decoded once; vLLM's decode site raises
    # the loader's own error; nothing written.
    payload = BAD["wrong-hidden"]()
    with pytest.raises(Exception) as want:
        from vllm.renderers.embed_utils import safe_load_prompt_embeds

        safe_load_prompt_embeds(_ctx().model_config, payload.encode())
    seen = _asgi(_body(prompt="", prompt_embeds=payload))
    assert seen["error"] == str(want.value) and len(seen["body"]) < 300
    assert counters.stats()["json_fallback.rejected"] == 1
    assert counters.stats()["json_tensors"] == 1
    assert os.listdir(shm_env) == []


def test_middleware_falls_back_on_its_own_errors(shm_env, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("bug")

    monkeypatch.setattr(json_body, "prepare", broken)
    body = _body(prompt="", prompt_embeds=encode_embeds(torch.randn(60, HIDDEN)))
    assert _asgi(body) == {"body": body, "tensor": None}
    assert counters.stats()["json_fallback.error"] == 1


# -- unit: decoding straight into the segment (the plain case) or by vLLM's loader


def _rezip(b64: str, edit) -> str:
    """The ``torch.save`` zip inside ``b64`` rewritten entry by entry:
    ``edit(name, data)`` returns ``[(name, data, compress_type), ...]``."""
    import io
    import zipfile

    src = zipfile.ZipFile(io.BytesIO(base64.b64decode(b64)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            for name, data, kind in edit(info.filename, src.read(info)):
                dst.writestr(zipfile.ZipInfo(name), data, compress_type=kind)
    return base64.b64encode(out.getvalue()).decode()


def _same(name, data):
    import zipfile

    return [(name, data, zipfile.ZIP_STORED)]


def _patched(b64: str, record: str, patch) -> str:
    """``patch(raw, info)`` applied to the decoded ``torch.save`` zip, where
    ``info`` is the ``zipfile`` entry of ``record`` (e.g. ``"data/0"``)."""
    import io
    import zipfile

    raw = bytearray(base64.b64decode(b64))
    [info] = [i for i in zipfile.ZipFile(io.BytesIO(bytes(raw))).infolist()
              if i.filename.endswith("/" + record)]
    patch(raw, info)
    return base64.b64encode(bytes(raw)).decode()


def _break_local_header(raw, info):
    raw[info.header_offset + 1] ^= 0xFF  # miniz refuses to extract the record


def _directory_bit(raw, info):
    """The central directory marks the record a directory: miniz extracts
    nothing (vLLM's loader returns uninitialized memory, a torch bug)."""
    import struct

    at = raw.find(b"PK\x01\x02" + raw[info.header_offset + 4:info.header_offset + 6])
    while raw[at + 46:at + 46 + struct.unpack_from("<H", raw, at + 28)[0]] != \
            info.filename.encode():
        at = raw.find(b"PK\x01\x02", at + 4)
    struct.pack_into("<I", raw, at + 38, 0x10)


def _first_data_byte(value):
    def patch(raw, info):
        at = info.header_offset  # local header: 30 bytes, then the name and extra field
        raw[at + 30 + int.from_bytes(raw[at + 26:at + 28], "little")
            + int.from_bytes(raw[at + 28:at + 30], "little")] = value
    return patch


def _storage_numel_minus_one(b64: str) -> str:
    """The pickle's storage holds one element less than the tensor needs."""
    raw = base64.b64decode(b64)
    numel = b"M" + (1000 * HIDDEN).to_bytes(2, "little")  # BININT2 in data.pkl
    assert raw.count(numel) == 1
    return base64.b64encode(raw.replace(numel, b"M" + (1000 * HIDDEN - 1).to_bytes(
        2, "little"))).decode()


def _direct_count():
    return counters.stats().get("json_direct_tensors", 0)


@pytest.mark.parametrize("shape", [(60, HIDDEN), (1000, HIDDEN), (1, 1000, HIDDEN)])
def test_plain_payload_is_decoded_straight_into_the_segment(shm_env, shape):
    """One plain tensor of the model's dtype: decoded chunk by chunk into the
    segment (counted), equal to vLLM's decode, digests equal to stock's; the
    1000-row payloads are longer than the head and tail decoded first."""
    import hashlib

    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    tensor = torch.randn(*shape)
    b64 = encode_embeds(tensor)
    assert (len(b64) > torch_save.HEAD_CHARS + torch_save.TAIL_CHARS) == (shape[-2] == 1000)
    out = json_body.prepare(_body(prompt="", prompt_embeds=b64), "/v1/completions", _ctx())
    assert out.reason is None and _direct_count() == 1
    [got] = [t for t in out.upload.tensors if t is not None]
    want = safe_load_prompt_embeds(_ctx().model_config, b64.encode())
    assert torch.equal(got, want) and got.shape == want.shape
    rows = want.shape[0]
    assert digests.attached(got).digests == b"".join(
        hashlib.sha256(want[i:i + 16].numpy().tobytes()).digest() for i in range(0, rows, 16))
    transfer.release_streamed(got)


def _big():
    return torch.randn(1000, HIDDEN)


NOT_PLAIN = {  # vLLM's loader takes these (or rejects them) itself
    "fp16-cast": lambda: encode_embeds(_big().half()),
    "transposed": lambda: encode_embeds(torch.randn(HIDDEN, 1000).t()),
    "view-of-larger": lambda: encode_embeds(torch.randn(2000, HIDDEN)[:1000]),
    "parameter": lambda: encode_embeds(torch.nn.Parameter(_big(), requires_grad=False)),
    "deflated": lambda: _rezip(encode_embeds(_big()), lambda n, d: [
        (n, d, __import__("zipfile").ZIP_DEFLATED if "/data/" in n else 0)]),
    "extra-record": lambda: _rezip(encode_embeds(_big()), lambda n, d: _same(n, d) + (
        _same(n.replace("data/0", "data/1"), d) if n.endswith("data/0") else [])),
    "big-endian": lambda: _rezip(encode_embeds(_big()), lambda n, d: _same(
        n, b"big" if n.endswith("/byteorder") else d)),
    "4d": lambda: encode_embeds(torch.randn(1, 1, 1000, HIDDEN)),
    # Payloads a meta-device load or zipfile would read otherwise than vLLM's
    # loader does (found by review and fuzzing).
    "local-header": lambda: _patched(encode_embeds(_big()), "data/0", _break_local_header),
    "small-record-header": lambda: _patched(encode_embeds(_big()), ".storage_alignment",
                                            _break_local_header),
    "directory-bit": lambda: _patched(encode_embeds(_big()), "data/0", _directory_bit),
    "serialization-id-not-utf8": lambda: _patched(
        encode_embeds(_big()), ".data/serialization_id", _first_data_byte(0xFF)),
    "negative-view": lambda: encode_embeds(torch._neg_view(_big())),
    "storage-numel": lambda: _storage_numel_minus_one(encode_embeds(_big())),
    "wrong-hidden": lambda: encode_embeds(torch.randn(1000, HIDDEN + 1)),
}


@pytest.mark.parametrize("name", sorted(NOT_PLAIN))
def test_anything_else_goes_to_vllms_loader(shm_env, name):
    """Not the plain case: nothing decoded by us, and the outcome is exactly
    vLLM's loader's (the same tensor, or the body back for stock to reject)."""
    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    b64 = NOT_PLAIN[name]()
    try:
        want = safe_load_prompt_embeds(_ctx().model_config, b64.encode())
    except Exception as e:
        want, error = None, str(e)
    body = _body(prompt="", prompt_embeds=b64)
    out = json_body.prepare(body, "/v1/completions", _ctx())
    assert _direct_count() == 0
    if name == "directory-bit":  # vLLM's loader answers with uninitialized memory:
        for t in out.upload.tensors:  # nothing to compare
            if t is not None:
                transfer.release_streamed(t)
    elif want is None:  # the loader's own error, raised where vLLM decodes
        assert out.reason == "rejected" and list(map(str, out.upload.errors.values())) == [
            error]
        assert counters.stats().get("json_tensors", 0) == 0
    else:
        [got] = [t for t in out.upload.tensors if t is not None]
        # Bit for bit (a byteswapped payload holds NaNs), as values (a view
        # with the negative bit set reads as its negation).
        want = want.resolve_neg().contiguous()
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8),
                                                       want.view(torch.uint8))
        transfer.release_streamed(got)
    process.collect()
    assert os.listdir(shm_env) == []


def _spoil(b64: str, at: int, text: str) -> str:
    return b64[:at] + text + b64[at + len(text):]


_DATA_OFFSET = 64 * 11  # where torch.save puts the tensor bytes (checked in the test)

SPOILED = {  # (where, what) in a payload longer than the head and tail
    "bad-char-mid-data": (lambda n: n // 2, "!"),
    "padding-mid-data": (lambda n: n // 2 // 4 * 4 + 2, "=="),
    "padding-end-of-head": (lambda n: torch_save.HEAD_CHARS - 2, "=="),
    # "==" ending the characters of the 1st / 2nd 1 MiB chunk: valid padding
    # for that chunk alone. The 1st chunk's bytes end with a whole base64
    # quantum; the 2nd's end inside one, which the 3rd chunk decodes again.
    "padding-chunk-edge-1": (lambda n: -(-(_DATA_OFFSET + (1 << 20)) // 3) * 4 - 2, "=="),
    "padding-chunk-edge-2": (lambda n: -(-(_DATA_OFFSET + (2 << 20)) // 3) * 4 - 2, "=="),
    "bad-char-in-tail": (lambda n: n - 100, "*"),
}


@pytest.mark.parametrize("name", sorted(SPOILED))
def test_spoiled_base64_is_rejected_as_vllm_rejects_it(shm_env, name, monkeypatch):
    """A bad character or padding anywhere (head, tensor bytes, a 4 MiB
    chunk's edge, tail): judged before any decode (``valid_base64``), the
    body goes back for stock to reject, nothing is written or hashed, and
    vLLM's loader indeed rejects it."""
    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    monkeypatch.setattr(torch_save, "DECODE_CHUNK_BYTES", 1 << 20)  # several chunks
    good = encode_embeds(torch.randn(16000, HIDDEN))  # 4 MB: four chunks
    n = len(good)
    head, tail = good[:torch_save.HEAD_CHARS], good[n - torch_save.TAIL_CHARS:]
    outline = torch_save._Outline(n // 4 * 3, base64.b64decode(head),
                                  (n - torch_save.TAIL_CHARS) // 4 * 3, base64.b64decode(tail))
    assert torch_save.plain_tensor_layout(_ctx(max_len=16000), outline)[3] == _DATA_OFFSET
    where, text = SPOILED[name]
    b64 = _spoil(good, where(len(good)), text)
    with pytest.raises(ValueError):
        safe_load_prompt_embeds(_ctx(max_len=16000).model_config, b64.encode())
    body = _body(prompt="", prompt_embeds=b64)
    out = json_body.prepare(body, "/v1/completions", _ctx(max_len=16000))
    assert out.reason == "base64" and out.body == body
    assert counters.stats().get("segments_created", 0) == 0 and _direct_count() == 0
    process.collect()
    assert os.listdir(shm_env) == []
    # The same payload unspoiled takes the direct path, in several chunks.
    out = json_body.prepare(_body(prompt="", prompt_embeds=good), "/v1/completions", _ctx(max_len=16000))
    assert _direct_count() == 1
    for t in out.upload.tensors:
        if t is not None:
            transfer.release_streamed(t)


@pytest.mark.parametrize("dtype,fail_at", [(torch.float32, 3), (torch.float16, 1)])
def test_no_space_midway_gives_the_body_back_and_leaves_nothing(shm_env, monkeypatch, dtype,
                                                                fail_at):
    """ENOSPC on a write into the segment: the third 64 KiB chunk of the direct
    decode (the model's dtype), the one write of vLLM's loader path (fp16,
    cast). The body goes back to vLLM unchanged, counted as ``no_space``, and
    no segment is left."""
    import errno

    writes = []
    real = streamed.StreamedSegment.write

    def full(self, data):
        writes.append(len(data))
        if len(writes) == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, data)

    monkeypatch.setattr(streamed.StreamedSegment, "write", full)
    monkeypatch.setattr(torch_save, "DECODE_CHUNK_BYTES", 1 << 16)
    body = _body(prompt="", prompt_embeds=encode_embeds(torch.randn(2000, HIDDEN).to(dtype)))
    out = json_body.prepare(body, "/v1/completions", _ctx())
    assert out.reason == "no_space" and len(writes) == fail_at and _direct_count() == 0
    if dtype == torch.float32:  # nothing decoded: vLLM gets the very body
        assert out.body == body and out.upload is None
    else:  # vLLM gets the tensor its loader made here, in private memory: no second decode
        [t] = [t for t in out.upload.tensors if t is not None]
        assert not transfer.is_streamed(t) and t.dtype == torch.float32
        out.upload.release()
    process.collect()
    assert os.listdir(shm_env) == []


def test_outline_holds_only_head_and_tail():
    f = torch_save._Outline(100, b"h" * 10, 90, b"t" * 10)
    assert f.read(10) == b"h" * 10
    f.seek(-10, 2)
    assert f.read() == b"t" * 10
    f.seek(5)
    with pytest.raises(torch_save._NotHeld):
        f.read(10)


# -- unit: digests through hop 1 and into vLLM's block hasher


def test_hop1_carries_digests_and_engine_hashes_nothing(shm_env):
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    tensor = torch.randn(50, HIDDEN)
    body = _body(prompt="", prompt_embeds=encode_embeds(tensor))
    [sent] = [t for t in json_body.prepare(body, "/v1/completions", _ctx()).upload.tensors
              if t is not None]
    enc = MsgpackEncoder()
    consumer = hop1.HandleOOBConsumer(enc.oob_tensor_consumer)
    enc.oob_tensor_consumer = consumer
    req = EngineCoreRequest(
        request_id="r1", prompt_token_ids=None, mm_features=None, sampling_params=None,
        pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
        data_parallel_rank=None, prompt_embeds=sent)
    frames = core_client.ArmingEncoder(enc, consumer).encode(req)
    del sent, req
    got = MsgpackDecoder(EngineCoreRequest, oob_tensor_provider=hop1.HandleOOBProvider(None)
                         ).decode(frames).prompt_embeds
    assert torch.equal(got, tensor) and digests.attached(got) is not None

    orig = kcu._gen_prompt_embeds_extra_hash_keys
    from vllm._shm_embeds import sites

    site = sites.get("embeds_block_hash")
    # vLLM's own function, not a wrapper a real ``sites.apply`` earlier in
    # this process left there (wrapping twice would count twice).
    kcu._gen_prompt_embeds_extra_hash_keys = site.wrap(inspect.unwrap(orig))
    try:
        ours, _ = _stock_block_hashes(got, 16, extra_tokens=20)
        before = counters.stats()
        stock, _ = _stock_block_hashes(tensor.clone(), 16, extra_tokens=20)
        after = counters.stats()
    finally:
        kcu._gen_prompt_embeds_extra_hash_keys = orig
    assert ours == stock and len(ours) == 4  # 70 tokens: the 4th block mixes in output
    assert before.get("hash_engine_blocks", 0) == 0  # the engine hashed no embeds
    assert before["hash_reused_blocks"] == 4 and before["hash_adopted_tensors"] == 1
    assert after["hash_engine_blocks"] == 4  # a tensor without digests: vLLM hashes
    assert before["hash_sent_tensors"] == 1
    del got
    process.collect()


def test_binary_pieces_and_hop1_copies_hashed_as_vllm_does(shm_env):
    """A body hashed piece by piece as it arrives, and a
    tensor hashed while hop 1 copies it, give vLLM's own digests; the copy's
    digests ride along to the EngineCore."""
    tensor = torch.randn(70, HIDDEN)
    _, req = _stock_block_hashes(tensor.clone(), 16)
    want = [req._prompt_embeds_per_block_hashes[(i, i + 16)] for i in range(0, 64, 16)]
    raw = tensor.view(torch.uint8).reshape(-1).numpy().tobytes()
    hasher = digests.StreamHasher(70, HIDDEN * 4, 16, group_bytes=3 * 16 * HIDDEN * 4)
    for i in range(0, len(raw), 1000):  # pieces that straddle blocks and groups
        hasher.feed(raw[i:i + 1000])
    with pytest.raises(ValueError):
        hasher.feed(b"x")
    d = hasher.result().result()
    assert [d.digest(i, i + 16) for i in range(0, 64, 16)] == want
    assert d.rows == 70 and len(d.digests) == 5 * 32  # 4 full blocks and the tail
    assert digests.hash_tensor(tensor, 16).result() == d
    assert digests.hash_tensor_here(tensor, 16) == d  # a region's, on its own thread
    before = counters.stats()
    for _ in range(20):  # groups finishing together join exactly once
        assert digests.hash_tensor(tensor, 16).result() == d
    assert counters.stats()["hash_api_tensors"] - before["hash_api_tensors"] == 20
    before = counters.stats()
    consumer = hop1.HandleOOBConsumer(None, block_tokens=16)
    consumer.arm(tensor)
    meta = consumer(tensor)
    h = handle.SharedTensorHandle.from_meta(meta[hop1.META_KEY])
    got = hop1.HandleOOBProvider(None)(h.dtype, h.shape, meta)
    assert torch.equal(got, tensor) and digests.attached(got) == d
    s = {k: v - before.get(k, 0) for k, v in counters.stats().items()}
    assert s["hash_api_tensors"] == 1 and s["hash_sent_tensors"] == 1, s
    assert s["hash_adopted_tensors"] == 1, s
    del got
    process.collect()


def test_malformed_or_foreign_digests_are_refused(shm_env):
    t = torch.randn(40, HIDDEN)
    digests.adopt_meta(t, {"block_sha256": {"block": 16, "rows": 40, "digests": b"x" * 64}})
    digests.adopt_meta(t, {"block_sha256": {"block": "a", "rows": 40, "digests": b""}})
    assert digests.attached(t) is None and counters.stats()["hash_rejected_meta"] == 2
    # A tensor our code did not write and hash sends no digests at hop 1.
    assert digests.handover_meta(t) == {}
    # Digests of another shape never apply.
    d = digests.BlockDigests(16, 40, b"\0" * 96)
    digests.attach(t[:30], d)
    assert digests.attached(t[:30]) is None


# -- integration: the suite's main server (TP=2, shm on; conftest.py)

MAX_LEN = 2048


def _post(server, route, body, stock=False):
    """POST ``body`` as JSON; ``stock=True`` sends it chunked (no Content-Length),
    which the middleware leaves to vLLM's own JSON handling: the stock path
    for the same payload on the same server."""
    import requests

    raw = json.dumps(body).encode()
    data = iter([raw[i:i + 65536] for i in range(0, len(raw), 65536)]) if stock else raw
    return requests.post(server["url"] + route, data=data, timeout=300,
                         headers={"Content-Type": "application/json"})


def _ids(n, seed):
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed))


KW = {"model": "tiny", "max_tokens": 6, "temperature": 0.0}


def _chat(b64):
    return {**KW, "messages": [{"role": "user", "content": [
        {"type": "prompt_embeds", "data": b64}]}]}


@pytest.mark.integration
@pytest.mark.online
def test_same_tokens_as_stock_by_the_fast_path(server):
    embeds = server["weights"][_ids(300, 1)].contiguous()
    b64 = encode_embeds(embeds)
    for route, body, text in (
        ("/v1/completions", {**KW, "prompt": "", "prompt_embeds": b64},
         lambda r: r["choices"][0]["text"]),
        ("/v1/chat/completions", _chat(b64),
         lambda r: r["choices"][0]["message"]["content"]),
    ):
        before = server.totals()
        fast = _post(server, route, body)
        assert fast.status_code == 200, fast.text
        d = delta(before, server.totals())
        # The fast path ran: decoded here, handed over with its digests, and
        # the EngineCore took them instead of hashing (no silent fallback).
        assert d.get("json_tensors") == 1 and d.get("hop1_handover_tensors") == 1, d
        assert d.get("json_direct_tensors") == 1, d  # decoded straight into the segment
        assert d.get("hash_sent_tensors") == 1 and d.get("hash_adopted_tensors") == 1, d
        assert not any(k.startswith("json_fallback") for k in d), d
        stock = _post(server, route, body, stock=True)
        assert stock.status_code == 200, stock.text
        assert text(fast.json()) == text(stock.json())


_prefix_hits = prefix_cache_hits


@pytest.mark.integration
@pytest.mark.online
def test_engine_hashes_no_embeds_and_prefix_cache_hits(server):
    w = server["weights"]
    base = _ids(600, 2)
    first = w[base].contiguous()
    shared = w[torch.cat([base[:400], _ids(200, 3)])].contiguous()

    def hits(body, stock=False):
        before = _prefix_hits(server)
        r = _post(server, "/v1/completions", body, stock=stock)
        assert r.status_code == 200, r.text
        return _prefix_hits(server) - before

    before = server.totals("engine")
    body = {**KW, "prompt": "", "prompt_embeds": encode_embeds(first)}
    assert hits(body) == 0
    again = hits(body)
    prefix = hits({**body, "prompt_embeds": encode_embeds(shared)})
    d = delta(before, server.totals("engine"))
    assert d.get("hash_engine_blocks", 0) == 0, d  # never hashed embeds itself
    assert d.get("hash_reused_blocks", 0) > 0 and d.get("hash_adopted_tensors") == 3, d
    assert again >= 512  # every full block of the 600 rows (block size <= 128)
    assert 256 <= prefix <= 400  # the shared 400 rows, in whole blocks
    # vLLM's own JSON decode (the body sent chunked): hop 1 copies the tensor
    # and hashes it meanwhile; it finds the blocks the fast path cached. (The
    # EngineCore hashing a tensor itself and finding them: test_binary.py.)
    before = server.totals()
    stock = hits(body, stock=True)
    d = delta(before, server.totals())
    assert d.get("hash_engine_blocks", 0) == 0 and d.get("hash_api_tensors") == 1, d
    assert d.get("json_tensors", 0) == 0 and d.get("hop1_shm_tensors") == 2, d
    assert stock == again


def _bad_bodies(hidden):
    from helpers import BAD_PAYLOADS

    for name, make in sorted(BAD_PAYLOADS.items()):
        payload = make(hidden)
        yield name, "/v1/completions", {**KW, "prompt": "", "prompt_embeds": payload}
        yield name, "/v1/chat/completions", _chat(payload)


@pytest.mark.integration
@pytest.mark.online
def test_bad_payloads_answered_as_stock(server):
    """Every bad payload of test_online: the same status and message as the stock
    path for the same bytes, a 4xx, and nothing left in shared memory."""
    from helpers import ours_in

    hidden = server["weights"].shape[1]
    before = server.totals("client")
    before_all = server.totals()
    for name, route, body in _bad_bodies(hidden):
        fast = _post(server, route, body)
        stock = _post(server, route, body, stock=True)
        assert 400 <= fast.status_code < 500, (name, route, fast.text)
        assert fast.status_code == stock.status_code, (name, route)
        ef, es = fast.json()["error"], stock.json()["error"]
        assert (ef["type"], ef["message"]) == (es["type"], es["message"]), (name, route)
    d = delta(before, server.totals("client"))
    # The big bad payloads went through our decode and were given back.
    assert d.get("json_fallback.rejected", 0) >= 8, d
    # Given back when each request ended, which may be just after its answer:
    # once as many segments went as this test made, none may be left (counted
    # from this test's start: an earlier test's aborted request may have made
    # a segment that its EngineCore never adopted and the sender removed).
    def unlinked():
        d = delta(before_all, server.totals())
        return d.get("segments_unlinked", 0) >= d.get("segments_created", 0)

    wait_until(unlinked, 30, lambda: f"every segment unlinked: {server.totals()}")
    assert ours_in(server["seg_dir"]) == []


@pytest.mark.integration
@pytest.mark.online
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_inf_never_hurt_the_server(server, value):
    bad = torch.randn(40, server["weights"].shape[1])
    bad[3, 5] = value
    r = _post(server, "/v1/completions", {**KW, "prompt": "", "prompt_embeds": encode_embeds(bad)})
    assert r.status_code < 500, r.text
    ok = _post(server, "/v1/completions", {**KW, "prompt": "hello"})
    assert ok.status_code == 200


@pytest.mark.integration
@pytest.mark.online
def test_client_cannot_supply_digests(server):
    """Digest-like fields in a body change nothing: the engine uses only the
    digests the API server computed (a prefix hit needs the real bytes)."""
    w = server["weights"]
    real = w[_ids(300, 5)].contiguous()
    other = w[_ids(300, 6)].contiguous()
    fake = {"block_sha256": {"block": 16, "rows": 300, "digests": "00" * 32 * 19},
            "shm_embeds": {"name": "x"}}
    r = _post(server, "/v1/completions", {**KW, "prompt": "", "prompt_embeds": encode_embeds(real)})
    assert r.status_code == 200
    # Other bytes with the "digests" of the first: no cache hit.
    before = _prefix_hits(server)
    r = _post(server, "/v1/completions",
              {**KW, **fake, "prompt": "", "prompt_embeds": encode_embeds(other)})
    assert r.status_code == 200, r.text
    assert _prefix_hits(server) == before


def test_stalled_json_body_gets_408(shm_env, monkeypatch):
    """A large JSON body that stops sending for ``BODY_TIMEOUT_S`` seconds
    gets 408 (its buffer freed), instead of holding memory."""
    import asyncio
    import time

    set_limits(monkeypatch, BODY_TIMEOUT_S=0.3)
    body = _body(prompt="", prompt_embeds=encode_embeds(torch.randn(60, HIDDEN)))
    config = types.SimpleNamespace(model_config=_ctx().model_config, cache_config=None)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "app": types.SimpleNamespace(state=types.SimpleNamespace(vllm_config=config)),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    receive, send, sent = asgi_peer([{"type": "http.request", "body": body[:4096],
                                      "more_body": True}])

    async def never(scope, receive, send):
        raise AssertionError("a stalled body reached the app")

    t0 = time.monotonic()
    asyncio.run(gate.BodyGate(never, [json_body.JsonFormat()])(scope, receive, send))
    assert time.monotonic() - t0 < 2
    assert sent[0]["status"] == 408 and json.loads(sent[1]["body"])["error"]["code"] == 408
    assert counters.stats()["json_fallback.timeout"] == 1


# -- work follows the bytes that arrived (docs/security.md)


def _saved(t: torch.Tensor) -> str:
    """base64 of ``torch.save(t)`` as it is (a view stays a view)."""
    import io

    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("rows", [2049, 1 << 22])
def test_a_stride0_view_longer_than_the_model_is_never_made_dense(shm_env, rows):
    """``torch.ones(1, H).expand(T, H)`` with T > ``--max-model-len``: a few
    hundred bytes on the wire, ``T x H`` dense (1 GiB at 2**22 rows). Judged
    before any copy: vLLM gets the loader's view (it refuses the length),
    nothing is made dense, written or hashed."""
    payload = _saved(torch.ones(1, HIDDEN).expand(rows, HIDDEN))
    assert len(payload) < 4000
    out = json_body.prepare(_body(prompt="", prompt_embeds=payload), "/v1/completions", _ctx())
    assert out.reason == "too_long"
    [t] = [t for t in out.upload.tensors if t is not None]
    assert t.shape == (rows, HIDDEN) and t.untyped_storage().nbytes() == HIDDEN * 4
    assert not transfer.is_streamed(t) and os.listdir(shm_env) == []
    assert counters.stats().get("segments_created", 0) == 0
    assert counters.stats().get("json_fallback.too_long", 0) == 0  # the caller counts
    out.upload.release()


def test_a_stride0_view_within_the_model_goes_to_vllm_as_it_is(shm_env):
    """A stride-0 view vLLM may accept (rows within ``--max-model-len``): not
    made dense by us either (``not_dense``); vLLM gets the loader's view."""
    payload = _saved(torch.randn(1, HIDDEN).expand(2000, HIDDEN))
    out = json_body.prepare(_body(prompt="", prompt_embeds=payload), "/v1/completions", _ctx())
    assert out.reason == "not_dense"
    [t] = [t for t in out.upload.tensors if t is not None]
    assert t.stride() == (0, 1) and not transfer.is_streamed(t)
    assert os.listdir(shm_env) == [] and counters.stats().get("segments_created", 0) == 0
    out.upload.release()


@pytest.mark.parametrize("last", ["bad-base64", "loader-refuses", "too-long"])
def test_a_late_failure_costs_no_write_hash_or_second_decode(shm_env, last, monkeypatch):
    """Three payloads, the last one refused: judged before the others are
    decoded; nothing written or hashed; no payload decoded twice (ours, then
    vLLM's on what the skeleton still holds as base64)."""
    from vllm.renderers import embed_utils

    good = [encode_embeds(torch.randn(300, HIDDEN)),  # plain: the direct decode
            encode_embeds(torch.randn(300, HIDDEN).half())]  # vLLM's loader (a cast)
    bad = {"bad-base64": encode_embeds(torch.randn(300, HIDDEN))[:-8] + "!!!!AAAA",
           "loader-refuses": encode_embeds(torch.randn(300, HIDDEN + 1)),
           "too-long": encode_embeds(torch.randn(2049, HIDDEN))}[last]
    calls = []
    real = embed_utils.safe_load_prompt_embeds
    monkeypatch.setattr(embed_utils, "safe_load_prompt_embeds",
                        lambda *a: calls.append(1) or real(*a))
    body = _body(prompt="", prompt_embeds=[*good, bad])
    out = json_body.prepare(body, "/v1/completions", _ctx())
    assert os.listdir(shm_env) == [] and _direct_count() == 0
    assert counters.stats().get("segments_created", 0) == 0
    assert counters.stats().get("hash_api_blocks", 0) == 0
    if out.upload is None:  # refused before any decode: vLLM decodes each once
        assert out.body == body and calls == []
        return
    left = sum(isinstance(v, str) and not v.startswith("shm-embeds-binary:")
               for v in json.loads(out.body)["prompt_embeds"])
    assert len(calls) + left <= 3  # each payload decoded at most once in all
    out.upload.release()
