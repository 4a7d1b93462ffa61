# SPDX-License-Identifier: Apache-2.0
"""Binary-body framing without a server: header parsing and validation,
the streamed segment and its hand-over at hop 1, placeholder resolution, the
middleware over a fake ASGI app, and the client's framing."""

import asyncio
import dataclasses
import errno
import json
import os
import time

import pytest
import torch
from helpers import held_by, set_limits

from vllm._shm_embeds import config, counters, handle, private_dir
from vllm._shm_embeds.files import segment
from vllm._shm_embeds.ext.digests import digests
from vllm._shm_embeds.hops import hop1, hop2
from vllm._shm_embeds.ext.binary import binary, common, gate, placeholders
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.ext.digests import streamed

LIMITS = common.ServerContext(hidden_size=8, max_model_len=16, dtype=torch.float32,
                            enable_prompt_embeds=True, max_body_bytes=16 * 8 * 4)


def desc(t=4, h=8, dt="FP32", size=None):
    item = {"FP32": 4, "FP16": 2, "BF16": 2}.get(dt, 4)
    return {"datatype": dt, "shape": [t, h],
            "parameters": {"binary_data_size": t * h * item if size is None else size}}


def hdr(body):
    return json.dumps(body).encode()


def test_completions_header_gets_placeholders():
    h = hdr({"model": "m", "prompt_embeds": [desc(), desc(2, dt="BF16")]})
    p = binary.parse_header(h, "/v1/completions", LIMITS, len(h) + 128 + 32)
    assert [s.shape for s in p.specs] == [(4, 8), (2, 8)]
    assert [s.dtype for s in p.specs] == [torch.float32, torch.bfloat16]
    assert p.body["prompt_embeds"] == [f"shm-embeds-binary:{p.token}.0",
                                       f"shm-embeds-binary:{p.token}.1"]
    assert p.body["model"] == "m"


def test_chat_header_in_document_order():
    body = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "prompt_embeds", "data": desc(3)}]},
        {"role": "user", "content": [{"type": "prompt_embeds", "data": desc(5)}]}]}
    p = binary.parse_header(hdr(body), "/v1/chat/completions", LIMITS, None)
    assert [s.shape[0] for s in p.specs] == [3, 5]
    assert p.body["messages"][1]["content"][0]["data"].endswith(".1")


BAD = {
    "datatype": ({"prompt_embeds": desc(dt="INT64")}, 400),
    "not_2d": ({"prompt_embeds": {"datatype": "FP32", "shape": [32],
                                  "parameters": {"binary_data_size": 128}}}, 400),
    "shape": ({"prompt_embeds": {"datatype": "FP32", "shape": [4, True],
                                 "parameters": {"binary_data_size": 16}}}, 400),
    "hidden_size": ({"prompt_embeds": desc(4, 9)}, 400),
    "too_long": ({"prompt_embeds": desc(17)}, 400),
    "empty": ({"prompt_embeds": desc(0)}, 400),
    "size": ({"prompt_embeds": desc(size=127)}, 400),
    "descriptor": ({"prompt_embeds": "AAAA"}, 400),
    "no_tensor": ({"prompt": "x"}, 400),
    "too_large": ({"prompt_embeds": [desc(16), desc(16)]}, 413),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_headers(name):
    body, status = BAD[name]
    with pytest.raises(binary.BinaryBodyError) as e:
        binary.parse_header(hdr(body), "/v1/completions", LIMITS, None)
    assert (e.value.reason, e.value.status) == (name, status)
    assert "/dev/shm" not in e.value.message and "vllm-shm-embeds" not in e.value.message


# Every descriptor field of a type the module does not expect is a 400 naming
# the field, never a TypeError (an unhashable ``"datatype": ["FP32"]`` must not
# reach ``in DATATYPES``: that was a 500 and a traceback).
FIELD_TYPES = {
    "datatype": [["FP32"], {"FP32": 1}, 1, 1.5, True, None, [], {}],
    "shape": [{"0": 4}, "4,8", 4, 4.0, None, [4.0, 8], [[4], [8]], [4, None],
              [10 ** 30, 8], [4, -(10 ** 30)], [float("inf"), 8]],
    "parameters": [[128], "128", 128, None, {"binary_data_size": [128]},
                   {"binary_data_size": 128.0}, {"binary_data_size": True},
                   {"binary_data_size": {"n": 128}}, {"binary_data_size": 10 ** 40},
                   {"binary_data_size": float("nan")}],
}


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in FIELD_TYPES.items()
                                         for v in vs])
@pytest.mark.parametrize("route", [common.COMPLETIONS, common.CHAT])
def test_descriptor_field_of_any_type_is_400(field, value, route):
    d = desc() | {field: value}
    body = ({"prompt_embeds": [desc(), d]} if route == common.COMPLETIONS else
            {"messages": [{"role": "user", "content": [
                {"type": "prompt_embeds", "data": d}]}]})
    with pytest.raises(binary.BinaryBodyError) as e:
        binary.parse_header(hdr(body), route, LIMITS, None)
    assert e.value.status == 400 and e.value.reason in (
        field, "size", "not_2d", "hidden_size", "too_long", "empty"), e.value.reason
    assert len(e.value.message) < 300


def test_content_length_checked_before_allocating():
    h = hdr({"prompt_embeds": desc()})
    for cl, reason in ((len(h) + 127, "short"), (len(h) + 129, "extra")):
        with pytest.raises(binary.BinaryBodyError) as e:
            binary.parse_header(h, "/v1/completions", LIMITS, cl)
        assert e.value.reason == reason
    bad_json = b'{"prompt_embeds": '
    with pytest.raises(binary.BinaryBodyError, match="JSON"):
        binary.parse_header(bad_json, "/v1/completions", LIMITS, None)
    off = common.ServerContext(8, 16, torch.float32, False, 512)
    with pytest.raises(binary.BinaryBodyError, match="enable-prompt-embeds"):
        binary.parse_header(h, "/v1/completions", off, None)


def test_frame_header_length():
    ok = [(b"content-type", b"application/octet-stream"),
          (b"inference-header-content-length", b"10"), (b"content-length", b"20")]
    assert binary.frame_header_length(ok) == (10, 20)
    assert binary.frame_header_length(ok[1:]) is None  # no octet-stream: stock
    assert binary.frame_header_length(ok[::2]) is None  # no header: stock
    with pytest.raises(binary.BinaryBodyError) as e:
        binary.frame_header_length([ok[0], (ok[1][0], b"21"), ok[2]])
    assert e.value.reason == "header_too_long"
    with pytest.raises(binary.BinaryBodyError):
        binary.frame_header_length([ok[0], (ok[1][0], b"-1")])


def test_streamed_segment_handover_and_release(shm_env):
    t = torch.randn(40, 8)
    seg = streamed.StreamedSegment(torch.float32, (40, 8))
    raw = t.view(torch.uint8).reshape(-1).numpy().tobytes()
    for i in range(0, len(raw), 100):
        seg.write(raw[i:i + 100])
    got = seg.finish()
    assert torch.equal(got, t) and transfer.is_streamed(got)
    assert transfer.is_streamed(got.view(40, 8)) and not transfer.is_streamed(got[1:])
    consumer = hop1.HandleOOBConsumer(None)
    consumer.arm(got)
    meta = consumer(got)[hop1.META_KEY]
    assert not transfer.is_streamed(got)  # handed over: the peer owns it now
    assert counters.stats().get("hop1_handover_tensors") == 1
    adopted = transfer.adopt_tensor(handle.SharedTensorHandle.from_meta(meta))
    assert torch.equal(adopted, t)
    del got, adopted
    process.shutdown()  # the adopter's name
    # Not handed over: the name goes with the last tensor over the mapping.
    seg = streamed.StreamedSegment(torch.bfloat16, (4, 8))
    seg.write(bytes(64))
    view = seg.finish()[1:]
    assert len(os.listdir(shm_env)) == 1
    del view
    process.collect()  # the next safe point (the API server's reaper runs one every 0.1 s)
    assert os.listdir(shm_env) == []
    # Aborted mid-way: nothing left.
    seg = streamed.StreamedSegment(torch.float16, (4, 8))
    seg.write(bytes(10))
    seg.abort()
    assert os.listdir(shm_env) == []
    seg = streamed.StreamedSegment(torch.float16, (1, 1))
    with pytest.raises(ValueError):
        seg.write(bytes(3))
    seg.abort()


def _holds(directory):
    """What this process maps or opens inside ``directory`` (``helpers.held_by``)."""
    return held_by(os.getpid(), directory)


def test_request_end_lets_go_of_the_pages(shm_env):
    """Once a request has ended, the API server holds none of
    its segment's pages, even while something still holds the tensor object
    (the peer's mapping, here the adopter's, is then the only one)."""
    t = torch.randn(2048, 8)
    seg = streamed.StreamedSegment(torch.float32, tuple(t.shape))
    seg.write(t.view(torch.uint8).reshape(-1).numpy().tobytes())
    got = seg.finish()
    assert torch.equal(got, t) and len(_holds(shm_env)) == 1  # one mapping, no fd
    consumer = hop1.HandleOOBConsumer(None)
    consumer.arm(got)
    meta = consumer(got)[hop1.META_KEY]  # handed over
    name = os.listdir(shm_env)
    assert transfer.release_streamed(got)  # the request ended
    assert _holds(shm_env) == [] and os.listdir(shm_env) == name  # the peer's now
    assert got.shape == t.shape and not got.any()  # still valid memory: zeros
    adopted = transfer.adopt_tensor(handle.SharedTensorHandle.from_meta(meta))
    assert torch.equal(adopted, t)  # the peer's bytes were not touched
    assert not transfer.release_streamed(got)  # once only
    del adopted
    process.shutdown()
    # Not handed over (rejected by vLLM): unlinked and let go at once, by the
    # request's upload, which also drops its digests (they no longer hold).
    seg = streamed.StreamedSegment(torch.float32, (4, 8))
    seg.write(bytes(128))
    kept = seg.finish()
    digests.attach(kept, digests.hash_tensor(kept, 2).result())
    placeholders.Upload("ab" * 16, [kept]).release()
    assert os.listdir(shm_env) == [] and _holds(shm_env) == [] and kept.shape == (4, 8)
    assert digests.attached(kept) is None


def test_placeholder_resolves_only_in_its_own_context():
    t = torch.ones(2, 8)
    up = placeholders.Upload("ab" * 16, [t])
    ph = f"shm-embeds-binary:{'ab' * 16}.0"
    assert placeholders.resolve_placeholder(ph.encode()) is None  # no binary body here
    tok = placeholders._current.set(up)
    try:
        assert placeholders.resolve_placeholder(ph.encode()) is t
        assert placeholders.resolve_placeholder(ph.replace("ab", "cd", 1)) is None
        assert placeholders.resolve_placeholder(ph[:-1] + "1") is None
        assert placeholders.resolve_placeholder(b"\xff") is None
    finally:
        placeholders._current.reset(tok)


def _scope(headers, limits=LIMITS):
    """An ASGI scope of a POST /v1/completions to an app serving ``limits``' model."""
    state = type("S", (), {})()
    state.vllm_config = type("C", (), {})()
    mc = type("M", (), {"max_model_len": limits.max_model_len, "dtype": limits.dtype,
                        "enable_prompt_embeds": limits.enable_prompt_embeds,
                        "get_hidden_size": lambda self: limits.hidden_size})()
    state.vllm_config.model_config = mc
    state.vllm_config.cache_config = type("CC", (), {
        "enable_prefix_caching": bool(limits.hash_block_tokens),
        "block_size": limits.hash_block_tokens})()
    return {"type": "http", "method": "POST", "path": "/v1/completions",
            "headers": headers, "app": type("A", (), {"state": state})()}


def _run_middleware(headers, chunks, limits=LIMITS, disconnect=False):
    """Drive the middleware with a fake downstream app; returns (status, body, seen)."""
    seen = {}

    async def app(scope, receive, send):
        msg = await receive()
        seen["body"] = json.loads(msg["body"])
        # What vLLM would see while the request runs (the originals are let
        # go of when it ends: "views").
        seen["views"] = [placeholders.resolve_placeholder(v) for v in
                         (seen["body"]["prompt_embeds"]
                          if isinstance(seen["body"]["prompt_embeds"], list)
                          else [seen["body"]["prompt_embeds"]])]
        seen["tensors"] = [t.clone() for t in seen["views"]]
        seen["digests"] = [digests.attached(t) for t in seen["views"]]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    scope = _scope(headers, limits)
    msgs = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    msgs.append({"type": "http.disconnect"} if disconnect else
                {"type": "http.request", "body": b"", "more_body": False})
    out = []

    async def receive():
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(m):
        out.append(m)

    asyncio.run(gate.BodyGate(app, [binary.BinaryFormat()])(scope, receive, send))
    status = out[0]["status"] if out else None
    body = b"".join(m.get("body", b"") for m in out[1:])
    return status, body, seen


def _framed(tensors, extra=b""):
    h = hdr({"model": "m", "prompt_embeds": [desc(t.shape[0], t.shape[1],
             {torch.float32: "FP32", torch.float16: "FP16"}[t.dtype]) for t in tensors]})
    data = b"".join(t.view(torch.uint8).reshape(-1).numpy().tobytes() for t in tensors)
    headers = [(b"content-type", b"application/octet-stream"),
               (b"inference-header-content-length", str(len(h)).encode())]
    return headers, h + data + extra


def test_middleware_streams_into_segments(shm_env):
    ts = [torch.randn(5, 8), torch.randn(3, 8).half()]
    headers, body = _framed(ts)
    chunks = [body[i:i + 7] for i in range(0, len(body), 7)]  # chunked, no Content-Length
    before = counters.stats()
    status, _, seen = _run_middleware(headers, chunks)
    assert status == 200
    assert torch.equal(seen["tensors"][0], ts[0])
    assert torch.equal(seen["tensors"][1], ts[1].float())  # cast like the JSON path
    s = {k: v - before.get(k, 0) for k, v in counters.stats().items()}
    assert s["binary_bodies"] == 1 and s["binary_converted_bytes"] == 3 * 8 * 4
    assert s["copied_bytes"] == 5 * 8 * 4 + 3 * 8 * 2 + 3 * 8 * 4
    assert os.listdir(shm_env) == []  # nothing handed over: released at the end
    assert _holds(shm_env) == [] and not any(v.any() for v in seen["views"])


def test_middleware_hashes_blocks_as_they_arrive(shm_env):
    """With prefix caching on, a binary body's block digests
    are computed while it arrives (a cast tensor is left to the EngineCore)."""
    limits = dataclasses.replace(LIMITS, hash_block_tokens=4)
    ts = [torch.randn(10, 8), torch.randn(3, 8).half()]
    headers, body = _framed(ts)
    before = counters.stats()
    status, _, seen = _run_middleware(headers, [body[i:i + 7] for i in range(0, len(body), 7)],
                                      limits=limits)
    assert status == 200 and torch.equal(seen["tensors"][0], ts[0])
    assert seen["digests"][0] == digests.hash_tensor(ts[0], 4).result()
    assert seen["digests"][1] is None  # cast to fp32: vLLM hashes it
    s = {k: v - before.get(k, 0) for k, v in counters.stats().items()}
    assert s["hash_api_blocks"] == 2 * 3 and s["hash_api_tensors"] == 2, s  # + hash_tensor
    assert os.listdir(shm_env) == []


@pytest.mark.parametrize("case", ["short", "extra", "disconnect"])
def test_middleware_bad_streams_leave_nothing(shm_env, case):
    headers, body = _framed([torch.randn(5, 8)], extra=b"x" if case == "extra" else b"")
    if case == "short":
        body = body[:-3]
    status, msg, _ = _run_middleware(headers, [body[:-10], body[-10:]],
                                     disconnect=case == "disconnect")
    if case == "disconnect":
        body = body[:-10]
        status, msg, _ = _run_middleware(headers, [body], disconnect=True)
        assert status is None
    else:
        assert status == 400 and case.replace("short", "cut short") in msg.decode()
        assert json.loads(msg)["error"]["code"] == 400
    assert os.listdir(shm_env) == []
    assert counters.stats().get(f"binary_rejected.{case}") >= 1


def test_client_frame_uses_tensor_memory():
    import shm_embeds_client as sec

    t = torch.randn(6, 8).to(torch.bfloat16)
    headers, pieces, length = sec.frame({"model": "m", "prompt_embeds": t})
    n = int(headers["Inference-Header-Content-Length"])
    assert len(pieces[0]) == n and length == n + t.nbytes
    assert pieces[1].obj is not None and bytes(pieces[1]) == t.view(torch.uint8).numpy().tobytes()
    p = binary.parse_header(pieces[0], "/v1/completions",
                            common.ServerContext(8, 16, torch.float32, True, 1 << 20), length)
    assert p.specs[0].dtype == torch.bfloat16
    with pytest.raises(ValueError):
        sec.frame({"prompt_embeds": torch.ones(3, dtype=torch.int64)})


# -- under load: no refusal stock would serve, stalled bodies, budget


@pytest.mark.parametrize("when", ["create", "midway"])
def test_no_room_takes_the_stock_way_not_507(shm_env, monkeypatch, when):
    """ENOSPC when the segment is made, or after part of the body was written:
    the body is received into private memory (the bytes written so far are
    read back), served, counted; nothing left in shared memory."""
    ts = [torch.randn(8, 8), torch.randn(6, 8)]
    headers, body = _framed(ts)
    if when == "create":
        def full(*a, **kw):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(binary, "StreamedSegment", full)
    else:
        real = streamed.StreamedSegment.write

        def write(self, data):  # the second tensor's segment fills up midway
            if self.nbytes == 6 * 8 * 4 and self.filled + len(data) > 100:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(self, data)
        monkeypatch.setattr(streamed.StreamedSegment, "write", write)
    before = counters.stats()
    status, _, seen = _run_middleware(headers, [body[i:i + 97] for i in range(0, len(body), 97)])
    assert status == 200
    assert [torch.equal(a, b) for a, b in zip(seen["tensors"], ts)] == [True, True]
    d = {k: v - before.get(k, 0) for k, v in counters.stats().items()}
    assert d["binary_bodies"] == 1
    assert d["binary_fallback.no_space"] == (2 if when == "create" else 1)
    assert not any(k.startswith("binary_rejected") for k in d)
    del seen
    assert os.listdir(shm_env) == []


def test_over_budget_takes_the_stock_way(shm_env, monkeypatch):
    """A tensor that would take our segments over VLLM_SHM_EMBEDS_MAX_BYTES is
    received privately (reason ``budget``); below it, shared memory as usual."""
    monkeypatch.setenv("VLLM_SHM_EMBEDS_MAX_BYTES", str(8 * 8 * 4 + 100))
    ts = [torch.randn(8, 8), torch.randn(6, 8)]  # the first fits, then no more room
    headers, body = _framed(ts)
    before = counters.stats()
    status, _, seen = _run_middleware(headers, [body])
    assert status == 200 and all(torch.equal(a, b) for a, b in zip(seen["tensors"], ts))
    d = {k: v - before.get(k, 0) for k, v in counters.stats().items()}
    assert d["binary_fallback.budget"] == 1 and d["segments_created"] == 1
    del seen
    assert os.listdir(shm_env) == []
    # hop 1's copy of a private tensor checks the budget too
    monkeypatch.setenv("VLLM_SHM_EMBEDS_MAX_BYTES", "1")
    with pytest.raises(OSError) as e:
        transfer.share_tensor(torch.randn(4, 4))
    assert segment.fallback_reason(e.value) == "budget"
    assert os.listdir(shm_env) == []


@pytest.mark.parametrize("fs", ["dev_shm", "own_tmpfs"])
def test_budget_counts_what_requests_hold(shm_env, monkeypatch, tmp_path, fs):
    """The budget counts every segment a request holds, also after
    every TP rank mapped it. Its name stays until vLLM frees the request (so
    on ``/dev/shm``, shared with everything else, the names are the count);
    on a file system of its own everything in use counts, which also covers
    the TP workers' mappings in the step after the request was freed."""
    import contextlib

    from conftest import _tmpfs

    with (_tmpfs(tmp_path / "seg", "4m") if fs == "own_tmpfs"
          else contextlib.nullcontext(shm_env)) as directory:
        monkeypatch.setenv("VLLM_SHM_EMBEDS_DIR", directory)
        monkeypatch.setenv("VLLM_SHM_EMBEDS_MAX_BYTES", str(1 << 20))
        seg_dir = config.shm_dir()  # a fresh tmpfs is mode 1777: a private directory in it
        held = transfer.adopt_tensor(transfer.share_tensor(torch.randn(512, 256)))  # 512 KiB
        h = hop2.externalize(held, readers=1)
        reader = transfer.open_tensor(h, 0)  # a TP rank's mapping
        assert process.collect() == 0 and len(os.listdir(seg_dir)) == 1  # still named
        with pytest.raises(OSError) as e:  # 512 KiB more would pass the 1 MiB budget
            transfer.share_tensor(torch.randn(640, 256))
        assert segment.fallback_reason(e.value) == "budget"
        assert transfer.release_adopted(held)  # vLLM freed the request: the name goes
        assert os.listdir(seg_dir) == []
        if fs == "own_tmpfs":  # the TP rank has not dropped it yet: still counted
            with pytest.raises(OSError) as e:
                transfer.share_tensor(torch.randn(640, 256))
            assert segment.fallback_reason(e.value) == "budget"
        del reader  # the TP rank's next step: its pages come back
        # the census's count from a walk that overlapped a write may count it
        # twice (on the safe side) until the next walk: take an exact one
        process.current().census(seg_dir).settle()
        transfer.discard_shared(transfer.share_tensor(torch.randn(640, 256)))
        del held, h
        process.collect()
        private_dir.remove_made()


def test_stalled_body_gets_408_and_frees_its_segment(shm_env, monkeypatch):
    set_limits(monkeypatch, BODY_TIMEOUT_S=0.3)
    headers, body = _framed([torch.randn(8, 8)])
    state = {}

    async def run():
        sent = []
        msgs = [{"type": "http.request", "body": body[:-100], "more_body": True}]

        async def receive():
            if msgs:
                return msgs.pop(0)
            state["held"] = os.listdir(shm_env)  # the upload's segment, while it waits
            await asyncio.sleep(3600)  # the client stalls

        async def send(m):
            sent.append(m)

        scope = _scope(headers)
        t0 = time.monotonic()
        await gate.BodyGate(None, [binary.BinaryFormat()])(scope, receive, send)
        return sent, time.monotonic() - t0

    sent, took = asyncio.run(run())
    assert sent[0]["status"] == 408 and took < 2
    assert json.loads(sent[1]["body"])["error"]["code"] == 408
    assert state["held"] != [] and os.listdir(shm_env) == []
    assert counters.stats()["binary_rejected.timeout"] == 1
