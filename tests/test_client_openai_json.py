# SPDX-License-Identifier: Apache-2.0
"""The client's OpenAI JSON body (``shm_embeds_client.openai_json``): the same
JSON as the stock ``base64.b64encode(torch.save bytes)`` body, decoded by
vLLM's own server-side function to the tensor sent, bit for bit. No engine."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import io
import json
import types

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shm_embeds_client as sec
from shm_embeds_client import openai_json
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.renderers.embed_utils import safe_load_prompt_embeds

ENCODERS = [openai_json._b2a]
try:
    import pybase64

    ENCODERS.append(pybase64.b64encode)
except ImportError:  # pragma: no cover
    pass

RESERVED = {"model", "prompt_embeds", "route", "tensor", "messages"}
json_scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**63)
                | st.floats(allow_nan=False) | st.text())
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(), inner, max_size=3), max_leaves=8)
# Other fields ride along as given; a field vLLM's request model types (``n``,
# ``max_tokens``...) would fail its validation with an arbitrary value, so none is drawn.
_TYPED = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
fields_st = st.dictionaries(st.text().filter(lambda k: k not in RESERVED | _TYPED),
                            json_values, max_size=4)


def _stock_b64(t: torch.Tensor) -> str:
    """What the OpenAI SDK user writes (vLLM's examples)."""
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def _decode(b64: str | bytes, like: torch.Tensor) -> torch.Tensor:
    """vLLM's own server-side decode (``safe_load_prompt_embeds``), for a model
    of the tensor's hidden size and dtype (so it casts nothing)."""
    cfg = types.SimpleNamespace(enable_prompt_embeds=True, dtype=like.dtype,
                                get_hidden_size=lambda: like.shape[1])
    return safe_load_prompt_embeds(cfg, b64.encode() if isinstance(b64, str) else b64)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))  # NaN payloads and -0.0 included


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(openai_json.DTYPES))
    rows, cols = draw(st.integers(0, 9)), draw(st.integers(1, 17))
    kind = draw(st.sampled_from(["own", "transposed", "sliced", "strided"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    base = torch.randn(rows + 3, cols * 2 + 1, generator=gen).to(dtype)
    flat = base.view(-1)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]).to(dtype)
    n = min(len(specials), flat.numel())
    flat[:n] = specials[:n]
    if kind == "own":
        return base[:rows, :cols].clone()
    if kind == "transposed":
        return base[:cols, :rows].clone().t()
    if kind == "sliced":  # contiguous, but a view into a bigger storage
        return base.view(-1)[cols:cols + rows * cols].view(rows, cols)
    return base[1:rows + 1, ::2][:, :cols]


@contextlib.contextmanager
def _encoding(chunk: int, encoder=None, slack: int | None = None):
    """The builder with another chunk size (encoder, first allocation's
    slack: 0 makes the body grow past it), restored after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(openai_json, "_CHUNK", chunk)
        if slack is not None:
            mp.setattr(openai_json, "_SLACK", slack)
        if encoder is not None:
            mp.setattr(openai_json, "_encode", encoder)
        yield


def _compact(t: torch.Tensor) -> torch.Tensor:
    """The tensor the stock way would save to send the same values."""
    own = (t.is_contiguous() and t.storage_offset() == 0
           and t.untyped_storage().nbytes() == t.nbytes)
    return t if own else t.clone(memory_format=torch.contiguous_format)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=tensors(), more=st.lists(tensors(), max_size=2), as_list=st.booleans(),
       fields=fields_st, model=st.text(),
       chunk=st.sampled_from([3, 6, 9, 48, openai_json._CHUNK]),
       encoder=st.sampled_from(ENCODERS), slack=st.sampled_from([0, None]))
def test_completions_body_is_the_stock_json(t, more, as_list, fields, model, chunk, encoder,
                                            slack):
    sent = [t, *more] if as_list else t
    with _encoding(chunk, encoder, slack):
        body = openai_json.openai_json_body(model, sent, **fields)
    assert isinstance(body, bytearray)
    stock_embeds = ([_stock_b64(_compact(x)) for x in sent] if as_list
                    else _stock_b64(_compact(t)))
    assert json.loads(body) == {"model": model, **fields, "prompt_embeds": stock_embeds}
    # As vLLM's server reads it: its request model, then its decode.
    req = CompletionRequest.model_validate({**json.loads(body), "model": "m"})
    got = req.prompt_embeds if as_list else [req.prompt_embeds]
    for g, want in zip(got, sent if as_list else [t], strict=True):
        _assert_same(_decode(g, want), want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=tensors(), fields=fields_st, text=st.text(), with_messages=st.booleans(),
       chunk=st.sampled_from([3, 48, openai_json._CHUNK]))
def test_chat_body_is_the_stock_json(t, fields, text, with_messages, chunk):
    def msgs(data):
        return [{"role": "system", "content": text},
                {"role": "user", "content": [{"type": "text", "text": text},
                                             {"type": "prompt_embeds", "data": data}]}]

    if with_messages:
        with _encoding(chunk):
            body = openai_json.openai_json_body("m", route="chat", messages=msgs(t), **fields)
        want = {"model": "m", **fields, "messages": msgs(_stock_b64(_compact(t)))}
    else:
        with _encoding(chunk):
            body = openai_json.openai_json_body("m", t, route="chat", **fields)
        want = {"model": "m", **fields, "messages": [
            {"role": "user", "content": [{"type": "prompt_embeds",
                                          "data": _stock_b64(_compact(t))}]}]}
    assert json.loads(body) == want
    req = ChatCompletionRequest.model_validate(json.loads(body))
    part = req.messages[-1]["content"][-1]
    assert part["type"] == "prompt_embeds"
    _assert_same(_decode(part["data"], t), t)  # chat_utils: data.encode() -> the decode


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200), cuts=st.lists(st.integers(0, 200), max_size=12),
       chunk=st.sampled_from([3, 6, 30]), encoder=st.sampled_from(ENCODERS),
       room=st.integers(0, 300), at=st.integers(0, 5))
def test_writer_is_base64_of_whatever_writes(data, cuts, chunk, encoder, room, at):
    """Any split of the bytes into writes (empty and 1-byte writes included), as
    bytes or memoryviews, into a buffer too small or large enough."""
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    out = bytearray(b"#" * at + b"." * room)
    with _encoding(chunk, encoder):
        w = openai_json._Base64Into(out, at)
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            piece = data[a:b]
            assert w.write(memoryview(piece) if i % 2 else piece) == b - a
        end = w.finish()
    assert bytes(out[:at]) == b"#" * at
    assert bytes(out[at:end]) == base64.b64encode(data)


def test_chunk_boundaries_of_a_larger_tensor():
    """Several chunks, and torch.save's records of lengths not divisible by 3."""
    for rows in (1, 333, 1000):
        t = torch.randn(rows, 61).to(torch.bfloat16)
        body = openai_json.openai_json_body("m", t, max_tokens=1)
        assert json.loads(body)["prompt_embeds"] == _stock_b64(t)
        _assert_same(_decode(json.loads(body)["prompt_embeds"], t), t)


@pytest.mark.parametrize("bad, err, words", [
    ([[1.0, 2.0]], TypeError, "torch.Tensor, got list"),
    (None, TypeError, "torch.Tensor, got NoneType"),
    ("UEsDB", TypeError, "torch.Tensor, got str"),
    (torch.zeros(2, 3, dtype=torch.float64), ValueError, "dtype must be float32"),
    (torch.zeros(2, 3, dtype=torch.int32), ValueError, "got torch.int32"),
    (torch.zeros(2, 3, dtype=torch.bool), ValueError, "dtype must be"),
    (torch.zeros(2, 3, device="meta"), ValueError, "CPU tensor, got one on meta"),
    (torch.zeros(6), ValueError, "2-D"),
    (torch.zeros(1, 2, 3), ValueError, "2-D"),
    (torch.zeros(2, 3).to_sparse(), ValueError, "dense"),
])
def test_bad_tensors_are_refused_clearly(bad, err, words):
    with pytest.raises(err, match=words.replace("(", r"\(")):
        openai_json.openai_json_body("m", bad, max_tokens=1)
    with pytest.raises(err, match=words):
        openai_json.openai_json_body("m", [torch.zeros(1, 3), bad])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_tensor_is_refused():
    with pytest.raises(ValueError, match="CPU tensor, got one on cuda"):
        openai_json.openai_json_body("m", torch.zeros(2, 3, device="cuda"))


def test_other_errors():
    with pytest.raises(ValueError, match="route"):
        openai_json.openai_json_body("m", torch.zeros(1, 2), route="embeddings")
    with pytest.raises(ValueError, match="no prompt_embeds tensor"):
        openai_json.openai_json_body("m", [])
    with pytest.raises(ValueError, match="no prompt_embeds tensor"):
        openai_json.openai_json_body("m", route="chat",
                                     messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(TypeError):  # a field json.dumps rejects
        openai_json.openai_json_body("m", torch.zeros(1, 2), extra=object())


def test_a_tensor_requiring_grad_is_sent_detached():
    t = torch.randn(2, 3, requires_grad=True)
    got = _decode(json.loads(openai_json.openai_json_body("m", t))["prompt_embeds"], t)
    _assert_same(got, t.detach())
    assert not got.requires_grad


def _capture(monkeypatch) -> list[httpx.Request]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        return httpx.Response(200, json={"ok": 1})

    transport = httpx.MockTransport(handler)
    monkeypatch.setattr(httpx, "Client", functools.partial(httpx.Client, transport=transport))
    monkeypatch.setattr(httpx, "AsyncClient",
                        functools.partial(httpx.AsyncClient, transport=transport))
    return seen


def test_senders_post_the_body(monkeypatch):
    t = torch.randn(40, 8).to(torch.float16)
    seen = _capture(monkeypatch)
    assert sec.complete_openai_json("http://h:1/v1", "m", t, max_tokens=3,
                                    headers={"X-A": "1"}) == {"ok": 1}
    assert sec.chat_openai_json("http://h:1", "m", t, max_tokens=3) == {"ok": 1}
    assert asyncio.run(sec.acomplete_openai_json("http://h:1", "m", t, max_tokens=3)) == {"ok": 1}
    assert asyncio.run(sec.achat_openai_json("http://h:1", "m", t)) == {"ok": 1}
    urls = [str(r.url) for r in seen]
    assert urls == ["http://h:1/v1/completions", "http://h:1/v1/chat/completions",
                    "http://h:1/v1/completions", "http://h:1/v1/chat/completions"]
    for r, route in zip(seen, ["completions", "chat", "completions", "chat"]):
        fields = {"max_tokens": 3} if r is not seen[3] else {}
        want = openai_json.openai_json_body("m", t, route=route, **fields)
        assert r.content == bytes(want)
        assert r.headers["content-type"] == "application/json"
        assert r.headers["content-length"] == str(len(want))
        assert "transfer-encoding" not in r.headers
    assert seen[0].headers["x-a"] == "1"


def test_openai_sdk_types_read_vllm_responses():
    """The README's ``openai.types.Completion.model_validate(out)``: vLLM's
    responses, as the client returns them (JSON), are valid OpenAI SDK types."""
    openai_types = pytest.importorskip("openai.types")
    from openai.types.chat import ChatCompletion

    usage = UsageInfo(prompt_tokens=5, completion_tokens=2, total_tokens=7)
    comp = CompletionResponse(model="m", usage=usage, choices=[
        CompletionResponseChoice(index=0, text="hi", finish_reason="length")])
    out = openai_types.Completion.model_validate(json.loads(comp.model_dump_json()))
    assert out.choices[0].text == "hi" and out.usage.total_tokens == 7
    chat = ChatCompletionResponse(model="m", usage=usage, choices=[
        ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant",
                                                                  content="hi"),
                                     finish_reason="stop")])
    out = ChatCompletion.model_validate(json.loads(chat.model_dump_json()))
    assert out.choices[0].message.content == "hi"
    chunk = CompletionStreamResponse(model="m", choices=[
        CompletionResponseStreamChoice(index=0, text="h", finish_reason=None)])
    out = openai_types.Completion.model_construct(**json.loads(chunk.model_dump_json()))
    assert out.choices[0].text == "h" and out.choices[0].finish_reason is None
