# SPDX-License-Identifier: Apache-2.0
"""A ``prompt_embeds`` tensor as it goes on the wire: CPU, contiguous, 2-D,
FP32/FP16/BF16 (``wire.DATATYPES``), and its KServe descriptor."""

from __future__ import annotations

import ctypes

import torch

from shm_embeds_client.wire import BINARY_DATA_SIZE, DATATYPES

# torch dtype -> KServe name ("FP32", "FP16", "BF16").
_DATATYPES = {getattr(torch, dt.torch): name for name, dt in DATATYPES.items()}


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` (a contiguous CPU tensor, as :func:`_wire` gives it):
    a read-only memoryview of format ``B`` over the tensor's own memory, no
    copy, and no numpy (``Tensor.numpy()`` needs it: not a dependency here).
    The view keeps ``t`` alive. Raises ValueError for a view whose values are
    not its memory (the negative or conjugate bit set)."""
    if t.is_neg() or t.is_conj():
        raise ValueError("a tensor with the negative or conjugate bit set is not its bytes")
    if t.nbytes == 0:
        return memoryview(b"")
    buf = (ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr())
    buf._tensor = t  # the view holds buf, buf holds the tensor's memory
    return memoryview(buf).cast("B").toreadonly()


def _wire(tensor: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The tensor as sent (CPU, contiguous, FP32/FP16/BF16) and its descriptor."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
        raise ValueError("prompt_embeds must be a 2-D torch.Tensor (num_tokens, hidden_size)")
    t = tensor.detach().cpu()
    if t.dtype not in _DATATYPES:
        if not t.is_floating_point():
            raise ValueError(f"prompt_embeds must be floating point, got {t.dtype}")
        t = t.to(torch.float32)
    # What the tensor means, not its raw memory: a view with the negative or
    # conjugate bit set (``c.conj().imag``) is sent resolved.
    t = t.resolve_conj().resolve_neg().contiguous()
    desc = {"datatype": _DATATYPES[t.dtype], "shape": list(t.shape),
            "parameters": {BINARY_DATA_SIZE: t.nbytes}}
    return t, desc
