# SPDX-License-Identifier: Apache-2.0
"""Hop 1, API server -> EngineCore: ``prompt_embeds`` as a handle in vLLM's msgpack.

vLLM's ``MsgpackEncoder`` (``vllm/v1/serial_utils.py``, 0.32/0.33) offers every large
tensor to an out-of-band *consumer*, which may return metadata to send instead; the
decoder gives that to a *provider*, which returns the tensor. :class:`HandleOOBConsumer`
sends a segment handle; :class:`HandleOOBProvider` adopts the segment, no copy.

Duck-types vLLM's protocols; imports nothing of vLLM's classes or HTTP.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from vllm.logger import init_logger

from vllm._shm_embeds import extensions
from vllm._shm_embeds.counters import Event, count, count_many, count_reason
from vllm._shm_embeds.handle import SharedTensorHandle, ShmEmbedsError
from vllm._shm_embeds.lifetime import process
from vllm._shm_embeds.lifetime.transfer import (
    adopt_tensor,
    dense_nbytes,
    eligible,
    hand_over,
    share_tensor,
    unlink_peer,
)

logger = init_logger(__name__)

META_KEY = "shm_embeds"


def digests_module() -> Any:
    """The ``digests`` extension's module, or None without it."""
    return extensions.get("digests", "digests")


def held_module() -> Any:
    """The ``held`` extension's module (a holder's memfd sent by descriptor), or None."""
    return extensions.get("held", "held")


class HandleOOBConsumer:
    """Sender side of hop 1: sends the tensor passed to :meth:`arm` as a segment handle;
    every other tensor goes to ``inner`` (e.g. vLLM's ``TensorIpcSender``) or inline.
    Duck-types ``MsgpackEncoder``'s consumer (``__call__(tensor) -> dict | None``,
    ``new_message()``)."""

    def __init__(self, inner: Any = None, block_tokens: int | None = None,
                 local_engines: frozenset[bytes] | None = None) -> None:
        self.inner = inner
        self.block_tokens = block_tokens  # prefix-cache rows per digest, None: off
        self.local_engines = local_engines  # this host's EngineCores' ZMQ identities; None: all
        self._armed: torch.Tensor | None = None
        self._created: list[SharedTensorHandle] = []
        self._to_local = True

    def send_to(self, engine: bytes | None) -> None:
        """The next messages go to ``engine`` (a ZMQ identity; None: the first one)."""
        self._to_local = (self.local_engines is None or engine is None
                          or engine in self.local_engines)

    def arm(self, tensor: torch.Tensor | None) -> None:
        """Mark the tensor to send through shm in the next message (not to another node)."""
        if tensor is not None and not self._to_local:
            if isinstance(tensor, torch.Tensor):
                count_many({Event.HOP1_STOCK_TENSORS: 1,
                            Event.HOP1_STOCK_BYTES: dense_nbytes(tensor)})
                count_reason(Event.FALLBACK, "remote_engine", hop="1")
            tensor = None
        self._armed = tensor

    def take_created(self) -> list[SharedTensorHandle]:
        """Handles of the segments created since the last call (and forget them)."""
        created, self._created = self._created, []
        return created

    def new_message(self) -> None:
        if self.inner is not None:
            self.inner.new_message()

    def __call__(self, tensor: torch.Tensor) -> dict | None:
        if tensor is self._armed:
            self._armed = None
            found = meta = reason = None
            try:
                # a streamed segment goes as it is, a holder's memfd by its fd (any size)
                handle = hand_over(tensor)
                if handle is None and (held := held_module()) is not None:
                    handle, meta = held.share(tensor) or (None, None)
                if handle is None and (reason := eligible(tensor)) is None:
                    handle, found = self._copy(tensor)
            except OSError as e:
                reason = process.placement_failed("hop 1", tensor.nbytes, e)
            except Exception:  # ours, unexpected: the stock path, never the caller
                logger.warning("shm-embeds: hop 1 sends a tensor the stock way after "
                               "an unexpected error", exc_info=True)
                reason = "error"
            else:
                if handle is not None:
                    self._created.append(handle)
                    count_many({Event.HOP1_SHM_TENSORS: 1, Event.HOP1_SHM_BYTES: tensor.nbytes})
                    meta = meta or handle.to_meta()
                    # digests our own code computed over exactly these bytes
                    if (digests := digests_module()) is not None:
                        meta.update(digests.handover_meta(tensor, found))
                    return {META_KEY: meta}
            count_many({Event.HOP1_STOCK_TENSORS: 1, Event.HOP1_STOCK_BYTES: dense_nbytes(tensor)})
            count_reason(Event.FALLBACK, reason, hop="1")
        return self.inner(tensor) if self.inner is not None else None

    def _copy(self, tensor: torch.Tensor) -> tuple[SharedTensorHandle, Any]:
        """Copy ``tensor`` into a new segment, hashing its blocks meanwhile if asked: the
        handle and digests (or None). Raises OSError."""
        digests = digests_module()
        hashing = digests.start_hash(tensor, self.block_tokens) if digests else None
        try:
            handle = share_tensor(tensor)
        finally:
            # The pool reads the tensor: done before anything else may touch it.
            found = hashing.result() if hashing is not None else None
        return handle, found


ADOPT_FAILED_MESSAGE = (
    "prompt_embeds could not be read from shared memory (the segment was removed "
    "before the engine received the request); please retry"
)


class HandleOOBProvider:
    """Receiver side of hop 1: adopts segments named in OOB tensor metadata (duck-types
    vLLM's ``OOBTensorProvider``); other metadata goes to ``inner``. A handle not adopted
    yields a tensor :meth:`is_failed` knows, so the caller rejects the request."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self._failed: dict[int, weakref.ref] = {}

    def __call__(self, dtype: str, shape: tuple[int, ...], meta: dict) -> torch.Tensor:
        """The tensor for one out-of-band tensor's metadata; never raises for ours."""
        if not isinstance(meta, dict) or META_KEY not in meta:
            if self.inner is not None:
                return self.inner(dtype, shape, meta)
            return self._fail("out-of-band tensor without a provider")
        try:
            sent, held = meta[META_KEY], None
            if isinstance(sent, dict) and "held" in sent:  # a holder's memfd (ext/held)
                if (held := held_module()) is None:  # its header goes (a name of ours)
                    unlink_peer(SharedTensorHandle.from_meta(sent).name, 1)
                    raise ShmEmbedsError("a held file, and no held extension here")
                handle, memfd = held.from_meta(sent)
            else:
                handle = SharedTensorHandle.from_meta(sent)
            if handle.dtype != dtype or handle.shape != tuple(shape):
                raise ShmEmbedsError(f"handle {handle} does not match tensor {dtype!r}{shape!r}")
            tensor = adopt_tensor(handle) if held is None else held.adopt(handle, memfd)
        except Exception as e:  # ShmEmbedsError, or anything else of ours
            return self._fail(e)
        count_many({Event.HOP1_SHM_TENSORS: 1, Event.HOP1_SHM_BYTES: handle.nbytes,
                    Event.HOP1_ADOPTED_TENSORS: 1})
        try:
            if (digests := digests_module()) is not None:
                digests.adopt_meta(tensor, meta[META_KEY])  # prefix-cache digests
        except Exception:  # vLLM hashes it itself then
            logger.debug("shm-embeds: hop 1 digests dropped", exc_info=True)
            count(Event.HASH_REJECTED_META)
        return tensor

    def _fail(self, e: Exception | str) -> torch.Tensor:
        """A failed tensor (:meth:`is_failed`), logged and counted. Never raises."""
        logger.warning("shm-embeds: rejecting a request's prompt_embeds: %s", e,
                       exc_info=not isinstance(e, (str, ShmEmbedsError)))
        count_reason(Event.FALLBACK, "adopt_failed", hop="1")
        tensor = torch.empty(0)
        self._failed[id(tensor)] = weakref.ref(tensor)
        # dict.pop takes no lock: safe in a finalizer.
        weakref.finalize(tensor, self._failed.pop, id(tensor), None)
        return tensor

    def is_failed(self, tensor: Any) -> str | None:
        """A client-safe error message if ``tensor`` is a failed one, else None."""
        ref = self._failed.get(id(tensor))
        if ref is None or ref() is not tensor:
            return None
        return ADOPT_FAILED_MESSAGE

