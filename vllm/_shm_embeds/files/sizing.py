# SPDX-License-Identifier: Apache-2.0
"""How large the segment directory should be, and the start-up warning."""

from __future__ import annotations

import os
from typing import Any

from vllm._shm_embeds.config import shm_dir
from vllm._shm_embeds.handle import HEADER_BYTES, dtype_name


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def check_dir_size(vllm_config: Any, directory: str | None = None) -> str | None:
    """The start-up warning if the directory's file system is smaller than running
    requests' embeds could need for ``vllm_config`` (vLLM 0.32/0.33 field names); else None."""
    directory = directory or shm_dir()
    mc, sc, pc = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.parallel_config
    engines = max(1, int(getattr(pc, "data_parallel_size_local", 1) or 1))
    dtype_bytes = mc.dtype.itemsize
    need = engines * sc.max_num_seqs * (mc.max_model_len * mc.get_hidden_size() * dtype_bytes
                                        + HEADER_BYTES)
    st = os.statvfs(directory)
    size = st.f_blocks * st.f_frsize
    if size >= need:
        return None
    mib = -(-need // (1 << 20))
    docker = f"{mib}m" if mib < 1024 else f"{-(-mib // 1024)}g"
    return (
        f"shm-embeds: the segment directory {directory} holds {_human(size)} "
        f"({_human(st.f_bavail * st.f_frsize)} free), but {engines} engine(s) x "
        f"{sc.max_num_seqs} running requests (--max-num-seqs) x {mc.max_model_len} "
        f"tokens (--max-model-len) x hidden size {mc.get_hidden_size()} x {dtype_bytes} "
        f"bytes ({dtype_name(mc.dtype)}) of prompt_embeds could need "
        f"{_human(need)} ({need} bytes), and queued requests hold theirs too. "
        f"prompt_embeds that do not fit take the slower stock path. Make it at least "
        f"{_human(need)} (Docker: --shm-size={docker}), or lower --max-num-seqs / --max-model-len."
    )
