# SPDX-License-Identifier: Apache-2.0
"""Hostile ``torch.save`` payloads for the direct decode's tests and fuzzing.

:func:`save_with` writes a tensor with the installed ``torch.save`` (so the
zip is laid out exactly as torch lays it out) but with its ``data.pkl``
edited; the edits below are the tricks a hostile client can play.
"""

from __future__ import annotations

import base64
import io
import pickle
import struct
import types
from collections.abc import Callable

import torch

HIDDEN = 64


def model_config(dtype: torch.dtype = torch.float32, hidden: int = HIDDEN):
    return types.SimpleNamespace(enable_prompt_embeds=True, dtype=dtype, max_model_len=4096,
                                 get_hidden_size=lambda: hidden)


def ctx(dtype: torch.dtype = torch.float32, hidden: int = HIDDEN, block: int = 16):
    from vllm._shm_embeds.ext.binary import common

    return common.ServerContext.from_model_config(model_config(dtype, hidden), block)


def save_with(tensor: torch.Tensor, edit: Callable[[bytes], bytes]) -> bytes:
    """``torch.save(tensor)`` with ``edit(data.pkl)`` as its ``data.pkl``."""

    class Pickler:  # what torch.save subclasses; it adds persistent_id
        def __init__(self, f, protocol):
            self.f, self.protocol = f, protocol

        def dump(self, obj):
            outer = self

            class Inner(pickle.Pickler):
                def persistent_id(self, o):
                    return outer.persistent_id(o)

            buf = io.BytesIO()
            Inner(buf, protocol=self.protocol).dump(obj)
            self.f.write(edit(buf.getvalue()))

    buf = io.BytesIO()
    torch.save(tensor, buf, pickle_module=types.SimpleNamespace(Pickler=Pickler, __name__="pickle"))
    return buf.getvalue()


def saved(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def memo_trick(index: int) -> Callable[[bytes], bytes]:
    """One extra ``LONG_BINPUT index`` (of the tensor) before ``STOP``: CPython's
    C unpickler grows its memo array to ``2 * index`` entries."""
    return lambda p: p[:-1] + b"r" + struct.pack("<I", index) + b"."


def storage_pid(storage: str, numel: int, key: str = "0") -> bytes:
    """Opcodes that push ``("storage", torch.<storage>, key, "cpu", numel)``."""
    return (b"(X\x07\x00\x00\x00storagectorch\n" + storage.encode() + b"\n"
            + b"X" + struct.pack("<I", len(key)) + key.encode()
            + b"X\x03\x00\x00\x00cpuJ" + struct.pack("<i", numel) + b"t")


def extra_persistent_load(numel: int, storage: str = "FloatStorage"):
    """A persistent load of record ``0`` with ``numel`` elements before the
    tensor's own, left on the stack under the result (``STOP`` pops only the
    top): torch caches the first load of a key, so it decides the storage."""
    return lambda p: p[:2] + storage_pid(storage, numel) + b"Q" + p[2:]


def build_on_hooks(p: bytes) -> bytes:
    """A ``BUILD`` that gives the (empty) hooks ``OrderedDict`` an attribute:
    both unpicklers accept it, the tensor is the same."""
    at = p.index(b")R")  # EMPTY_TUPLE REDUCE: OrderedDict()
    return p[:at + 2] + b"}X\x01\x00\x00\x00xK\x01sb" + p[at + 2:]


def build_on_tensor(p: bytes) -> bytes:
    """A ``BUILD`` on the tensor with state ``(None, {"args": ...})``: a
    stand-in with slots takes it as a new record of the call; torch calls
    ``tensor.set_(None, {...})`` and fails."""
    return p[:-1] + b"N}X\x04\x00\x00\x00argsK\x01s\x86b."


def stock(raw: bytes, dtype: torch.dtype = torch.float32, hidden: int = HIDDEN):
    """vLLM's ``safe_load_prompt_embeds`` of ``raw``: the tensor, or the exception."""
    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    try:
        return safe_load_prompt_embeds(model_config(dtype, hidden), base64.b64encode(raw))
    except Exception as e:  # noqa: BLE001 - what stock answers, whatever it is
        return e
