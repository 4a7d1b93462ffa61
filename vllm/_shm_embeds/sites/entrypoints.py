# SPDX-License-Identifier: Apache-2.0
"""Sites in ``vllm/entrypoints/`` (API server): our middlewares in vLLM's app.

Each site below says what it does, why, and what upstream change would retire it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm._shm_embeds import config
from vllm._shm_embeds.counters import set_role
from vllm._shm_embeds.sites.site import STATUS, Site

logger = init_logger(__name__)

APP = "vllm.entrypoints.launchers.app"
METRICS = "vllm.entrypoints.serve.instrumentator.metrics"


def wrap_init_middleware(orig: Callable) -> Callable:
    """``init_entrypoints_middleware(args, app, supported_tasks)``: add the binary
    and JSON body middlewares first, so that they run inside vLLM's own
    (authentication, CORS): ``add_middleware`` puts later ones outside."""

    @functools.wraps(orig)
    def init_entrypoints_middleware(args, app, supported_tasks, *a, **kw):
        try:
            from vllm._shm_embeds.http.binary import BinaryBodyMiddleware

            app.add_middleware(BinaryBodyMiddleware)
            set_role("client")
            logger.info("shm-embeds: binary prompt_embeds bodies accepted on "
                        "/v1/completions and /v1/chat/completions")
            _add_json_middleware(app)
            _add_region_middleware(app)
        except Exception:
            logger.exception("shm-embeds: binary bodies not enabled; stock app")
        return orig(args, app, supported_tasks, *a, **kw)

    return init_entrypoints_middleware


def _add_json_middleware(app: Any) -> None:
    """Add the JSON-body middleware (outside the binary one); never raises."""
    if STATUS.get("json"):
        return
    if not config.settings().json:
        logger.info("shm-embeds: JSON body path off (VLLM_SHM_EMBEDS_JSON=0)")
        return
    try:
        from vllm._shm_embeds.http.json_body import JsonBodyMiddleware

        app.add_middleware(JsonBodyMiddleware)
        logger.info("shm-embeds: base64 JSON prompt_embeds decoded off the event loop "
                    "into shared memory (bodies >= %d bytes)", config.min_bytes())
    except Exception:
        logger.exception("shm-embeds: JSON body path not enabled; stock app")


def _add_region_middleware(app: Any) -> None:
    """With ``VLLM_SHM_EMBEDS_REGIONS`` set, add the registered-regions middleware
    (it opens the socket at the app's start-up); never raises."""
    if STATUS.get("regions") or not config.regions_path():
        return
    try:
        from vllm._shm_embeds.http.region_refs import RegionRefsMiddleware

        app.add_middleware(RegionRefsMiddleware)
    except Exception:
        logger.exception("shm-embeds: registered regions not enabled; stock app")


def wrap_attach_router(orig: Callable) -> Callable:
    """``attach_router(app)`` (``/metrics``): also adds our ``MetricsMiddleware``."""

    def attach_router(app: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(app, *args, **kwargs)
        try:
            from vllm._shm_embeds.http.metrics import MetricsMiddleware

            app.add_middleware(MetricsMiddleware)
        except Exception:
            logger.exception("shm-embeds: metrics not added to /metrics")
        return result

    return attach_router


# What upstream change would retire the middleware sites.
APP_RETIRE = ("a general-plugin hook for ASGI middleware (endpoint plugins need "
              "VLLM_PLUGINS, which would turn off the user's other general plugins)")
METRICS_RETIRE = "a collector hook on vLLM's multiprocess /metrics registry"

SITES = (
    # build_app calls init_entrypoints_middleware through its module's global.
    Site(key="app_build", group="binary", module=APP, qualname="build_app",
         params=("args",),
         marks=("init_entrypoints_middleware(args, app, supported_tasks)",),
         what="must call init_entrypoints_middleware through its module global",
         why="app_middleware replaces that global",
         retire=APP_RETIRE),
    Site(key="app_middleware", group="binary", module="vllm.entrypoints.serve.middleware.register",
         qualname="init_entrypoints_middleware",
         params=("args", "app", "supported_tasks"),
         marks=("app.add_middleware(",),
         wrap=wrap_init_middleware,
         patch_in=APP,
         what="adds the binary body middleware, and the JSON and regions ones when their "
              "groups are on, first, i.e. inside vLLM's own (authentication, CORS)",
         why="request bodies must be read before vLLM parses them",
         retire=APP_RETIRE),
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
