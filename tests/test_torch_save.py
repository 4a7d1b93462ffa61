# SPDX-License-Identifier: Apache-2.0
"""The direct decode's pickle check is bounded and cannot be steered.

``ext/json/torch_save.py`` used to run a payload's ``data.pkl`` through CPython's
C unpickler with stand-ins: ``LONG_BINPUT <i>`` made it allocate ``16 i``
bytes, and a persistent load left under the result decided torch's storage
while the dry run saw another. Now ``ext/json/pickle_scan.py`` only reads the
pickle and accepts it when it is byte for byte ``torch.save``'s; everything
else goes to vLLM's loader, counted as ``json_direct_declined.<reason>``,
and the outcome is stock's.
"""

import base64
import io
import json
import os
import pickletools
import tracemalloc
import zipfile

import pytest
import torch
import torch_save_cases as cases
from torch_save_cases import HIDDEN

from vllm._shm_embeds import counters
from vllm._shm_embeds.ext.json import pickle_scan, torch_save
from vllm._shm_embeds.ext.json import json_body
from vllm._shm_embeds.lifetime import process, transfer


def _outline(raw: bytes) -> torch_save._Outline:
    return torch_save._Outline(len(raw), raw, len(raw), b"")


def _pickle_of(raw: bytes) -> bytes:
    zf = zipfile.ZipFile(io.BytesIO(raw))
    [name] = [n for n in zf.namelist() if n.endswith("/data.pkl")]
    return zf.read(name)


def _prepare(raw: bytes, dtype=torch.float32):
    """``json_body.prepare`` of a completion body carrying ``raw``; ``(body, out)``."""
    body = json.dumps({"model": "m", "prompt": "",
                       "prompt_embeds": base64.b64encode(raw).decode()}).encode()
    return body, json_body.prepare(body, "/v1/completions", cases.ctx(dtype))


def _release(out) -> list[torch.Tensor]:
    """Copies of the tensors of ``out``'s upload; their segments released."""
    got = [t for t in (out.upload.tensors if out.upload else []) if t is not None]
    copies = [t.clone() for t in got]
    for t in got:
        transfer.release_streamed(t)
    return copies


def _declined() -> dict[str, int]:
    return {k.split(".", 1)[1]: v for k, v in counters.stats().items()
            if k.startswith("json_direct_declined.")}


def _assert_as_stock(raw: bytes, shm_env, reason: str) -> None:
    """``prepare`` gives what vLLM's loader gives for ``raw`` (the same tensor,
    or its error for vLLM's decode site to raise), not by the direct decode,
    and counts ``reason``."""
    want = cases.stock(raw)
    body, out = _prepare(raw)
    errors = list(map(str, out.upload.errors.values())) if out.upload else []
    got = _release(out)
    assert counters.stats().get("json_direct_tensors", 0) == 0
    assert _declined() == {reason: 1}
    if isinstance(want, Exception):  # vLLM's loader's error, raised where vLLM decodes
        assert out.reason == "rejected" and errors == [str(want)] and not got
    else:
        assert out.reason is None and len(got) == 1
        assert got[0].dtype == want.dtype and torch.equal(got[0], want)
    process.collect()
    assert os.listdir(shm_env) == []


# -- the scan: exactly torch.save's pickle


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 7), (1, 5, 7), (300, 7), (1, 3, 70000)])
def test_scan_reads_what_torch_save_writes(dtype, shape):
    """Every integer encoding the pickler picks (BININT1/2, BININT) is read
    back as the tensor's layout."""
    t = torch.zeros(shape, dtype=dtype)
    call = pickle_scan.scan(_pickle_of(cases.saved(t)), dtype)
    assert call == pickle_scan.Rebuild(t.numel(), 0, tuple(shape), t.stride())
    other = torch.float64  # another dtype's template: not this one
    assert pickle_scan.scan(_pickle_of(cases.saved(t)), other) is None


def test_scan_accepts_no_byte_but_torch_saves():
    """Any one byte of a real pickle changed: refused, unless the byte is an
    integer's argument and the result is still the pickler's own encoding
    (then the scan reports that integer)."""
    pkl = _pickle_of(cases.saved(torch.zeros(1, 20, HIDDEN)))
    ops = list(pickletools.genops(pkl)) + [(None, None, len(pkl))]
    int_args = {i for (op, _, pos), (_, _, end) in zip(ops, ops[1:])
                if op.name in ("BININT1", "BININT2", "BININT") for i in range(pos + 1, end)}
    accepted = 0
    for i in range(len(pkl)):
        for value in {0, 1, 2, 0x4B, 0x72, 0x80, 0xFF, pkl[i] ^ 1} - {pkl[i]}:
            bad = pkl[:i] + bytes([value]) + pkl[i + 1:]
            call = pickle_scan.scan(bad, torch.float32)
            if call is not None:
                accepted += 1
                assert i in int_args
                ints = [call.numel, call.storage_offset, *call.shape, *call.stride]
                assert ints != [1280, 0, 1, 20, HIDDEN, 1280, HIDDEN, 1]
    assert accepted  # the integers are free: the caller checks them
    assert pickle_scan.scan(pkl + b".", torch.float32) is None  # bytes after STOP
    assert pickle_scan.scan(pkl[:-1], torch.float32) is None
    assert pickle_scan.scan(b"", torch.float32) is None


def test_scan_reads_at_most_its_bound():
    pkl = _pickle_of(cases.saved(torch.zeros(2, HIDDEN)))
    long = pkl[:2] + b"X" + (1 << 20).to_bytes(4, "little") + b"a" * (1 << 20) + b"0" + pkl[2:]
    assert pickle_scan.scan(long, torch.float32) is None
    assert len(pkl) < pickle_scan.MAX_PICKLE_BYTES


# -- tricks that a check by a dry run would let through


def test_memo_trick_allocates_nothing_and_gets_stocks_tensor(shm_env):
    """A valid tensor pickle with one extra ``LONG_BINPUT 2**22``: CPython's
    C unpickler (the old dry run) allocated a 64 MiB memo for it (a larger
    index, gigabytes). The scan refuses it having allocated nothing of the
    kind, and vLLM's loader (a dict memo) gives the tensor, as stock does."""
    t = torch.randn(100, HIDDEN)
    raw = cases.save_with(t, cases.memo_trick(1 << 22))
    assert torch.equal(cases.stock(raw), t)  # stock takes it
    torch_save._reference(torch.float32)  # learned once, not counted below
    pickle_scan.template(torch.float32, 3)
    tracemalloc.start()
    try:
        out = torch_save.plain_tensor_layout(cases.ctx(), _outline(raw))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes traced"
    assert out is None
    _assert_as_stock(raw, shm_env, "pickle")


def test_extra_persistent_load_is_refused(shm_env):
    """A persistent load of record 0 with more elements, before the tensor's
    own and left under the result: torch keeps the first load of a key, so
    vLLM's loader rejects the payload (record size mismatch); the old dry
    run and meta load saw a plain tensor and decoded it. Refused now."""
    t = torch.randn(100, HIDDEN)
    raw = cases.save_with(t, cases.extra_persistent_load(t.numel() + 64))
    assert isinstance(cases.stock(raw), Exception)
    assert torch_save.plain_tensor_layout(cases.ctx(), _outline(raw)) is None
    _assert_as_stock(raw, shm_env, "pickle")


@pytest.mark.parametrize("edit", [cases.build_on_hooks, cases.build_on_tensor])
def test_build_is_refused(shm_env, edit):
    """A ``BUILD`` anywhere: never run, refused; the outcome is stock's (the
    same tensor for a BUILD on the hooks, a rejection for one on the tensor).
    A dry run would take the BUILD on the tensor as a new record of the
    call (``args = 1``) and let ``TypeError`` escape the direct decode."""
    t = torch.randn(100, HIDDEN)
    raw = cases.save_with(t, edit)
    assert torch_save.plain_tensor_layout(cases.ctx(), _outline(raw)) is None
    _assert_as_stock(raw, shm_env, "pickle")


@pytest.mark.parametrize("field,fake", [
    ("stride", lambda m: m.t().contiguous().t()),
    ("storage_offset", lambda m: torch.empty(m.numel() + 1, device="meta")[1:].view(m.shape)),
    ("storage_size", lambda m: torch.empty(m.numel() + 1, device="meta")[:-1].view(m.shape)),
    ("requires_grad", lambda m: m.requires_grad_()),
])
def test_meta_load_must_build_that_very_tensor(monkeypatch, field, fake):
    """The meta-device load must agree with the scan on shape, dtype, stride,
    storage offset and storage size, not only shape and dtype."""
    raw = cases.saved(torch.randn(100, HIDDEN))
    assert torch_save.plain_tensor_layout(cases.ctx(), _outline(raw))[1] == 100
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: fake(load(*a, **k)))
    assert torch_save.plain_tensor_layout(cases.ctx(), _outline(raw)) is None
    assert torch_save.layout_or_reason(cases.ctx(), _outline(raw)) == "meta"


def test_metadata_records_are_bounded():
    """A metadata record larger than ``MAX_RECORD_BYTES`` (here the pickle,
    padded with a long string) is never read: the zip is not torch.save's."""
    pad = b"X" + (8 << 10).to_bytes(4, "little") + b"a" * (8 << 10)
    raw = cases.save_with(torch.randn(100, HIDDEN), lambda p: p[:2] + pad + p[2:])
    assert torch_save.plain_tensor_layout(cases.ctx(), _outline(raw)) is None
    assert torch_save.layout_or_reason(cases.ctx(), _outline(raw)) == "zip"


def test_declined_reasons_are_counted(shm_env, monkeypatch):
    """A cast (fp16 payload, fp32 model) is ``dtype``; a tensor below the
    size threshold is ``small``; a view ``tensor``; the plain one none."""
    _release(_prepare(cases.saved(torch.randn(100, HIDDEN).half()))[1])
    _release(_prepare(cases.saved(torch.randn(1, 100, HIDDEN)))[1])
    _release(_prepare(cases.saved(torch.randn(100, HIDDEN + 1)))[1])  # rejected
    monkeypatch.setenv("VLLM_SHM_EMBEDS_MIN_BYTES", str(1 << 20))
    _release(_prepare(cases.saved(torch.randn(100, HIDDEN)))[1])
    assert _declined() == {"dtype": 1, "tensor": 1, "small": 1}
    assert counters.stats()["json_direct_tensors"] == 1
    process.collect()
    assert os.listdir(shm_env) == []
