# SPDX-License-Identifier: Apache-2.0
"""Sites in ``vllm/v1/engine/core.py`` (EngineCore process): hop 1 receiver."""

from __future__ import annotations

from collections.abc import Callable

from vllm.logger import init_logger

from vllm._shm_embeds.counters import set_role
from vllm._shm_embeds.hops.hop1 import HandleOOBProvider
from vllm._shm_embeds.lifetime import process
from vllm._shm_embeds.sites.core_client import HOP1_RETIRE
from vllm._shm_embeds.sites.site import Site

MODULE = "vllm.v1.engine.core"

logger = init_logger(__name__)


def wrap_engine_input(orig: Callable) -> Callable:
    def process_input_sockets(self, *args, **kwargs):
        try:
            set_role("engine")
            process.start_engine_reaper()
            self.tensor_ipc_receiver = HandleOOBProvider(self.tensor_ipc_receiver)
        except Exception:  # never into vLLM's input thread: stock then
            logger.exception("shm-embeds: hop 1 receiver not installed; stock path")
        return orig(self, *args, **kwargs)

    return process_input_sockets


def wrap_engine_preprocess(orig: Callable) -> Callable:
    def preprocess_add_request(self, request, *args, **kwargs):
        provider = getattr(self, "tensor_ipc_receiver", None)
        if isinstance(provider, HandleOOBProvider) and request.prompt_embeds is not None:
            error = provider.is_failed(request.prompt_embeds)
            if error is not None:
                raise ValueError(error)
        return orig(self, request, *args, **kwargs)

    return preprocess_add_request


SITES = (
    Site(key="engine_input", group="hop1", module=MODULE,
         qualname="EngineCoreProc.process_input_sockets",
         marks=("oob_tensor_provider=self.tensor_ipc_receiver",),
         wrap=wrap_engine_input,
         what="before it builds its decoders, self.tensor_ipc_receiver is wrapped by the "
              "hop-1 provider, which adopts segments",
         why="the decoders take their tensor provider from that attribute at start",
         retire=HOP1_RETIRE),
    Site(key="engine_preprocess", group="hop1", module=MODULE,
         qualname="EngineCore.preprocess_add_request",
         params=("request",),
         wrap=wrap_engine_preprocess,
         what="a request whose segment could not be adopted is rejected",
         why="a request-scoped error, not a dead input thread",
         retire="a provider error path in vLLM's decoder"),
)
