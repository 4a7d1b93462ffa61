# SPDX-License-Identifier: Apache-2.0
"""Sites in ``vllm/v1/executor/multiproc_executor.py``: hop 2 (EngineCore and TP workers).

Each site below says what it does, why, and what upstream change would retire it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from vllm.logger import init_logger

from vllm._shm_embeds import hop2, process
from vllm._shm_embeds.counters import set_role
from vllm._shm_embeds.handle import MAX_READERS, SharedTensorHandle, ShmEmbedsError
from vllm._shm_embeds.sites.core_client import wrap_shutdown
from vllm._shm_embeds.sites.site import Site

logger = init_logger(__name__)

MODULE = "vllm.v1.executor.multiproc_executor"


def _hop2_readers(executor: Any) -> int:
    """Local readers to broadcast handles to, or 0 for the stock path (logged once)."""
    readers = executor.__dict__.get("_shm_embeds_readers")
    if readers is not None:
        return readers
    mq = getattr(executor, "rpc_broadcast_mq", None)
    model_config = getattr(executor.vllm_config, "model_config", None)
    reason = None
    if not getattr(model_config, "enable_prompt_embeds", False):
        reason = "--enable-prompt-embeds is off"
    elif mq is None:
        reason = "no broadcast queue in this executor"
    elif getattr(mq, "n_remote_reader", 0) > 0:
        reason = f"{mq.n_remote_reader} reader(s) on other nodes cannot map local files"
    elif not 0 < mq.n_local_reader <= MAX_READERS:
        reason = f"{mq.n_local_reader} local readers is out of range"
    readers = 0 if reason else mq.n_local_reader
    if reason:
        logger.info("shm-embeds: hop 2 uses the stock path: %s", reason)
    else:
        set_role("engine")
        logger.info(
            "shm-embeds: hop 2 sends prompt_embeds as handles to %d local TP reader(s)",
            readers,
        )
    executor._shm_embeds_readers = readers
    return readers


def _rpc_args(args: tuple, kwargs: dict) -> tuple:
    # collective_rpc(method, timeout=None, args=(), kwargs=None, ...)
    if "args" in kwargs:
        return kwargs["args"] or ()
    return args[1] if len(args) > 1 else ()


def wrap_executor_rpc(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def collective_rpc(self, method, *args, **kwargs):
        readers = _hop2_readers(self)
        if not readers:
            return orig(self, method, *args, **kwargs)
        swapped: list = []
        try:
            process.collect()
            for arg in _rpc_args(args, kwargs):
                new_reqs = getattr(arg, "scheduled_new_reqs", None)
                if new_reqs:
                    swapped += hop2.externalize_prompt_embeds(new_reqs, readers)
        except Exception:  # never into vLLM's engine loop: this step goes stock
            logger.warning("shm-embeds: hop 2 sends this step the stock way after an "
                           "unexpected error", exc_info=True)
            hop2.restore_prompt_embeds(swapped)
            swapped = []
        try:
            result = orig(self, method, *args, **kwargs)
        finally:
            hop2.restore_prompt_embeds(swapped)
        if swapped:
            # Once the reply arrives every TP rank has dequeued (and mapped)
            # the step: the broadcasts are settled (names of freed requests go).
            if isinstance(result, Future):
                result.add_done_callback(lambda _: _collect_quietly())
            else:
                _collect_quietly()
        return result

    return collective_rpc


def _collect_quietly() -> None:
    """``process.collect`` that never raises (the reaper retries)."""
    try:
        process.collect()
    except Exception:
        logger.debug("shm-embeds: safe point failed", exc_info=True)


def _all_ranks_ok(ok: bool) -> bool:
    """True if every worker of this engine says ``ok`` (TP group, then PP group).

    The broadcast's readers are this engine's TP x PP workers; vLLM's world
    group may span DP ranks too (``world_size_across_dp``), so it is not used.
    """
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return hop2.all_ranks_ok(ok, (get_tp_group(), get_pp_group()))


def wrap_worker_rpc(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _execute_worker_rpc(self, rpc_request, *args, **kwargs):
        method, rpc_args, _, output_rank = rpc_request
        carried = [
            arg.scheduled_new_reqs for arg in rpc_args
            if any(isinstance(getattr(r, "prompt_embeds", None), SharedTensorHandle)
                   for r in getattr(arg, "scheduled_new_reqs", None) or ())
        ]
        if not carried:
            return orig(self, rpc_request, *args, **kwargs)
        set_role("worker")
        index = getattr(self.rpc_broadcast_mq, "local_reader_rank", -1)
        error: Exception | None = None
        for new_reqs in carried:
            try:
                hop2.internalize_prompt_embeds(new_reqs, index if index >= 0 else None)
            except Exception as e:
                error = error or e
        if error is not None:
            logger.error("shm-embeds: could not map prompt_embeds for %s: %s", method, error)
        if not _all_ranks_ok(error is None):
            # Every rank ends this step the same way: the output rank reports
            # the failure, vLLM fails the engine as on any worker error.
            if error is None:
                error = ShmEmbedsError("another TP/PP rank could not map prompt_embeds")
            if output_rank is None or self.rank == output_rank:
                self.handle_output(ShmEmbedsError(
                    f"shm-embeds: prompt_embeds could not be mapped on every rank: {error}"
                ))
            return None
        return orig(self, rpc_request, *args, **kwargs)

    return _execute_worker_rpc


# What upstream change would retire the hop-2 sites.
HOP2_RETIRE = ("--enable-shm-tensor-arena without its size cap and slot limit, reusing "
               "hop 1's segment")

SITES = (
    Site("executor_rpc", "hop2", MODULE, "MultiprocExecutor.collective_rpc",
         ("method", "args", "kwargs"), ("self.rpc_broadcast_mq.enqueue(",), wrap_executor_rpc,
         what="NewRequestData.prompt_embeds in a SchedulerOutput argument is swapped for a "
              "handle while the message is enqueued, then restored; skipped when the queue "
              "has remote readers",
         why="above 16 MiB the broadcast sends each TP reader its own copy over ZMQ",
         retire=HOP2_RETIRE),
    Site("worker_rpc", "hop2", MODULE, "WorkerProc._execute_worker_rpc", ("rpc_request",),
         wrap=wrap_worker_rpc,
         what="handles are mapped back to tensors before the worker method runs; all ranks "
              "agree (all-reduce over TP, then PP) whether every rank mapped them",
         why="a rank that could not map must fail the step on every rank, none left waiting",
         retire=HOP2_RETIRE),
    Site("executor_shutdown", "hop2", MODULE, "MultiprocExecutor.shutdown", wrap=wrap_shutdown,
         what="unlink what is left, log the summary",
         why="segments still owned at shutdown", retire=HOP2_RETIRE),
    Site("worker_shutdown", "hop2", MODULE, "WorkerProc.shutdown", wrap=wrap_shutdown,
         what="log the summary", why="the worker's counts at exit", retire=HOP2_RETIRE),
)
