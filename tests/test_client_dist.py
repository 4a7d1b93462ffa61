# SPDX-License-Identifier: Apache-2.0
"""The client as its own distribution (``client/``, ``shm-embeds-client``):
the server spells the wire with the client's constants, the client needs no
vLLM, and ``shm_embeds_client.wire`` imports in a bare venv."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import shm_embeds_client as sec
from shm_embeds_client import _tensors, wire
from vllm._shm_embeds.ext.binary import binary, binary_header, placeholders
from vllm._shm_embeds.ext.regions import region_refs
from vllm._shm_embeds.ext.regions import registry, server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_server_tables_are_the_clients():
    want = {name: getattr(torch, dt.torch) for name, dt in wire.DATATYPES.items()}
    assert list(wire.DATATYPES) == ["FP32", "FP16", "BF16"]
    assert binary_header.DATATYPES == want and binary.DATATYPES is binary_header.DATATYPES
    assert registry.DTYPES == want
    assert {d: n for n, d in want.items()} == _tensors._DATATYPES
    for name, dt in wire.DATATYPES.items():
        assert want[name].itemsize == dt.size, name
    assert binary_header.HEADER_NAME == wire.HEADER_LENGTH.lower()
    assert binary_header.CONTENT_TYPE == wire.CONTENT_TYPE.encode()
    assert wire.HEADER_LENGTH.lower().encode() in placeholders.DROPPED_HEADERS
    assert region_refs.REF_KEY == f'"{wire.REGION}"'.encode()
    assert region_refs.JSON_TYPE == wire.JSON_CONTENT_TYPE.encode()
    assert server.MAX_MESSAGE is wire.MAX_MESSAGE
    assert sec.MAX_MESSAGE is wire.MAX_MESSAGE and sec.MEMFD_NAME is wire.MEMFD_NAME


def test_client_frames_with_the_wire_names():
    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    headers, pieces, length = sec.frame({"model": "m", "prompt_embeds": t})
    assert headers["Content-Type"] == wire.CONTENT_TYPE
    assert int(headers[wire.HEADER_LENGTH]) == len(pieces[0])
    assert f'"{wire.BINARY_DATA_SIZE}": 24'.encode() in pieces[0] and length == len(pieces[0]) + 24


# The client's dependencies are httpx and torch: torch without numpy (the
# client's own venv need not have it) gives ``Tensor.numpy()`` a RuntimeError.
_WITHOUT_NUMPY = """
import sys
sys.modules["numpy"] = None  # import numpy raises ImportError: as in a venv without it
import torch
import shm_embeds_client as sec
from shm_embeds_client._tensors import _bytes_of
t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
try:
    t.numpy()
except RuntimeError:
    pass
else:
    sys.exit("numpy is available: this probe proves nothing")
headers, pieces, length = sec.frame({"model": "m", "prompt_embeds": [t, t[:0]]})
assert b"".join(bytes(p) for p in pieces[1:]) == bytes(_bytes_of(t)), pieces
assert len(pieces) == 2 and length == len(pieces[0]) + t.nbytes
view = _bytes_of(t)
assert view.readonly and view.format == "B" and view.nbytes == 48
assert torch.frombuffer(bytearray(view), dtype=torch.float32).equal(t.reshape(-1))
assert bytes(_bytes_of(t[:0])) == b""
"""


def test_client_sends_tensors_without_numpy():
    """Framing reads each tensor's own bytes through ctypes (``_bytes_of``):
    the client works where torch has no numpy."""
    r = subprocess.run([sys.executable, "-c", _WITHOUT_NUMPY], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


def test_client_requires_no_vllm():
    reqs = importlib.metadata.requires("shm-embeds-client") or []
    names = {re.split(r"[\s;<>=!~\[]", r, maxsplit=1)[0].lower() for r in reqs}
    assert names == {"httpx", "torch"}
    assert not any("vllm" in r.lower() for r in reqs)


def test_public_names_are_reexported():
    assert sorted(sec.__all__) == ["AsyncConversation", "ChatConversation", "Continuation",
                                   "Conversation", "KeptPart",
                                   "Region", "RegionClient", "RegionRefused", "achat",
                                   "achat_openai_json", "acomplete", "acomplete_openai_json",
                                   "chat", "chat_openai_json", "complete",
                                   "complete_openai_json", "connect_regions", "frame",
                                   "openai_json_body"]
    for name in sec.__all__:
        assert getattr(sec, name).__module__.startswith("shm_embeds_client.")
    with pytest.raises(AttributeError):
        _ = sec.no_such_name


def test_wire_imports_without_torch_or_httpx():
    code = ("import sys, shm_embeds_client.wire; "
            "assert not {'torch', 'httpx', 'vllm'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_wire_in_a_fresh_venv(tmp_path):
    """``pip install --no-deps ./client`` into a bare venv (no torch, httpx or
    vLLM there) and ``import shm_embeds_client.wire``."""
    py311 = shutil.which("python3.11")
    if py311 is None:
        pytest.skip("python3.11 not found: cannot make the fresh venv")
    venv = tmp_path / "venv"
    made = subprocess.run([py311, "-m", "venv", str(venv)], capture_output=True, text=True,
                          timeout=300)
    py = venv / "bin" / "python"
    if made.returncode != 0 or not py.exists():
        pytest.skip(f"cannot create a venv: {made.stderr.strip()[-500:]}")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # A copy of client/: building in place would leave build/ in the checkout.
    src = shutil.copytree(os.path.join(ROOT, "client"), tmp_path / "client",
                          ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    got = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(src)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr
    code = ("import shm_embeds_client.wire as w; "
            "print(w.__file__, sorted(w.DATATYPES), w.HEADER_LENGTH)")
    got = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60,
                         env=env, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    print(got.stdout.strip())
    assert str(venv) in got.stdout, got.stdout  # the venv's copy, not the source tree
    for absent in ("torch", "httpx", "vllm"):
        probe = subprocess.run([str(py), "-c", f"import {absent}"], capture_output=True,
                               timeout=60, env=env, cwd=tmp_path)
        assert probe.returncode != 0, f"{absent} is importable in the fresh venv"


def test_client_sends_what_a_view_means_not_its_memory():
    """A contiguous view with the negative bit set (``torch._neg_view``; as
    ``c.conj().imag`` but contiguous) is sent as its values (resolved), never
    its raw memory; the raw byte view refuses such a tensor."""
    from shm_embeds_client._tensors import _bytes_of

    x = torch.randn(3, 4)
    c = torch.complex(torch.randn(3, 4), torch.randn(3, 4))
    for t, want in [(torch._neg_view(x), -x), (c.conj().imag, -c.imag)]:
        assert t.is_neg()
        headers, pieces, length = sec.frame({"model": "m", "prompt_embeds": t})
        sent = torch.frombuffer(bytearray(b"".join(bytes(p) for p in pieces[1:])),
                                dtype=torch.float32).reshape(3, 4)
        assert torch.equal(sent, want)
    with pytest.raises(ValueError):
        _bytes_of(torch._neg_view(x))
