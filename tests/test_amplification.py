# SPDX-License-Identifier: Apache-2.0
"""Work follows bytes that arrived: no body makes the plugin allocate, write,
hash or decode more than stock would for it (``docs/security.md``).

Property-based (hypothesis): hostile base64 JSON bodies (views with stride 0
or overlapping rows, transposed and sliced tensors, casts, row counts around
and far past ``--max-model-len``, a bad character, a cut, a wrong hidden
size, at any of up to three payloads) and hostile binary bodies (declared
shapes far larger than the bytes sent). The oracle is vLLM's own entry
point, ``safe_load_prompt_embeds`` (``vllm/renderers/embed_utils.py``),
payload by payload, as stock calls it. For each body:

* written to segments and hashed: nothing for a body vLLM refuses (a
  payload its loader refuses, no rows, more than ``--max-model-len``);
  otherwise at most the dense bytes its loader made (a stride-0 view's are
  its storage's, not its shape's);
* decoded: each payload at most once in all (by us, or left as base64 for
  vLLM), never both;
* memory: the process's peak resident memory grows by at most what vLLM's
  loader alone grows it by for the same payloads, plus a small constant.
"""

import base64
import io
import json
import os
import types

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import proc_status_bytes

from vllm._shm_embeds import counters
from vllm._shm_embeds.ext.binary import common
from vllm._shm_embeds.ext.json import json_body
from vllm._shm_embeds.ext.binary.placeholders import PLACEHOLDER_PREFIX
from vllm._shm_embeds.lifetime import process

HIDDEN = 64
MAX_LEN = 2048
BLOCK = 16
SLACK = 48 << 20  # bytes of peak RSS growth allowed beyond vLLM's loader's


def _ctx():
    mc = types.SimpleNamespace(enable_prompt_embeds=True, dtype=torch.float32,
                               max_model_len=MAX_LEN, get_hidden_size=lambda: HIDDEN)
    return common.ServerContext.from_model_config(mc, BLOCK)


def _rss_peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _grown_by(fn):
    """``(fn(), peak RSS growth in bytes)``."""
    _rss_peak_reset()
    before = proc_status_bytes("VmRSS")
    out = fn()
    return out, max(0, proc_status_bytes("VmHWM") - before)


# -- hostile JSON payloads


def _tensor(kind: str, rows: int, hidden: int) -> torch.Tensor:
    if kind == "stride0":
        return torch.ones(1, hidden).expand(rows, hidden)
    if kind == "overlap":  # row i starts one element after row i-1
        return torch.randn(rows + hidden).as_strided((rows, hidden), (1, 1))
    rows = min(rows, 3000)  # dense payloads: a few MB at most
    if kind == "transposed":
        return torch.randn(hidden, rows).t()
    if kind == "slice":
        return torch.randn(rows * 2, hidden)[::2]
    if kind == "fp16":
        return torch.randn(rows, hidden).half()
    return torch.randn(rows, hidden)


def _saved(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)  # a view is saved as a view (its storage, its strides)
    return base64.b64encode(buf.getvalue()).decode()


def _spoil(b64: str, how: str, at: float) -> str:
    i = int(at * (len(b64) - 1))
    if how == "bad-char":
        return b64[:i] + "!" + b64[i + 1:]
    if how == "cut":
        return b64[:i // 4 * 4]
    return b64


payloads = st.tuples(
    st.sampled_from(["plain", "fp16", "stride0", "overlap", "transposed", "slice"]),
    st.sampled_from([0, 1, 40, MAX_LEN - 1, MAX_LEN, MAX_LEN + 1, 3000, 1 << 16, 1 << 21]),
    st.sampled_from([HIDDEN, HIDDEN + 1]),
    st.sampled_from(["none", "none", "bad-char", "cut"]),
    st.floats(0, 1),
)


def _stock(payload: str):
    """vLLM's loader on one payload: ``(tensor, None)`` or ``(None, error)``."""
    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    try:
        return safe_load_prompt_embeds(_ctx().model_config, payload.encode()), None
    except Exception as e:
        return None, e


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(payloads, min_size=1, max_size=3))
def test_json_bodies_cost_no_more_than_stock(shm_env, monkeypatch, specs):
    from vllm.renderers import embed_utils

    texts = [_spoil(_saved(_tensor(kind, rows, hidden)), how, at)
             for kind, rows, hidden, how, at in specs]
    # The oracle: stock decodes in order and stops at the first refusal.
    stock_refuses, dense = False, 0
    (outs, stock_grown) = _grown_by(lambda: [_stock(t) for t in texts])
    for t, err in outs:
        if err is not None:
            stock_refuses = True
            break
        dense += min(t.nbytes, t.untyped_storage().nbytes())
        stock_refuses |= t.numel() == 0 or t.shape[0] > MAX_LEN
    del outs
    calls: list[int] = []
    real = embed_utils.safe_load_prompt_embeds
    before = counters.stats()
    body = json.dumps({"model": "m", "prompt": "", "prompt_embeds": texts}).encode()
    with monkeypatch.context() as m:  # one wrapper per example (the fixture is shared)
        m.setattr(embed_utils, "safe_load_prompt_embeds",
                  lambda mc, data: calls.append(len(data)) or real(mc, data))
        out, ours_grown = _grown_by(
            lambda: json_body.prepare(body, "/v1/completions", _ctx()))
    try:
        after = counters.stats()

        def delta(key):
            return after.get(key, 0) - before.get(key, 0)

        written = delta("copied_bytes")
        hashed = delta("hash_api_blocks") * BLOCK * HIDDEN * 4
        direct = delta("json_direct_tensors")
        if stock_refuses:
            assert written == 0 and hashed == 0, (written, hashed)
        assert written <= dense and hashed <= written + BLOCK * HIDDEN * 4 * len(texts)
        # Each payload decoded once in all: ours (loader or direct), or vLLM's
        # on what the skeleton still holds as base64.
        left = json.loads(out.body)["prompt_embeds"] if out.upload is not None else texts
        still_text = sum(isinstance(v, str) and not v.startswith(PLACEHOLDER_PREFIX)
                         for v in left)
        decoded_here = len(calls) + direct
        assert decoded_here + still_text <= len(texts), (decoded_here, still_text)
        assert ours_grown <= stock_grown + SLACK, (ours_grown, stock_grown)
    finally:
        if out.upload is not None:
            out.upload.release()
    process.collect()
    assert os.listdir(shm_env) == []


# -- hostile binary bodies: declared far more than sent


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rows=st.sampled_from([1, 100, MAX_LEN, MAX_LEN + 1, 1 << 20]),
       sent=st.sampled_from([0, 1, 4096, 1 << 16]),
       count=st.integers(1, 3))
def test_binary_bodies_write_only_what_arrived(shm_env, rows, sent, count):
    """Descriptors declaring up to ``--max-model-len`` rows each (or past it:
    refused before anything is read past the header), then only ``sent``
    bytes: segments hold at most what arrived, memory grows by a small
    constant, nothing is left."""
    from test_binary_framing import _run_middleware, desc, hdr

    h = hdr({"model": "m", "prompt_embeds": [desc(rows, HIDDEN, "FP32")] * count})
    headers = [(b"content-type", b"application/octet-stream"),
               (b"inference-header-content-length", str(len(h)).encode())]
    before = counters.stats().get("copied_bytes", 0)
    (status, _, _), grown = _grown_by(
        lambda: _run_middleware(headers, [h + b"\0" * sent], limits=_ctx()))
    assert status in (400, 413)  # cut short, or refused by its header
    assert counters.stats().get("copied_bytes", 0) - before <= sent
    assert grown <= SLACK, grown
    process.collect()
    assert os.listdir(shm_env) == []


def test_the_amplification_tests_see_a_dense_copy():
    """The measure itself: making a 1 GiB stride-0 view dense is seen (so a
    regression of the rule cannot pass unseen)."""
    view = torch.ones(1, 1 << 16).expand(1 << 12, 1 << 16)
    _, grown = _grown_by(lambda: view.contiguous())
    assert grown > 512 << 20
