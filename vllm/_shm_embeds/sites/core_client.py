# SPDX-License-Identifier: Apache-2.0
"""Sites in ``vllm/v1/engine/core_client.py`` (API server / ``LLM`` process): hop 1 sender."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm._shm_embeds import extensions
from vllm._shm_embeds.config import min_bytes
from vllm._shm_embeds.counters import set_role
from vllm._shm_embeds.files import sizing
from vllm._shm_embeds.hops.hop1 import HandleOOBConsumer, digests_module
from vllm._shm_embeds.lifetime import process
from vllm._shm_embeds.lifetime.transfer import discard_shared, send_view
from vllm._shm_embeds.sites.records import ClientRecord, peek, record
from vllm._shm_embeds.sites.site import Site

logger = init_logger(__name__)

MODULE = "vllm.v1.engine.core_client"


class ArmingEncoder:
    """vLLM's ``MsgpackEncoder``, arming the consumer with the request's ``prompt_embeds``."""

    def __init__(self, inner: Any, consumer: HandleOOBConsumer) -> None:
        self._inner = inner
        self._consumer = consumer

    def encode(self, obj: Any) -> Any:
        return self._encode(self._inner.encode, obj)

    def encode_into(self, obj: Any, buf: bytearray) -> Any:
        return self._encode(self._inner.encode_into, obj, buf)

    def _encode(self, fn: Callable, obj: Any, *args: Any) -> Any:
        from vllm.v1.engine import EngineCoreRequest

        self._consumer.arm(obj.prompt_embeds if isinstance(obj, EngineCoreRequest) else None)
        try:
            return fn(obj, *args)
        except BaseException:
            _discard(self._consumer.take_created())
            raise
        finally:
            self._consumer.arm(None)

    def __getattr__(self, name: str) -> Any:
        # vLLM's own attributes (``oob_tensor_consumer``, ``aux_buffers``) read through
        return getattr(self._inner, name)


def _discard(handles: list) -> None:
    """Remove hop-1 segments that no EngineCore will ever adopt."""
    for handle in handles:
        discard_shared(handle)
    if handles:
        logger.debug("shm-embeds: removed %d segment(s) of a request not sent", len(handles))


def _send_view(request: Any) -> Any:
    """Put ``prompt_embeds`` over a ``send_view``; the tensor to put back, or None."""
    try:
        tensor = getattr(request, "prompt_embeds", None)
        view = send_view(tensor)
        if view is tensor:
            return None
        if (digests := digests_module()) is not None:
            digests.attach(view, digests.attached(tensor))  # the same bytes
        request.prompt_embeds = view
        return tensor
    except Exception:
        logger.warning("shm-embeds: hop 1 could not hold a sent tensor's pages",
                       exc_info=True)
        return None


def wrap_send_input(orig: Callable) -> Callable:
    def _send_input(self, request_type, request, *args, **kwargs):
        consumer = getattr(peek(self, ClientRecord), "consumer", None)
        if consumer is not None:  # (engine: AsyncMPClient._send_input's third parameter)
            consumer.send_to(args[0] if args else kwargs.get("engine"))
            consumer.take_created()
        held = _send_view(request)
        try:
            result = orig(self, request_type, request, *args, **kwargs)
        except BaseException:
            if consumer is not None:
                _discard(consumer.take_created())
            raise
        finally:
            if held is not None:
                request.prompt_embeds = held
        created = consumer.take_created() if consumer is not None else []
        if created and hasattr(result, "add_done_callback"):
            def _sent(fut, created=created):
                if fut.cancelled() or fut.exception() is not None:
                    _discard(created)
            result.add_done_callback(_sent)
        return result

    return _send_input


def _hop1_skip_reason(vllm_config: Any) -> str | None:
    """Why this client must send inline, or None."""
    model_config = getattr(vllm_config, "model_config", None)
    if not getattr(model_config, "enable_prompt_embeds", False):
        return "--enable-prompt-embeds is off"
    local = local_engines(vllm_config)
    if local is not None and not local:
        return "every EngineCore is on another node"
    return None


def local_engines(vllm_config: Any) -> frozenset[bytes] | None:
    """The ZMQ identities (``rank.to_bytes(2, "little")``) of this node's EngineCores when
    some are on other nodes, else None: DP ranks ``[data_parallel_index,
    + data_parallel_size_local)`` (``launch_core_engines``, ``vllm/v1/engine/utils.py`` 0.32)."""
    pc = vllm_config.parallel_config
    size, local = pc.data_parallel_size, pc.data_parallel_size_local
    if local >= size or getattr(pc, "local_engines_only", False):
        return None
    start = getattr(pc, "data_parallel_index", 0) or 0
    return frozenset(r.to_bytes(2, "little") for r in range(start, start + local))


def wrap_client_init(orig: Callable) -> Callable:
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        try:
            reason = _hop1_skip_reason(self.vllm_config)
            if reason is not None:
                logger.info("shm-embeds: hop 1 uses the stock path: %s", reason)
                return
            set_role("client")
            local = local_engines(self.vllm_config)
            digests = digests_module()
            block_tokens = None if digests is None else digests.block_tokens_of(
                getattr(self.vllm_config, "cache_config", None))
            consumer = HandleOOBConsumer(self.encoder.oob_tensor_consumer, block_tokens, local)
            self.encoder.oob_tensor_consumer = consumer
            self.encoder = ArmingEncoder(self.encoder, consumer)
            record(self, ClientRecord).consumer = consumer
            logger.info(
                "shm-embeds: hop 1 on in pid %d: prompt_embeds >= %d bytes go to "
                "the EngineCore%s as shared-memory handles", os.getpid(), min_bytes(),
                "" if local is None else
                f"s on this node ({len(local)}; those on other nodes get the bytes)")
            _on_client_init(self)  # model name for /metrics, /dev/shm size check
        except Exception:
            logger.exception("shm-embeds: hop 1 sender not installed; stock path")

    return __init__


def _on_client_init(client: Any) -> None:
    """Record the model name for ``/metrics``; client 0 logs the sizing warning. Never raises."""
    try:
        metrics = extensions.get("metrics", "metrics")
        if metrics is not None:
            metrics.set_model_name(client.vllm_config.model_config.served_model_name)
        if getattr(client, "client_index", 0) == 0:
            if warning := sizing.check_dir_size(client.vllm_config):
                logger.warning(warning)
    except Exception:
        logger.debug("shm-embeds: segment directory size not checked", exc_info=True)


def wrap_shutdown(orig: Callable, sweep: bool = False) -> Callable:
    """After ``orig``, unlink what this process still owns and log its summary; ``sweep``:
    also dead owners' segments (force-killed EngineCores')."""

    def shutdown(self, *args, **kwargs):
        try:
            return orig(self, *args, **kwargs)
        finally:
            if sweep:
                process.sweep_stale_segments(expected=True)
            process.shutdown()

    return shutdown


HOP1_RETIRE = ("vLLM routing prompt_embeds through its tensor IPC whenever "
               "--enable-prompt-embeds is on, with name-addressable segments (the seed PR's "
               "design)")

SITES = (
    Site(key="client_init", group="hop1", module=MODULE, qualname="MPClient.__init__",
         params=("vllm_config",),
         marks=("self.encoder = MsgpackEncoder(",),
         wrap=wrap_client_init,
         what="after it, the encoder offers the request's prompt_embeds to the hop-1 consumer "
              "(MsgpackEncoder.oob_tensor_consumer), other tensors keep theirs; with DP "
              "engines on other nodes, only this node's EngineCores get handles; logs `hop 1 on`",
         why="vLLM sends prompt_embeds as ZMQ frames: copied into and out of the socket",
         retire=HOP1_RETIRE),
    Site(key="client_send_sync", group="hop1", module=MODULE, qualname="SyncMPClient._send_input",
         params=("request",),
         marks=("self.encoder.encode(request)",),
         wrap=wrap_send_input,
         what="prompt_embeds held by a mapping of ours rides a send view (pages kept until "
              "ZMQ is done); a segment made for a message whose encode or send fails is removed",
         why="send_multipart(copy=False) reads the tensor after the call returns; nothing "
             "else removes a failed send's segment before the process exits",
         retire="an encoder hook that owns the resources it makes"),
    Site(key="client_send_async", group="hop1", module=MODULE, qualname="AsyncMPClient._send_input",
         params=("request",),
         marks=("self.encoder.encode(request)",),
         wrap=wrap_send_input,
         what="the same, told which EngineCore the message is for (DP: a remote one gets bytes)",
         why="the same",
         retire="an encoder hook that owns the resources it makes"),
    Site(key="client_shutdown", group="hop1", module=MODULE, qualname="MPClient.shutdown",
         wrap=functools.partial(wrap_shutdown, sweep=True),
         what="unlink segments never adopted and force-killed EngineCores'; log the summary",
         why="a force-killed EngineCore leaves the segments it adopted behind",
         retire="upstream lifetime tracking of IPC tensors"),
)
