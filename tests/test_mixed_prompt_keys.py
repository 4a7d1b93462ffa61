# SPDX-License-Identifier: Apache-2.0
"""Prefix-cache keys of mixed prompts (token ids and ``prompt_embeds`` interleaved, a
chat prompt with embeds parts) include the is-token-ids mask (issue 54, upstream
#56655): vLLM's own keys hash the token ids (0 where embeds are) and the embeds rows
(zeros where token ids are) but not which is which. vLLM's own ``Request`` and block
hasher (vllm/v1/core/kv_cache_utils.py, 0.32) run beside ours."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm._shm_embeds import counters
from vllm._shm_embeds.ext.digests import site_kv_cache_utils as site

BLOCK = 4


@pytest.fixture
def keys(monkeypatch):
    """``keys(ours, ids, embeds, mask)``: the request's block hashes and each
    block's extra keys, by vLLM's functions, with our site's wrapper or without."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    kcu.init_none_hash(sha256)
    stock = kcu._gen_prompt_embeds_extra_hash_keys
    wrapped = site.wrap_gen_prompt_embeds_extra_hash_keys(stock)

    def run(ours, ids, embeds, mask):
        monkeypatch.setattr(kcu, "_gen_prompt_embeds_extra_hash_keys",
                            wrapped if ours else stock)
        req = Request("r", ids, SamplingParams(max_tokens=1), None, prompt_embeds=embeds,
                      prompt_is_token_ids=mask,
                      block_hasher=kcu.get_request_block_hasher(BLOCK, sha256))
        n = req.num_prompt_tokens // BLOCK
        extra = [kcu.generate_block_hash_extra_keys(req, i * BLOCK, (i + 1) * BLOCK, 0)[0]
                 for i in range(n)]
        monkeypatch.setattr(kcu, "_gen_prompt_embeds_extra_hash_keys", stock)
        return list(req.block_hashes), extra

    return run


def test_a_token_id_0_and_a_zero_embeds_row_never_share_a_block(keys):
    """Stock's keys confuse them (the same block hash: the wrong KV reused); ours do not."""
    e = torch.randn(BLOCK, 8)
    e[0] = 0  # an all-zero embeds row at position 0 ...
    mixed_ids, mixed_mask = [0, 9, 9, 9], [True, False, False, False]  # ... or token id 0
    embeds_only = keys(False, None, e, None)
    assert keys(False, mixed_ids, e, mixed_mask)[0] == embeds_only[0]  # stock: one block
    before = counters.stats().get("hash_masked_blocks", 0)
    ours = keys(True, mixed_ids, e, mixed_mask)
    assert ours[0] != embeds_only[0] and ours[0] != keys(False, mixed_ids, e, mixed_mask)[0]
    assert counters.stats().get("hash_masked_blocks", 0) > before  # counted
    assert keys(True, None, e, None) == embeds_only  # embeds only: vLLM's keys as they are
    # A text prompt and an embeds prompt (token ids 0 either way) never share a block.
    assert keys(True, [0] * BLOCK, None, None)[0] != embeds_only[0]


@given(n=st.integers(1, 3 * BLOCK), seed=st.integers(0, 2**16),
       kind=st.sampled_from(["embeds", "tokens", "mixed"]))
def test_keys_are_vllms_with_the_mask_added_where_a_block_holds_token_ids(keys, n, seed, kind):
    g = torch.Generator().manual_seed(seed)
    mask = {"embeds": [False] * n, "tokens": [True] * n,
            "mixed": (torch.rand(n, generator=g) < 0.5).tolist()}[kind]
    ids = torch.randint(0, 3, (n,), generator=g).tolist()
    embeds = torch.randn(n, 3, generator=g)
    embeds[torch.tensor(mask, dtype=torch.bool)] = 0  # as vLLM's _build_mixed_prompt_embeds
    stock, ours = keys(False, ids, embeds, mask), keys(True, ids, embeds, mask)
    for i, (s, o) in enumerate(zip(stock[1], ours[1])):
        block = mask[i * BLOCK:(i + 1) * BLOCK]
        want = s if not any(block) else (*s, (site.MASK_KEY, bytes(block)))
        assert o == want
    assert (stock[0] == ours[0]) == (not any(mask[:len(stock[0]) * BLOCK]))
