# SPDX-License-Identifier: Apache-2.0
"""Sites in ``vllm/entrypoints/`` (API server): our body gate in vLLM's app.

Each site below says what it does, why, and what upstream change would retire it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from vllm.logger import init_logger

from vllm._shm_embeds.counters import set_role
from vllm._shm_embeds.sites.site import STATUS, Site

logger = init_logger(__name__)

APP = "vllm.entrypoints.launchers.app"


def wrap_init_middleware(orig: Callable) -> Callable:
    """``init_entrypoints_middleware(args, app, supported_tasks)``: add the body
    gate (``ext/binary/gate.py``) with the formats that are on, first, so that it
    runs inside vLLM's own middleware (authentication, CORS):
    ``add_middleware`` puts later ones outside."""

    @functools.wraps(orig)
    def init_entrypoints_middleware(args, app, supported_tasks, *a, **kw):
        try:
            from vllm._shm_embeds.ext.binary.gate import BodyGate

            formats = body_formats()
            if formats:
                app.add_middleware(BodyGate, formats=formats)
                set_role("client")
        except Exception:
            logger.exception("shm-embeds: request body formats not enabled; stock app")
        return orig(args, app, supported_tasks, *a, **kw)

    return init_entrypoints_middleware


def body_formats() -> list:
    """The formats of ``formats.formats()`` that are on (their group
    patched, their setting on), loaded, in order; each logged."""
    from vllm._shm_embeds.ext.binary.formats import formats as all_formats

    formats = []
    for f in all_formats():
        if STATUS.get(f.group):
            logger.info("shm-embeds: %s off (its vLLM sites are not patched)", f.what)
        elif not f.enabled():
            logger.info("shm-embeds: %s off by configuration", f.what)
        else:
            try:
                formats.append(f.load())
            except Exception:
                logger.exception("shm-embeds: %s not enabled", f.what)
                continue
            logger.info("shm-embeds: %s accepted on /v1/completions and "
                        "/v1/chat/completions", f.what)
    return formats


# What upstream change would retire the middleware sites.
APP_RETIRE = ("a general-plugin hook for ASGI middleware (endpoint plugins need "
              "VLLM_PLUGINS, which would turn off the user's other general plugins)")

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
         what="adds the body gate with the formats that are on (ext/binary/formats.py), first, "
              "i.e. inside vLLM's own middleware (authentication, CORS)",
         why="request bodies must be read before vLLM parses them",
         retire=APP_RETIRE),
)
