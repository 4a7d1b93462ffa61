# SPDX-License-Identifier: Apache-2.0
"""Sites in ``vllm/v1/executor/multiproc_executor.py``: hop 2 (EngineCore and TP workers)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from vllm.logger import init_logger

import vllm._shm_embeds.sites.prompt_embeds as prompt_embeds_sites
from vllm._shm_embeds import extensions
from vllm._shm_embeds.counters import Event, count_many, count_reason, set_role
from vllm._shm_embeds.handle import HOP2_WIRE, ShmEmbedsError, StepEmbeds
from vllm._shm_embeds.hops import hop2
from vllm._shm_embeds.lifetime import process
from vllm._shm_embeds.lifetime.transfer import dense_nbytes, eligible
from vllm._shm_embeds.sites.core_client import wrap_shutdown
from vllm._shm_embeds.sites.records import ATTR, ExecutorRecord, QueueRecord, peek, record
from vllm._shm_embeds.sites.site import STATUS, Site

logger = init_logger(__name__)

MODULE = "vllm.v1.executor.multiproc_executor"


def worker_hop2_wire(worker: Any = None) -> int | None:
    """``handle.HOP2_WIRE`` if this worker's ``hop2`` sites are patched, else None."""
    return HOP2_WIRE if STATUS.get("hop2") == [] else None


def _probe() -> Callable:
    """The callable sent to every worker (by value; docs/design.md, "Module notes")."""
    def wire(worker: Any = None) -> int | None:
        try:
            from vllm._shm_embeds.sites.multiproc_executor import worker_hop2_wire
            answer = worker_hop2_wire(worker)
            return answer if type(answer) is int else None
        except Exception:
            return None

    return wire


def _workers_join(executor: Any, rpc: Callable) -> str | None:
    """None if every worker of this engine, on every node, runs this plugin's hop 2, else
    why not (``rpc``: vLLM's unwrapped ``collective_rpc``; raises what it raises)."""
    answers = rpc(executor, _probe())
    if not isinstance(answers, list) or not answers:
        return "the workers gave no answer to the hop-2 probe"
    if not all(type(a) is int and a == HOP2_WIRE for a in answers):
        return ("a worker does not run this shm-embeds version's hop 2 (wire format "
                f"{HOP2_WIRE}; answers {sorted(set(map(repr, answers)))}): set "
                "VLLM_SHM_EMBEDS=1 and install the same shm-embeds on every node")
    return None


def _stock_executor(executor: Any) -> str | None:
    """Why this ``MultiprocExecutor`` subclass keeps hop 2 stock, or None (Ray's V2
    executor, ``ray_executor_v2.py`` 0.32, is untested)."""
    if type(executor).__module__.startswith("vllm.v1.executor.ray"):
        return f"{type(executor).__name__} is not tested with shm-embeds"
    return None


def _hop2_plan(executor: Any, rpc: Callable) -> ExecutorRecord:
    """The executor's record, with ``plan`` None for stock (logged once per queue); every
    worker is asked first (``rpc``: vLLM's ``collective_rpc``)."""
    mq = getattr(executor, "rpc_broadcast_mq", None)
    known = peek(executor, ExecutorRecord)
    if known is not None and known.mq is mq:
        return known
    rec = ExecutorRecord(mq)
    model_config = getattr(executor.vllm_config, "model_config", None)
    n_remote = getattr(mq, "n_remote_reader", 0)
    reason = plan = None
    if not getattr(model_config, "enable_prompt_embeds", False):
        reason = "--enable-prompt-embeds is off"
    elif mq is None:
        reason = "no broadcast queue in this executor"
    elif (untested := _stock_executor(executor)) is not None:
        reason = untested
    elif n_remote > 0 and STATUS.get("remote") != []:  # the enqueue split (shm_broadcast.py)
        reason = (f"{n_remote} reader(s) on other nodes and no split of the "
                  "broadcast (the remote sites are off)")
        rec.stock_remote = True
    else:
        try:  # the first stage's ranks: TP x PCP (``vllm/config/parallel.py`` 0.32)
            pc = executor.vllm_config.parallel_config
            first_stage = (getattr(pc, "tensor_parallel_size", 1)
                           * getattr(pc, "prefill_context_parallel_size", 1))
            plan = hop2.reader_plan(first_stage, mq.n_local_reader, n_remote)
        except (ValueError, TypeError, AttributeError) as e:
            reason = f"no reader plan: {e}"
        if plan is not None:
            reason = _workers_join(executor, rpc)
            if reason is not None:
                plan = None
            elif plan.remote_bytes and (nodes := extensions.get("nodes", "node_copy")) is not None:
                plan = dataclasses.replace(plan, in_step=nodes.enable(executor, rpc))
        if plan is None and n_remote > 0:
            rec.stock_remote = True  # counted per tensor
    if plan is None:
        logger.info("shm-embeds: hop 2 uses the stock path: %s", reason)
    else:
        set_role("engine")
        logger.info(
            "shm-embeds: hop 2 sends prompt_embeds as handles to %d local first-stage "
            "reader(s); %d local later-stage reader(s) map nothing; %d reader(s) on other "
            "nodes get %s", plan.handle_readers, plan.local_later, plan.remote,
            ("the bytes once per node, inside the step" if plan.in_step else "the bytes")
            if plan.remote_bytes else "a placeholder")
    rec.plan = plan
    executor.__dict__[ATTR] = rec
    return rec


def _new_reqs(args: tuple, kwargs: dict) -> list[list]:
    """The non-empty ``scheduled_new_reqs`` of the RPC's arguments (``collective_rpc(method,
    timeout=None, args=(), kwargs=None, ...)``)."""
    if "args" in kwargs:
        rpc_args = kwargs["args"] or ()
    else:
        rpc_args = args[1] if len(args) > 1 else ()
    return [reqs for arg in rpc_args if (reqs := getattr(arg, "scheduled_new_reqs", None))]


def _count_stock_remote(new_reqs: list[list]) -> None:
    """Count the tensors that go stock because readers are remote and the split is off."""
    for reqs in new_reqs:
        for req in reqs:
            tensor = getattr(req, "prompt_embeds", None)
            if isinstance(tensor, torch.Tensor):
                count_many({Event.HOP2_STOCK_TENSORS: 1,
                            Event.HOP2_STOCK_BYTES: dense_nbytes(tensor)})
                count_reason(Event.FALLBACK, eligible(tensor) or "remote", hop="2")


def _send_views(new_reqs: list[list]) -> list:
    """``hop2.send_views`` for each list of ``new_reqs``. Never raises."""
    held: list = []
    try:
        for reqs in new_reqs:
            held += hop2.send_views(reqs)
    except Exception:
        logger.warning("shm-embeds: hop 2 could not hold a sent tensor's pages",
                       exc_info=True)
        hop2.restore_prompt_embeds(held)
        held = []
    return held


def _externalize(mq: Any, plan: hop2.ReaderPlan, new_reqs: list[list]) -> list:
    """``hop2.externalize_prompt_embeds`` for each list of ``new_reqs``, the remote readers'
    forms put on ``mq``'s record; never raises (after an error: [], stock)."""
    swapped: list = []
    try:
        process.collect()
        for reqs in new_reqs:
            swapped += hop2.externalize_prompt_embeds(reqs, plan.handle_readers)
        if swapped and plan.remote:
            # what the readers on other nodes get instead (shm_broadcast.py)
            record(mq, QueueRecord).remote = [
                (req, hop2.remote_form(tensor, plan)) for req, tensor in swapped]
    except Exception:  # never into vLLM's engine loop: this step goes stock
        logger.warning("shm-embeds: hop 2 sends this step the stock way after an "
                       "unexpected error", exc_info=True)
        hop2.restore_prompt_embeds(swapped)
        swapped = []
    return swapped


def wrap_executor_rpc(orig: Callable) -> Callable:
    def collective_rpc(self, method, *args, **kwargs):
        known = _hop2_plan(self, orig)
        plan, mq, new_reqs = known.plan, known.mq, _new_reqs(args, kwargs)
        if plan is None and known.stock_remote:
            _quietly("counting", _count_stock_remote, new_reqs)
        swapped = _externalize(mq, plan, new_reqs) if plan is not None else []
        held = _send_views(new_reqs)  # the tensors left stock
        try:
            result = orig(self, method, *args, **kwargs)
        finally:
            hop2.restore_prompt_embeds(held)
            hop2.restore_prompt_embeds(swapped)
            # set last in the try; never an error of ours in place of vLLM's
            if plan is not None and (queued := peek(mq, QueueRecord)) is not None:
                queued.remote = None
        if swapped:
            _quietly("counting", hop2.count_readers, plan, swapped)  # what each reader got
            # once the reply arrives every TP rank has mapped the step
            if isinstance(result, Future):
                result.add_done_callback(lambda _: _quietly("safe point", process.collect))
            else:
                _quietly("safe point", process.collect)
        return result

    return collective_rpc


def _quietly(what: str, fn: Callable, *args: Any) -> None:
    """``fn(*args)``, never raising: counting only, or a safe point (the reaper retries)."""
    try:
        fn(*args)
    except Exception:
        logger.debug("shm-embeds: %s failed", what, exc_info=True)


_STAGES = hop2.StageChain()  # one worker per process


def _all_ranks_ok(ok: bool) -> bool:
    """True if every worker of this engine says ``ok``: an all-reduce over TP (and PCP),
    then the earlier stages' outcome. Not the world group: it may span DP ranks."""
    from vllm.distributed import parallel_state as ps

    groups = [ps.get_tp_group()]
    if hasattr(ps, "get_pcp_group"):
        groups.append(ps.get_pcp_group())
    return _STAGES.agree(hop2.all_ranks_ok(ok, groups), ps.get_pp_group())


def wrap_worker_rpc(orig: Callable) -> Callable:
    def _execute_worker_rpc(self, rpc_request, *args, **kwargs):
        prompt_embeds_sites.maybe_patch()
        method, rpc_args, _, output_rank = rpc_request
        carried = [arg.scheduled_new_reqs for arg in rpc_args
                   if hop2.carries_embeds(getattr(arg, "scheduled_new_reqs", None))]
        if not carried:
            return orig(self, rpc_request, *args, **kwargs)
        set_role("worker")
        first = prompt_embeds_sites.first_pp_stage()
        index = getattr(self.rpc_broadcast_mq, "local_reader_rank", -1)
        error: Exception | None = None
        nodes = extensions.get("nodes", "node_copy") if first else None
        step = nodes.worker_step(carried) if nodes is not None else None
        for new_reqs in carried:
            try:
                hop2.internalize_prompt_embeds(new_reqs, index if index >= 0 else None, first)
            except Exception as e:
                error = error or e
        finish: Callable[[], None] | None = None
        if step is not None:  # never raises; every rank of the step's exchange takes part
            finish, failed = step()
            error = error or failed
        if error is None and any(isinstance(r.prompt_embeds, StepEmbeds)
                                 for reqs in carried for r in reqs):
            error = ShmEmbedsError("prompt_embeds to receive inside the step did not arrive "
                                   "(no extension received them on this rank)")
        # all ranks agree whether every rank has its prompt_embeds (then ``finish``: every
        # rank mapped what it needs); then vLLM's method, or the same failure on every rank
        if error is not None:
            logger.error("shm-embeds: could not map prompt_embeds for %s: %s", method, error)
        try:
            agreed = _all_ranks_ok(error is None)
        except Exception as e:  # a peer died mid all-reduce: vLLM's error reply, not a crash
            logger.error("shm-embeds: the ranks' agreement on prompt_embeds failed: %s", e)
            agreed, error = False, error or e
        finally:
            if finish is not None:
                finish()
        if not agreed:  # the output rank reports the failure
            error = error or ShmEmbedsError("another TP/PP rank could not map prompt_embeds")
            if output_rank is None or self.rank == output_rank:
                self.handle_output(ShmEmbedsError(
                    f"shm-embeds: prompt_embeds could not be mapped on every rank: {error}"))
            return None
        return orig(self, rpc_request, *args, **kwargs)

    return _execute_worker_rpc


HOP2_RETIRE = ("--enable-shm-tensor-arena without its size cap and slot limit, reusing "
               "hop 1's segment")

SITES = (
    Site(key="executor_rpc", group="hop2", module=MODULE,
         qualname="MultiprocExecutor.collective_rpc",
         params=("method", "args", "kwargs"),
         marks=("self.rpc_broadcast_mq.enqueue(",),
         wrap=wrap_executor_rpc,
         what="NewRequestData.prompt_embeds of a SchedulerOutput is a handle while enqueued "
              "(flags for local first-stage readers only), then restored; remote readers get "
              "a placeholder or the bytes (mq_enqueue); our bytes sent by ZMQ ride send views",
         why="above 16 MiB the broadcast sends each TP reader its own copy over ZMQ, "
             "without a copy (copy=False): ZMQ reads it after enqueue returns",
         retire=HOP2_RETIRE),
    Site(key="worker_rpc", group="hop2", module=MODULE, qualname="WorkerProc._execute_worker_rpc",
         params=("rpc_request",),
         wrap=wrap_worker_rpc,
         what="handles are mapped back before the worker method runs (a later pipeline stage "
              "maps nothing: a NaN placeholder of the shape and dtype); all ranks agree "
              "whether all mapped (all-reduce per stage, outcomes passed down the pipeline)",
         why="a rank that could not map must fail the step on every rank, none left "
             "waiting; later stages read only the length (gpu_model_runner._preprocess: "
             "`elif self.enable_prompt_embeds and is_first_rank`)",
         retire=HOP2_RETIRE),
    Site(key="executor_shutdown", group="hop2", module=MODULE,
         qualname="MultiprocExecutor.shutdown",
         wrap=wrap_shutdown,
         what="unlink what is left, log the summary",
         why="segments still owned at shutdown",
         retire=HOP2_RETIRE),
    Site(key="worker_shutdown", group="hop2", module=MODULE, qualname="WorkerProc.shutdown",
         wrap=wrap_shutdown,
         what="log the summary",
         why="the worker's counts at exit",
         retire=HOP2_RETIRE),
)
