# SPDX-License-Identifier: Apache-2.0
"""Sites in ``vllm/entrypoints/serve/instrumentator/`` (API server): our families on ``/metrics``.

Each site below says what it does, why, and what upstream change would retire it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm._shm_embeds.sites.site import Site

logger = init_logger(__name__)

METRICS = "vllm.entrypoints.serve.instrumentator.metrics"
METRICS_RETIRE = "a collector hook on vLLM's multiprocess /metrics registry"


def wrap_attach_router(orig: Callable) -> Callable:
    """``attach_router(app)`` (``/metrics``): also adds our ``MetricsMiddleware``."""

    def attach_router(app: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(app, *args, **kwargs)
        try:
            from vllm._shm_embeds.ext.metrics.metrics import MetricsMiddleware

            app.add_middleware(MetricsMiddleware)
        except Exception:
            logger.exception("shm-embeds: metrics not added to /metrics")
        return result

    return attach_router


SITES = (
    Site(key="metrics_route", group="metrics", module=METRICS, qualname="attach_router",
         params=("app",),
         marks=("Instrumentator(", '"/metrics"'),
         wrap=wrap_attach_router,
         what="after vLLM mounts /metrics, a middleware appends the vllm:shm_embeds_* "
              "families of every process",
         why="with several API servers the /metrics route builds its own registry per "
             "scrape",
         retire=METRICS_RETIRE),
    # Its caller imports attach_router at call time, so it sees the wrapper.
    Site(key="metrics_caller", group="metrics", module="vllm.entrypoints.serve.instrumentator",
         qualname="register_instrumentator_api_routers",
         params=("app",),
         marks=("from .metrics import attach_router",),
         what="imports attach_router at call time, so it sees the wrapper",
         why="metrics_route is patched on its module",
         retire=METRICS_RETIRE),
)
