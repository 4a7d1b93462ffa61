# SPDX-License-Identifier: Apache-2.0
"""shm-embeds metrics on the OpenAI server's Prometheus ``/metrics``.

Every process of the server counts into its own ``prometheus_client`` multiprocess
file in one directory (``counters.py``; :func:`ensure_stats_dir` makes and exports
it). At scrape time the files are merged (:func:`read_server`) and
:func:`aggregate` derives the public families, so whichever API server answers, it
reports the whole server. :class:`MetricsMiddleware` appends them to the response
of vLLM's own ``/metrics`` route (``ext/binary/site_entrypoints.py``). Names follow vLLM's
(``vllm:`` prefix, ``model_name`` label, ``vllm/v1/metrics/loggers.py``).

Knows HTTP (ASGI) and nothing of vLLM's classes.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import asyncio
import atexit
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm.logger import init_logger

from vllm._shm_embeds import config, counters
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.files import segment_dir
from vllm._shm_embeds.lifetime import process
from vllm._shm_embeds.lifetime.process import NO_SPACE_MARKER
from vllm._shm_embeds.procfs import pid_namespace, proc_start_time
from vllm._shm_embeds.pools import LazyPool

logger = init_logger(__name__)

STATS_DIR_PREFIX = "vllm-shm-embeds-metrics."
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
                       "a copy (hop 1: binary and JSON bodies written into shared memory, "
                       "and registered regions; hop 2: segments adopted at hop 1)",
                       ("hop",)),
    "reader_tensors": ("counter", "prompt_embeds tensors per reader of the hop-2 broadcast, "
                       "by what the reader got (local_handle: a handle it maps; "
                       "local_placeholder, remote_placeholder: a later pipeline stage, "
                       "nothing to map, no tensor bytes; remote_bytes: a reader on another "
                       "node with a first-stage reader among them, the tensor's bytes)",
                       ("hop", "kind")),
    "remote_bytes": ("counter", "prompt_embeds bytes sent to readers on other nodes (tensor "
                     "bytes x remote readers that got them)", ("hop",)),
    "placeholder_tensors": ("counter", "prompt_embeds tensors that workers of later pipeline "
                            "stages replaced by a placeholder, mapping nothing (workers "
                            "on this node; with TP across nodes a later stage there may "
                            "have received the bytes, and dropped them)", ("hop",)),
    "fallbacks": ("counter", "prompt_embeds tensors that took the stock path, by hop "
                  "and reason", ("hop", "reason")),
    "copied_bytes": ("counter", "Bytes copied into shared-memory segments", ()),
    "segments_created": ("counter", "Shared-memory segments created", ()),
    "segments_unlinked": ("counter", "Shared-memory segments unlinked by their owner", ()),
    "segments_swept": ("counter", "Segments of dead processes removed", ()),
    "adopt_names_taken": ("counter", "Segment names the EngineCore found taken by something "
                          "it did not make when adopting (another name was drawn)", ()),
    "binary_bodies": ("counter", "Binary prompt_embeds request bodies accepted", ()),
    "binary_bytes": ("counter", "Tensor bytes of accepted binary request bodies", ()),
    "binary_rejected": ("counter", "Binary request bodies rejected, by reason",
                        ("reason",)),
    "binary_fallbacks": ("counter", "Tensors of binary request bodies received into "
                         "private memory and sent the stock way, by reason (budget, "
                         "no_space, os_error)", ("reason",)),
    "json_tensors": ("counter", "prompt_embeds tensors of base64 JSON bodies that the JSON "
                     "path decoded, by how (direct: straight into shared memory; loader: "
                     "vLLM's loader, then one copy)", ("how",)),
    "json_fallbacks": ("counter", "Large JSON bodies left to vLLM's own decode, by reason "
                       "(no_embeds: none where vLLM reads prompt_embeds)", ("reason",)),
    "json_direct_declined": ("counter", "prompt_embeds payloads of JSON bodies not decoded "
                             "straight into shared memory but left to vLLM's loader, by "
                             "reason (dtype: another dtype to cast; pickle, zip: not exactly "
                             "torch.save's)", ("reason",)),
    "regions_registered": ("counter", "Regions registered on the regions socket "
                           "(VLLM_SHM_EMBEDS_REGIONS)", ()),
    "region_bytes": ("counter", "Bytes of the regions registered", ()),
    "region_leases": ("counter", "Uses of registered regions by requests", ()),
    "region_lookups": ("counter", "Regions an API server looked up at the sibling API "
                       "server that serves the regions socket", ()),
    "region_lookup_trimmed": ("counter", "Lookup answers sent without the region's digests "
                              "(too large for one message; the EngineCore hashes those)", ()),
    "regions_freed": ("counter", "Regions whose memory this server let go of (unregistered "
                      "and no request using them)", ()),
    "region_unregistered": ("counter", "Regions unregistered, by reason (op, disconnect, "
                            "idle, close)", ("reason",)),
    "region_refused": ("counter", "Registrations and region references refused, by reason",
                       ("reason",)),
    "region_lease_refused": ("counter", "Region references in requests that did not match "
                             "a registered region, by reason", ("reason",)),
    "dir_held_bytes": ("gauge", "Bytes of this server's segments in the segment "
                       "directory now (allocated, at scrape time)", ()),
    "dir_free_bytes": ("gauge", "Free bytes of the segment directory's file system "
                       "(at scrape time)", ()),
    "dir_size_bytes": ("gauge", "Size in bytes of the segment directory's file system",
                       ()),
}
PREFIX = "vllm:shm_embeds_"


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
    current = config.stats_dir()
    if current:
        os.makedirs(current, exist_ok=True)
        # A marker of an earlier run would silence this run's no-space warning.
        seg.unlink_quietly(os.path.join(current, NO_SPACE_MARKER))
        return current
    sweep_stale_stats_dirs()
    path = tempfile.mkdtemp(prefix=f"{STATS_DIR_PREFIX}{os.getpid()}.")
    os.environ["VLLM_SHM_EMBEDS_STATS_DIR"] = path  # the processes it starts inherit it
    state = process.current()
    state.stats_dir_made = path
    atexit.register(_remove_stats_dir, state)
    return path


def _remove_stats_dir(state: process.Process) -> None:
    """At exit: remove the directory ``state``'s process made (not in a forked child)."""
    if state.stats_dir_made is not None and state.pid == os.getpid():
        shutil.rmtree(state.stats_dir_made, ignore_errors=True)


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
        try:
            gone = m is not None and proc_start_time(int(m.group(1))) is None
        except ValueError:  # cannot tell: keep it
            gone = False
        if gone:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            removed += 1
    return removed


def set_model_name(name: Any) -> None:
    """Record the served model name for the ``model_name`` label."""
    process.current().model_name = str(name or "")


# --------------------------------------------------------------------------
# aggregation: the public families from every process's events

E = counters.Event  # the core's events named below (a typo: AttributeError)
_HOP_EVENTS = {E(f"hop{h}_{p}_{w}"): (h, p, w) for h in "12" for p in ("shm", "stock")
               for w in ("tensors", "bytes")}
_RECEIVER = {"1": "engine", "2": "worker"}  # role of a hop's receiving process
# The json extension's tensors, by ``how`` (no event carries it): json_tensors counts
# every one, json_direct_tensors those decoded directly (moved from loader to direct).
_HOW = {"json_tensors": "loader", "json_direct_tensors": "direct"}
_COUNTED_IN = {"json_direct_tensors": "json_tensors"}


def _labels(event: counters.EventKind, key: counters.Key | None) -> tuple[str, ...] | None:
    """The label values of ``event``'s family for a count of ``key``; None: they
    depend on the count (hop, reason) and ``key`` is None."""
    if event.labels:
        return None if key is None else tuple(
            key.hop if name == "hop" else key.reason for name in event.labels)
    wanted = METRICS[event.metric][2]
    if wanted == ("hop",):  # hopN_*: hop N
        return (event.value[3],)
    if wanted == ("how",):
        return (_HOW[event.value],)
    return ()


def families() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """The families of :data:`METRICS` on ``/metrics`` now: the gauges, and the
    counters some loaded event feeds (a deleted extension's are absent)."""
    fed = {e.metric for e in counters.events() if e.metric} | {"received_tensors"}
    return {k: v for k, v in METRICS.items() if v[0] == "gauge" or k in fed}


def read_server(stats_dir: str) -> dict[tuple[counters.Key, str], float]:
    """All processes' counts in ``stats_dir`` per ``(key, role)`` (``MultiProcessCollector``)."""
    from prometheus_client.multiprocess import MultiProcessCollector

    files = list(counters.stats_files(stats_dir).values()) if stats_dir else []
    out: dict[tuple[counters.Key, str], float] = {}
    if not files:
        return out
    for metric in MultiProcessCollector.merge(files, accumulate=True):
        if metric.name != counters.FAMILY:
            continue
        for sample in metric.samples:
            slot = counters.parse_labels(dict(sample.labels))
            out[slot] = out.get(slot, 0) + sample.value
    return out


def aggregate(values: dict[tuple[counters.Key, str], float], pids: set[int],
              seg_dir: str | None = None) -> dict[str, dict[tuple[str, ...], float]]:
    """Metric values from the server's events (:func:`read_server`).

    Returns ``{metric: {label values: value}}`` for every name of
    :func:`families` (label values in the order of its label names): each
    declared event (``counters.events()``) feeds the family it names. Hop
    tensors/bytes come from the sender only: hop 1 from processes that are
    not an EngineCore, hop 2 from processes that are not a TP worker. The
    gauges are read from ``seg_dir`` (default: the segment directory) now;
    ``dir_held_bytes`` counts the allocated bytes of segment files whose
    owner is one of ``pids`` (the server's processes).
    """
    declared = {e.value: e for e in counters.events()}
    out: dict[str, dict[tuple[str, ...], float]] = {k: {} for k in families()}
    for hop in ("1", "2"):
        for path in ("shm", "stock"):
            out["tensors"][(hop, path)] = 0
            out["bytes"][(hop, path)] = 0
        out["received_tensors"][(hop,)] = 0
    for event in declared.values():  # zero where the labels are fixed
        if event.metric and event not in _HOP_EVENTS and not event.labels:
            out[event.metric][_labels(event, None)] = 0

    def add(metric: str, labels: tuple[str, ...], value: float) -> None:
        out[metric][labels] = out[metric].get(labels, 0) + value

    for (key, role), value in values.items():
        event = declared.get(key.event)
        if event is None or not event.metric:  # summary only, or no longer declared
            continue
        if event in _HOP_EVENTS:
            hop, path, what = _HOP_EVENTS[event]
            if _RECEIVER[hop] not in role.split("+"):
                add(what, (hop, path), value)
            elif what == "tensors" and path == "shm":
                add("received_tensors", (hop,), value)
            continue
        add(event.metric, _labels(event, key), value)
        if event.value in _COUNTED_IN:  # counted in the other one too
            other = declared[_COUNTED_IN[event.value]]
            add(other.metric, _labels(other, key), -value)
    seg_dir = seg_dir or config.shm_dir()
    out["dir_held_bytes"][()] = segment_dir.held_bytes(seg_dir, pids, pid_namespace())
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

        model_name = process.current().model_name
        for name, (kind, doc, labels) in families().items():
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(PREFIX + name, doc, labels=["model_name", *labels])
            for label_values, value in sorted((values or {}).get(name, {}).items()):
                family.add_metric([model_name, *label_values], value)
            yield family

    def describe(self) -> Iterator[Any]:
        return self._families(None)

    def collect(self) -> Iterator[Any]:
        try:
            values = read_server(self.stats_dir)
            pids = set(counters.stats_files(self.stats_dir))
        except (OSError, ValueError) as e:  # a removed dir, a file being created
            logger.debug("shm-embeds: counters unreadable at scrape: %s", e)
            values, pids = {}, set()
        return self._families(aggregate(values, pids))


def exposition() -> bytes:
    """This server's shm-embeds metrics in Prometheus text format 0.0.4, now."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(ShmEmbedsCollector(config.stats_dir() or ""))
    return generate_latest(registry)


CACHE_S = 0.2  # scrapes within this many seconds of a computation share it
_SCRAPES = LazyPool(1, "shm-embeds-metrics")
_cached: tuple[float, bytes] | None = None  # (monotonic time computed, exposition)


def _cached_exposition() -> bytes:
    """:func:`exposition`, computed at most once per :data:`CACHE_S` (runs on
    the one scrape thread, so concurrent scrapes queue there and share it)."""
    global _cached
    now = time.monotonic()
    if _cached is None or now - _cached[0] > CACHE_S:
        _cached = (now, exposition())
    return _cached[1]


async def scrape() -> bytes:
    """The exposition for one scrape, computed on a thread of its own: never on
    the event loop, never on the executor that request paths share (a scrape
    reads the counter files and the segment directory)."""
    return await asyncio.get_running_loop().run_in_executor(_SCRAPES.get(), _cached_exposition)


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
            try:  # off the event loop and off the request paths' executor
                out += await scrape()
            except Exception:  # never fail vLLM's own metrics
                logger.exception("shm-embeds: metrics not appended to /metrics")
        resp_headers = [(k, v) for k, v in resp_headers if k.lower() != b"content-length"]
        resp_headers.append((b"content-length", str(len(out)).encode()))
        await send(dict(start, headers=resp_headers))
        await send({"type": "http.response.body", "body": out, "more_body": False})
