# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the tests: segment names, payload encoding, counters."""

import base64
import io
import os

import torch

from vllm._shm_embeds_segments import SegmentName


def mine(name: str) -> bool:
    """True if segment file ``name`` was made by this process."""
    parsed = SegmentName.parse(name)
    return parsed is not None and parsed.pid == os.getpid()


def ours_in(seg_dir: str) -> list[str]:
    """Our segment file names in ``seg_dir`` (every file of every segment)."""
    return sorted(n for n in os.listdir(seg_dir) if SegmentName.parse(n) is not None)


def encode_embeds(tensor: torch.Tensor) -> str:
    """vLLM's online ``prompt_embeds`` format: base64 of ``torch.save`` bytes."""
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()
