# SPDX-License-Identifier: Apache-2.0
"""Every vLLM site shm-embeds checks or patches: one registry, one status.

Each site is a ``site.Site`` next to its wrapper, in a module named for the vLLM module
it patches; a group whose sites do not all hold is left entirely stock.

May import: base, files, lifetime, hops.
Only this layer (and ``plugin.py``) imports vLLM's classes.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from vllm.logger import init_logger

from vllm._shm_embeds import extensions
from vllm._shm_embeds.extensions import Group
from vllm._shm_embeds.lifetime import process
from vllm._shm_embeds.sites import (core_client, engine_core, multiproc_executor, prompt_embeds,
                                    scheduler, shm_broadcast)
from vllm._shm_embeds.sites.site import APPLY, STATUS, Site

logger = init_logger(__name__)

# The core's modules that declare sites (one per vLLM module patched).
CORE_SITE_MODULES = (core_client, engine_core, multiproc_executor, scheduler, shm_broadcast,
                     prompt_embeds)

CORE_GROUPS: dict[str, Group] = {
    "hop1": Group((), False, "shm-embeds: hop1 left stock in pid %d, vLLM sites missing: %s",
                  "API server -> EngineCore"),
    "hop2": Group((), False, "shm-embeds: hop2 left stock in pid %d, vLLM sites missing: %s",
                  "EngineCore -> TP workers"),
    "remote": Group(("hop2",), False, "shm-embeds: hop 2 goes stock for every reader when "
                    "a reader is on another node, in pid %d: %s",
                    "hop 2 with readers on other nodes: the local readers keep their handles, "
                    "the remote ones get a placeholder (no later stage needs the values) or, "
                    "with a first-stage reader among them, the bytes"),
    "pp_upload": Group((), False, "shm-embeds: later pipeline stages of the newer model "
                       "runner upload prompt_embeds as stock does, in pid %d: %s",
                       "the newer model runner's per-request upload, skipped on later "
                       "pipeline stages; considered only in a worker that loaded that runner",
                       prompt_embeds.wanted),
    "release": Group((), False, "shm-embeds: the EngineCore keeps a finished request's "
                     "embeds until vLLM drops it, and a segment's name goes once every TP "
                     "rank mapped it (the budget then counts only requests not yet "
                     "scheduled), in pid %d: %s",
                     "names and pages of a request's segment go when vLLM frees it"),
}


def __getattr__(name: str) -> object:
    """``SITE_MODULES``, ``GROUPS`` and ``SITES``: the core's, then the loaded extensions',
    made on first use (PEP 562) so that an extension's site module may import this."""
    if name not in ("SITE_MODULES", "GROUPS", "SITES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    modules = (*CORE_SITE_MODULES, *extensions.site_modules())
    groups = {**CORE_GROUPS, **{g: group for ext in extensions.loaded().values()
                                for g, group in ext.groups.items()}}
    globals().update(SITE_MODULES=modules, GROUPS=groups,
                     SITES=tuple(site for module in modules for site in module.SITES
                                 if site.group in groups))
    return globals()[name]


def _registry(name: str) -> Any:
    return globals()[name] if name in globals() else __getattr__(name)

APP_MODULE = "vllm.entrypoints.launchers.app"  # imported in an API server only


def check(group: str) -> tuple[list[str], list[tuple[Site, tuple]]]:
    """Resolve every site of ``group``: ``(problems, [(site, (owner, attr, fn))])``."""
    problems, resolved = [], []
    for site in _registry("SITES"):
        if site.group != group:
            continue
        try:
            resolved.append((site, site.resolve()))
        except Exception as e:  # any mismatch leaves the group stock
            problems.append(f"{site.module}.{site.qualname}: {e}")
    return problems, resolved


def apply() -> dict[str, list[str]]:
    """Check and patch every group this process needs; never raises. :data:`STATUS`."""
    api_server = APP_MODULE in sys.modules
    for group, g in _registry("GROUPS").items():
        if group in STATUS or (g.server_only and not api_server) or (
                g.wanted is not None and not g.wanted()):
            continue
        try:
            problems, resolved = check(group)
            problems[:0] = [f"{'hop 1' if need == 'hop1' else need} is off"
                            for need in g.needs if STATUS.get(need)]
            if not problems and g.before_patch is not None:
                g.before_patch()
            if not problems:
                for site, (owner, attr, fn) in resolved:
                    site.patch(owner, attr, fn)
        except Exception as e:
            logger.exception("shm-embeds: %s not enabled; vLLM untouched", group)
            problems = [f"unexpected error: {e}"]
        STATUS[group] = problems
        if problems:
            logger.warning(g.message, os.getpid(), "; ".join(problems))
    # Without free_request, a segment's name goes once every TP rank mapped it.
    process.current().release_known = not STATUS.get("release")
    return STATUS


APPLY.append(lambda: apply())  # for groups decided late (site.apply_again)


def get(key: str) -> Site:
    """The site named ``key``; raises KeyError."""
    for site in _registry("SITES"):
        if site.key == key:
            return site
    raise KeyError(key)
