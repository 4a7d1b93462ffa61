# SPDX-License-Identifier: Apache-2.0
"""Unit: the renderer sites (``ext/binary/site_renderers.py``) without an engine.

A chat prompt assembled from binary parts: the same values and mask as
vLLM's own ``_build_mixed_prompt_embeds``, in a segment mapped read-only,
not hashed while it is assembled (that runs on the event loop), then hashed
on the hash pool while ``render_messages_async`` awaits: the event loop runs
other tasks meanwhile, and the digests are those of the bytes.
"""

import asyncio
import concurrent.futures
import threading

import pytest
import torch

from vllm._shm_embeds.ext.digests import digests
from vllm._shm_embeds.ext.binary import placeholders
from vllm._shm_embeds.lifetime import transfer
from vllm._shm_embeds.ext.digests import streamed
from vllm._shm_embeds.ext.binary import site_renderers as renderers

H, BLOCK = 8, 4


def _streamed(rows: int, seed: int) -> torch.Tensor:
    """A binary body's tensor: a streamed segment, mapped read-only."""
    t = torch.randn(rows, H, generator=torch.Generator().manual_seed(seed))
    seg = streamed.StreamedSegment(torch.float32, (rows, H))
    seg.write(t.numpy().tobytes())
    return seg.finish(writable=False)


def _perms(tensor: torch.Tensor) -> str:
    """The permissions of this process's mapping that holds ``tensor``'s data."""
    addr = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.split()[1]
    raise AssertionError("no mapping holds the tensor")


@pytest.fixture
def upload(shm_env, monkeypatch):
    """The request being served: hashes per block of ``BLOCK`` rows."""
    up = placeholders.Upload(placeholders.new_token(), [], hash_block_tokens=BLOCK)
    monkeypatch.setattr(renderers, "current_upload", lambda: up)
    yield up
    up.release()


def test_chat_prompt_assembled_read_only_then_hashed_off_the_event_loop(upload, monkeypatch):
    from vllm.renderers.hf import _build_mixed_prompt_embeds as stock

    parts = [_streamed(5, 1), _streamed(6, 2)]
    upload.tensors.extend(parts)
    positions, total = [(2, 5), (10, 6)], 18  # text rows around and between them
    token_ids = list(range(total))
    full, mask = renderers.wrap_build_mixed_prompt_embeds(stock)(token_ids, parts, positions)
    want, want_mask = stock(token_ids, [p.clone() for p in parts], positions)
    assert torch.equal(full, want) and mask == want_mask
    assert transfer.is_streamed(full) and any(t is full for t in upload.made)
    assert _perms(full)[:2] == "r-", _perms(full)  # mapped read-only
    assert digests.attached(full) is None  # not hashed on the calling thread

    # The hashing is awaited: a future released only once the event loop has
    # run another task shows the loop was not blocked while it was pending.
    real = digests.hash_tensor
    gate, pending = threading.Event(), []

    def gated(tensor, block):
        out: concurrent.futures.Future = concurrent.futures.Future()
        inner = real(tensor, block)

        def finish():
            gate.wait(10)  # not set: the loop was blocked; released late
            out.set_result(inner.result())

        threading.Thread(target=finish, daemon=True).start()
        pending.append(out)
        return out

    monkeypatch.setattr(digests, "hash_tensor", gated)

    async def render(self, messages, params):
        return "conversation", {"prompt_embeds": full}

    async def main():
        task = asyncio.ensure_future(
            renderers.wrap_render_messages_async(render)(None, [], None))
        for _ in range(100):  # the loop runs this while the hash is pending
            await asyncio.sleep(0.01)
            if pending:
                break
        ran_while_pending = bool(pending) and not pending[0].done()
        gate.set()
        return ran_while_pending, await task

    ran_while_pending, (_, prompt) = asyncio.run(main())
    assert ran_while_pending, "the event loop was blocked while the prompt was hashed"
    assert prompt["prompt_embeds"] is full
    got = digests.attached(full)
    assert got is not None and got.digests == digests.hash_tensor_here(full, BLOCK).digests


def test_one_part_prompt_keeps_its_tensor_and_is_hashed_once(upload):
    from vllm.renderers.hf import _build_mixed_prompt_embeds as stock

    part = _streamed(7, 3)
    upload.tensors.append(part)
    out, mask = renderers.wrap_build_mixed_prompt_embeds(stock)(list(range(7)), [part],
                                                               [(0, 7)])
    assert out is part and mask == [False] * 7 and upload.made == []

    async def render(self, messages, params):
        return "c", {"prompt_embeds": out}

    asyncio.run(renderers.wrap_render_messages_async(render)(None, [], None))
    d = digests.attached(part)
    assert d is not None and d.digests == digests.hash_tensor_here(part, BLOCK).digests


def test_prompt_of_no_binary_part_is_vllms(upload):
    from vllm.renderers.hf import _build_mixed_prompt_embeds as stock

    plain = [torch.randn(3, H)]
    out, mask = renderers.wrap_build_mixed_prompt_embeds(stock)(list(range(5)), plain,
                                                               [(1, 3)])
    assert not transfer.is_streamed(out) and upload.made == []

    async def render(self, messages, params):
        return "c", {"prompt_embeds": out}

    asyncio.run(renderers.wrap_render_messages_async(render)(None, [], None))
    assert digests.attached(out) is None  # only our own tensors get digests
