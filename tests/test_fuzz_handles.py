# SPDX-License-Identifier: Apache-2.0
"""Fuzz targets (hypothesis) for what parses handles and names arriving over
hop 1 and hop 2: ``SharedTensorHandle.from_meta`` (only ``ShmEmbedsError``),
``SegmentName.parse`` (a ``SegmentName`` that prints back to the same string,
or None), ``hop1.HandleOOBProvider`` (never raises for metadata of ours: a
failed tensor or the adopted one), ``digests.adopt_meta`` (never raises) and
the request placeholders (``http.placeholders.resolve_placeholder``: a tensor of
the current upload or None).

Examples per target: the "ci" profile of tests/conftest.py; SHM_EMBEDS_FUZZ=long
for the long run.
"""

import string

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm._shm_embeds.handle import (  # noqa: E402
    SEGMENT_PREFIX,
    SegmentName,
    SharedTensorHandle,
    ShmEmbedsError,
)
from vllm._shm_embeds.ext.digests import digests
from vllm._shm_embeds.hops import hop1  # noqa: E402

_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
            | st.floats(allow_nan=True) | st.text(max_size=30) | st.binary(max_size=30))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=5)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=20)
_digits = st.text(alphabet="0123456789", min_size=1, max_size=25)
_names = st.one_of(
    st.text(max_size=80),
    st.builds(lambda *p: f"{SEGMENT_PREFIX}." + ".".join(p), _digits, _digits, _digits, _digits),
    st.builds(lambda a, b, c, d, e: f"{SEGMENT_PREFIX}.{a}.{b}.{c}.{d}p{e}",
              _digits, _digits, _digits, _digits, _digits),
    st.builds(lambda s: f"{SEGMENT_PREFIX}.{s}", st.text(alphabet=string.digits + ".p٣x/",
                                                        max_size=40)),
)
_dims = st.lists(st.integers(-3, 2**40) | _scalars, max_size=4)
_metas = st.one_of(
    _values,
    st.fixed_dictionaries(
        {"name": _names | _scalars,
         "dtype": st.sampled_from(["float32", "bfloat16", "float16", "int8", "Tensor",
                                   "float4_e2m1fn_x2", "qint8", "", "__class__"]) | _scalars,
         "shape": _dims | _scalars},
        optional={"split": _dims | _scalars, "held": _dims | _scalars,
                  "digests": _values}),
)


_OK = f"{SEGMENT_PREFIX}.1.2.3.4"


@given(_names)
@example(f"{SEGMENT_PREFIX}.1.2.3.٣")  # a Unicode digit: another string, same name
@example(f"{SEGMENT_PREFIX}.1.2.3.{'1' * 5000}")  # int() refuses it
@example(f"{SEGMENT_PREFIX}.1.2.3.04p0")
def test_fuzz_segment_name_parse(name):
    parsed = SegmentName.parse(name)  # never raises
    if parsed is not None:
        assert str(parsed) == name  # one string per name


@given(_metas)
@example({"name": _OK, "dtype": "float32", "shape": [float("inf")]})
@example({"name": _OK, "dtype": "float32", "shape": [-2, -2]})
@example({"name": _OK, "dtype": "float32", "shape": "12"})
def test_fuzz_handle_from_meta(meta):
    try:
        handle = SharedTensorHandle.from_meta(meta)
    except ShmEmbedsError:
        return
    assert handle.nbytes >= 0 and all(d >= 0 for d in handle.shape)
    assert SegmentName.parse(handle.name) is not None
    assert SharedTensorHandle.from_meta(handle.to_meta()) == handle


@given(meta=_metas, dtype=st.sampled_from(["float32", "bfloat16"]),
       shape=st.lists(st.integers(0, 64), max_size=3))
@example(meta={"name": _OK, "dtype": "float32", "shape": [float("inf")]}, dtype="float32",
         shape=[1])
@example(meta={"name": _OK, "dtype": "float32", "shape": [1]}, dtype="float32",
         shape=None)
def test_fuzz_oob_provider_never_raises(shm_env, meta, dtype, shape):
    provider = hop1.HandleOOBProvider()
    got = provider(dtype, shape, {hop1.META_KEY: meta})
    assert isinstance(got, torch.Tensor)
    assert provider.is_failed(got) is not None  # nothing of that name exists here


@given(_values)
@example({"block": 1, "rows": 4, "digests": 10**6})  # bytes(int) would allocate that
@example({"block": float("inf"), "rows": 4, "digests": b""})
def test_fuzz_adopt_meta_never_raises(field):
    t = torch.zeros(4, 2)
    digests.adopt_meta(t, {digests.META_FIELD: field})


@given(st.text(max_size=60) | st.binary(max_size=60), st.integers(0, 3))
def test_fuzz_placeholders_resolve_only_their_own(data, n):
    from vllm._shm_embeds.ext.binary import placeholders

    tensors = [torch.zeros(1) for _ in range(n)]
    upload = placeholders.Upload(placeholders.new_token(), list(tensors))
    token = placeholders._current.set(upload)
    try:
        got = placeholders.resolve_placeholder(data)
        assert got is None or any(got is t for t in tensors)
        for i, t in enumerate(tensors):
            assert placeholders.resolve_placeholder(placeholders.placeholder(upload.token, i)) is t
            assert placeholders.resolve_placeholder(
                placeholders.placeholder(upload.token, i).encode()) is t
    finally:
        placeholders._current.reset(token)
