# SPDX-License-Identifier: Apache-2.0
"""Every ``VLLM_SHM_EMBEDS_*`` variable, parsed in one place with one rule.

The environment is read only here. :func:`settings` parses all variables
together with pydantic (vLLM depends on it) the first time it is called and
again only when one of them changed (tests set them; the API server sets
``VLLM_SHM_EMBEDS_STATS_DIR`` before it starts the engines), so a hot path
pays one tuple comparison. Flags follow pydantic's ``bool`` rule
(``1/true/yes/on/t/y`` on, ``0/false/no/off/f/n`` off, any case). A bad
value never raises: the default is used and :attr:`Settings.problems` says
so (the plugin logs it at start).

Variables (see ``docs/configuration.md``):

* ``VLLM_SHM_EMBEDS``: the feature, default off.
* ``VLLM_SHM_EMBEDS_MIN_BYTES``: tensors below this many bytes keep the
  stock path (default 1 MiB).
* ``VLLM_SHM_EMBEDS_DIR``: segment directory, a tmpfs (default ``/dev/shm``).
* ``VLLM_SHM_EMBEDS_STATS_DIR``: where every process of a server keeps its
  counters (``counters.py``); an API server makes a private one if unset.
* ``VLLM_SHM_EMBEDS_WRITERS``: threads (and files) writing one large tensor
  (default: usable CPUs, at most 4; 1..16).
* ``VLLM_SHM_EMBEDS_BINARY_MAX_BYTES``: cap on the tensor bytes of one binary
  body (default ``max_model_len * hidden_size * 4``).
* ``VLLM_SHM_EMBEDS_JSON``: the base64 JSON body path (default on).
* ``VLLM_SHM_EMBEDS_MAX_BYTES``: the most this server's segments may hold in
  the segment directory (bytes; default: half its file system; on the file
  system of ``/dev/shm``, never more than what was free at start less a
  64 MiB reserve for vLLM's own broadcast rings).
  A tensor that would go over takes the stock path (``budget``).
* ``VLLM_SHM_EMBEDS_MAX_SEGMENTS``: segments one process may own and map at
  once (default 4096); beyond, the stock path (``segments``).
* ``VLLM_SHM_EMBEDS_BODY_TIMEOUT_S``: a request body that sends no bytes for
  this many seconds gets 408 and its segment is freed (default 30).
* ``VLLM_SHM_EMBEDS_BODY_MIN_RATE``: bytes/s a body must average: one of
  ``n`` bytes gets 408 after ``BODY_TIMEOUT_S + n / BODY_MIN_RATE`` seconds
  in all (default 1 MiB/s).
* ``VLLM_SHM_EMBEDS_INFLIGHT_BYTES``: declared bytes of JSON bodies the
  API server's body paths take at once; more go to the stock path unchanged
  (default: the segment budget, at least 1 GiB).
* ``VLLM_SHM_EMBEDS_BINARY_MAX_TENSORS``: tensors one binary body may carry
  (default 256; more: 400).
* ``VLLM_SHM_EMBEDS_REGIONS``: path of the Unix socket on which same-host
  producers register sealed memfds (``region_server.py``); unset: off.
* ``VLLM_SHM_EMBEDS_REGIONS_GROUP``: a group name: the socket gets that
  group and mode 0660 (default: mode 0600).
* ``VLLM_SHM_EMBEDS_REGIONS_UIDS``: comma-separated uids that may register
  besides the server's own.
* ``VLLM_SHM_EMBEDS_REGIONS_MAX``: regions one uid may hold (default 64).
* ``VLLM_SHM_EMBEDS_REGIONS_MAX_BYTES``: bytes one uid's regions may hold
  (default 16 GiB).
* ``VLLM_SHM_EMBEDS_REGIONS_TTL_S``: a region no request used for this many
  seconds is unregistered (default 600).
* ``VLLM_SHM_EMBEDS_REGIONS_IDLE_S``: a producer connection that holds no
  region and sent nothing for this many seconds is closed (default 60).
* ``VLLM_SHM_EMBEDS_REGIONS_REFS_MAX``: region references one request may
  make (default 64); more get 400.
* ``VLLM_SHM_EMBEDS_REGIONS_LEASES_MAX``: region references of requests in
  flight one API server may hold (default 1024); more get 429.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Annotated, Any

import pydantic

DEFAULT_MIN_BYTES = 1 << 20
MAX_WRITERS = 16  # files a segment may be striped over (handles refuse more)

VARIABLES = (
    "VLLM_SHM_EMBEDS",
    "VLLM_SHM_EMBEDS_MIN_BYTES",
    "VLLM_SHM_EMBEDS_DIR",
    "VLLM_SHM_EMBEDS_STATS_DIR",
    "VLLM_SHM_EMBEDS_WRITERS",
    "VLLM_SHM_EMBEDS_BINARY_MAX_BYTES",
    "VLLM_SHM_EMBEDS_JSON",
    "VLLM_SHM_EMBEDS_MAX_BYTES",
    "VLLM_SHM_EMBEDS_MAX_SEGMENTS",
    "VLLM_SHM_EMBEDS_BODY_TIMEOUT_S",
    "VLLM_SHM_EMBEDS_BODY_MIN_RATE",
    "VLLM_SHM_EMBEDS_INFLIGHT_BYTES",
    "VLLM_SHM_EMBEDS_BINARY_MAX_TENSORS",
    "VLLM_SHM_EMBEDS_REGIONS",
    "VLLM_SHM_EMBEDS_REGIONS_GROUP",
    "VLLM_SHM_EMBEDS_REGIONS_UIDS",
    "VLLM_SHM_EMBEDS_REGIONS_MAX",
    "VLLM_SHM_EMBEDS_REGIONS_MAX_BYTES",
    "VLLM_SHM_EMBEDS_REGIONS_TTL_S",
    "VLLM_SHM_EMBEDS_REGIONS_IDLE_S",
    "VLLM_SHM_EMBEDS_REGIONS_REFS_MAX",
    "VLLM_SHM_EMBEDS_REGIONS_LEASES_MAX",
)

_FLAG = pydantic.TypeAdapter(bool)
_BYTES = pydantic.TypeAdapter(Annotated[int, pydantic.Field(ge=0, strict=False)])
_WRITERS = pydantic.TypeAdapter(Annotated[int, pydantic.Field(ge=1, le=MAX_WRITERS)])
_SECONDS = pydantic.TypeAdapter(Annotated[float, pydantic.Field(gt=0)])
_POSITIVE = pydantic.TypeAdapter(Annotated[int, pydantic.Field(ge=1, strict=False)])
_UIDS = pydantic.TypeAdapter(Annotated[
    tuple[Annotated[int, pydantic.Field(ge=0)], ...],
    pydantic.BeforeValidator(
        lambda v: [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v),
])
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_BODY_MIN_RATE = 1 << 20  # bytes/s
MIN_INFLIGHT_BYTES = 1 << 30  # the default in-flight cap is never below this
DEFAULT_BINARY_MAX_TENSORS = 256
DEFAULT_REGIONS_MAX = 64
DEFAULT_MAX_SEGMENTS = 4096  # x (1 + files) mappings, well under vm.max_map_count
DEFAULT_REGIONS_MAX_BYTES = 16 << 30
DEFAULT_REGIONS_TTL_S = 600.0
DEFAULT_REGIONS_IDLE_S = 60.0
DEFAULT_REGIONS_REFS_MAX = 64
DEFAULT_REGIONS_LEASES_MAX = 1024
RING_RESERVE_BYTES = 64 << 20  # left free for vLLM's own broadcast rings


@dataclasses.dataclass(frozen=True)
class Settings:
    """The parsed variables of this process.

    Attributes:
        enabled: ``VLLM_SHM_EMBEDS``.
        min_bytes: bytes; smallest tensor that takes the shm path.
        dir: segment directory (a tmpfs).
        stats_dir: counters directory, or None.
        writers: threads writing one striped segment.
        binary_max_bytes: bytes; cap on one binary body's tensors, or None
            for the model's default.
        json: the base64 JSON body path.
        max_bytes: bytes; an explicit budget for this server's segments, or
            None for the default (:func:`budget_bytes`).
        body_timeout_s: seconds a request body may send nothing.
        body_min_rate: bytes/s a request body must average (overall deadline).
        inflight_bytes: bytes; cap on the declared size of the JSON bodies
            the body paths take at once, or None for the default
            (:func:`inflight_bytes`).
        binary_max_tensors: tensors one binary body may carry.
        max_segments: segments one process may own (and map) at once; beyond,
            the stock path (the EngineCore adopts by copying into its memory).
        regions: path of the regions socket, or None (regions off).
        regions_group: group of the regions socket (mode 0660), or None (0600).
        regions_uids: uids that may register regions besides this process's.
        regions_max: regions one uid may hold.
        regions_max_bytes: bytes one uid's regions may hold.
        regions_ttl_s: seconds a region may go unused before it is unregistered.
        regions_idle_s: seconds a producer connection holding no region may
            send nothing before it is closed.
        regions_refs_max: region references one request may make.
        regions_leases_max: region references of requests in flight one API
            server may hold.
        problems: one message per bad value that a default replaced, and
            ``fatal`` messages that keep the feature off.
        fatal: messages that keep the feature off (no usable segment dir).
    """

    enabled: bool = False
    min_bytes: int = DEFAULT_MIN_BYTES
    dir: str = "/dev/shm"
    stats_dir: str | None = None
    writers: int = 1
    binary_max_bytes: int | None = None
    json: bool = True
    max_bytes: int | None = None
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    body_min_rate: int = DEFAULT_BODY_MIN_RATE
    inflight_bytes: int | None = None
    binary_max_tensors: int = DEFAULT_BINARY_MAX_TENSORS
    max_segments: int = DEFAULT_MAX_SEGMENTS
    regions: str | None = None
    regions_group: str | None = None
    regions_uids: tuple[int, ...] = ()
    regions_max: int = DEFAULT_REGIONS_MAX
    regions_max_bytes: int = DEFAULT_REGIONS_MAX_BYTES
    regions_ttl_s: float = DEFAULT_REGIONS_TTL_S
    regions_idle_s: float = DEFAULT_REGIONS_IDLE_S
    regions_refs_max: int = DEFAULT_REGIONS_REFS_MAX
    regions_leases_max: int = DEFAULT_REGIONS_LEASES_MAX
    problems: tuple[str, ...] = ()
    fatal: tuple[str, ...] = ()


def _default_writers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def _parse(raw: dict[str, str | None]) -> Settings:
    problems: list[str] = []

    def get(name: str, adapter: pydantic.TypeAdapter, default: Any, what: str) -> Any:
        value = (raw[name] or "").strip()
        if not value:
            return default
        try:
            return adapter.validate_python(value)
        except pydantic.ValidationError:
            problems.append(f"{name}={value[:64]!r} is not {what}; using {default}")
            return default

    writers = _default_writers()
    directory = raw["VLLM_SHM_EMBEDS_DIR"] or "/dev/shm"
    max_body = get("VLLM_SHM_EMBEDS_BINARY_MAX_BYTES", _BYTES, None, "a byte count")
    s = Settings(
        enabled=get("VLLM_SHM_EMBEDS", _FLAG, False, "a flag (1/0)"),
        min_bytes=get("VLLM_SHM_EMBEDS_MIN_BYTES", _BYTES, DEFAULT_MIN_BYTES,
                      "a byte count"),
        dir=directory,
        stats_dir=raw["VLLM_SHM_EMBEDS_STATS_DIR"] or None,
        writers=get("VLLM_SHM_EMBEDS_WRITERS", _WRITERS, writers,
                    f"a count in 1..{MAX_WRITERS}"),
        binary_max_bytes=max_body or None,
        json=get("VLLM_SHM_EMBEDS_JSON", _FLAG, True, "a flag (1/0)"),
        max_bytes=get("VLLM_SHM_EMBEDS_MAX_BYTES", _BYTES, None, "a byte count"),
        body_timeout_s=get("VLLM_SHM_EMBEDS_BODY_TIMEOUT_S", _SECONDS,
                           DEFAULT_BODY_TIMEOUT_S, "a number of seconds"),
        body_min_rate=get("VLLM_SHM_EMBEDS_BODY_MIN_RATE", _POSITIVE,
                          DEFAULT_BODY_MIN_RATE, "a positive byte rate"),
        inflight_bytes=get("VLLM_SHM_EMBEDS_INFLIGHT_BYTES", _BYTES, None, "a byte count"),
        binary_max_tensors=get("VLLM_SHM_EMBEDS_BINARY_MAX_TENSORS", _POSITIVE,
                               DEFAULT_BINARY_MAX_TENSORS, "a positive count"),
        max_segments=get("VLLM_SHM_EMBEDS_MAX_SEGMENTS", _POSITIVE, DEFAULT_MAX_SEGMENTS,
                         "a positive count"),
        regions=(raw["VLLM_SHM_EMBEDS_REGIONS"] or "").strip() or None,
        regions_group=(raw["VLLM_SHM_EMBEDS_REGIONS_GROUP"] or "").strip() or None,
        regions_uids=get("VLLM_SHM_EMBEDS_REGIONS_UIDS", _UIDS, (),
                         "a comma-separated list of uids"),
        regions_max=get("VLLM_SHM_EMBEDS_REGIONS_MAX", _POSITIVE, DEFAULT_REGIONS_MAX,
                        "a positive count"),
        regions_max_bytes=get("VLLM_SHM_EMBEDS_REGIONS_MAX_BYTES", _POSITIVE,
                              DEFAULT_REGIONS_MAX_BYTES, "a positive byte count"),
        regions_ttl_s=get("VLLM_SHM_EMBEDS_REGIONS_TTL_S", _SECONDS, DEFAULT_REGIONS_TTL_S,
                          "a number of seconds"),
        regions_idle_s=get("VLLM_SHM_EMBEDS_REGIONS_IDLE_S", _SECONDS, DEFAULT_REGIONS_IDLE_S,
                           "a number of seconds"),
        regions_refs_max=get("VLLM_SHM_EMBEDS_REGIONS_REFS_MAX", _POSITIVE,
                             DEFAULT_REGIONS_REFS_MAX, "a positive count"),
        regions_leases_max=get("VLLM_SHM_EMBEDS_REGIONS_LEASES_MAX", _POSITIVE,
                               DEFAULT_REGIONS_LEASES_MAX, "a positive count"),
    )
    fatal = ()
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        fatal = (f"segment directory {directory} is missing or not writable",)
    return dataclasses.replace(s, problems=tuple(problems), fatal=fatal)


_cache: tuple[tuple[str | None, ...], Settings] | None = None


def settings() -> Settings:
    """This process's settings; parsed again only when a variable changed."""
    global _cache
    key = tuple(os.environ.get(name) for name in VARIABLES)
    cached = _cache
    if cached is None or cached[0] != key:
        cached = (key, _parse(dict(zip(VARIABLES, key))))
        _cache = cached
    return cached[1]


def enabled() -> bool:
    """``VLLM_SHM_EMBEDS`` is on."""
    return settings().enabled


def min_bytes() -> int:
    """Smallest tensor (bytes) that takes the shm path."""
    return settings().min_bytes


def shm_dir() -> str:
    """The segment directory."""
    return settings().dir


def writers() -> int:
    """Threads (and files) that write one tensor into a segment (1..16).

    Default: the CPUs this process may run on, at most 4 (on 2 cores, 2
    writers beat one ``memcpy``; 1 writer does not: docs/figures.md, hop 1).
    """
    return settings().writers


def stats_dir() -> str | None:
    """The counters directory of this server, or None."""
    return settings().stats_dir


def set_stats_dir(path: str) -> None:
    """Export ``path`` as ``VLLM_SHM_EMBEDS_STATS_DIR`` (children inherit it)."""
    os.environ["VLLM_SHM_EMBEDS_STATS_DIR"] = path


def binary_max_bytes(max_model_len: int, hidden_size: int) -> int:
    """Cap (bytes) on one binary body's tensors: the variable, or
    ``max_model_len * hidden_size * 4``."""
    return settings().binary_max_bytes or max_model_len * hidden_size * 4


_budget: dict[str, int] = {}  # segment directory -> default budget, set once


def budget_bytes() -> int:
    """The most this server's segments may hold (bytes): ``VLLM_SHM_EMBEDS_MAX_BYTES``,
    else half the segment directory's file system; when that is the file
    system of ``/dev/shm`` (where vLLM keeps its broadcast rings), at most what
    was free the first time this was asked less :data:`RING_RESERVE_BYTES`."""
    s = settings()
    if s.max_bytes is not None:
        return s.max_bytes
    if s.dir not in _budget:
        try:
            st = os.statvfs(s.dir)
            size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        except OSError:
            size = free = 0
        shared = shares_dev_shm()
        budget = size // 2
        if shared:
            budget = min(budget, free - RING_RESERVE_BYTES)
        _budget[s.dir] = max(0, budget)
    return _budget[s.dir]


_shares: dict[str, bool] = {}  # segment directory -> on /dev/shm's file system


def shares_dev_shm() -> bool:
    """True if the segment directory is on the file system of ``/dev/shm`` (or
    that cannot be told): others' files share it; asked once per directory."""
    d = settings().dir
    if d not in _shares:
        try:
            _shares[d] = os.stat(d).st_dev == os.stat("/dev/shm").st_dev
        except OSError:
            _shares[d] = True
    return _shares[d]


def body_timeout_s() -> float:
    """Seconds a request body may send nothing before it gets 408."""
    return settings().body_timeout_s


def body_deadline_s(nbytes: int) -> float:
    """Seconds a body of ``nbytes`` may take in all before it gets 408:
    ``VLLM_SHM_EMBEDS_BODY_TIMEOUT_S + nbytes / VLLM_SHM_EMBEDS_BODY_MIN_RATE``."""
    s = settings()
    return s.body_timeout_s + max(0, nbytes) / s.body_min_rate


def inflight_bytes() -> int:
    """Cap (bytes) on the declared size of the JSON bodies the API server's body
    paths take at once: the variable, else :func:`budget_bytes` (at least
    :data:`MIN_INFLIGHT_BYTES`)."""
    s = settings()
    if s.inflight_bytes is not None:
        return s.inflight_bytes
    return max(MIN_INFLIGHT_BYTES, budget_bytes())


def binary_max_tensors() -> int:
    """Tensors one binary body may carry."""
    return settings().binary_max_tensors


def regions_path() -> str | None:
    """Path of the regions socket, or None: regions are off."""
    return settings().regions


def regions_group() -> str | None:
    """Group of the regions socket (mode 0660), or None (mode 0600)."""
    return settings().regions_group


def regions_allowed_uids() -> frozenset[int]:
    """Uids that may register regions: this process's and
    ``VLLM_SHM_EMBEDS_REGIONS_UIDS``."""
    return frozenset((os.getuid(), *settings().regions_uids))


def regions_max() -> int:
    """Regions one uid may hold."""
    return settings().regions_max


def regions_max_bytes() -> int:
    """Bytes one uid's regions may hold."""
    return settings().regions_max_bytes


def regions_ttl_s() -> float:
    """Seconds a region no request used may stay registered."""
    return settings().regions_ttl_s


def regions_idle_s() -> float:
    """Seconds a producer connection holding no region may send nothing."""
    return settings().regions_idle_s


def regions_refs_max() -> int:
    """Region references one request may make."""
    return settings().regions_refs_max


def regions_leases_max() -> int:
    """Region references of requests in flight one API server may hold."""
    return settings().regions_leases_max


def max_segments() -> int:
    """Segments one process may own and map at once (``VLLM_SHM_EMBEDS_MAX_SEGMENTS``)."""
    return settings().max_segments


# What vLLM's ``vllm/envs.py`` ``environment_variables`` table gets (name ->
# getter), so that ``Platform.validate_environ`` knows our variables.
ENV_VARS: dict[str, Callable[[], Any]] = {
    "VLLM_SHM_EMBEDS": enabled,
    "VLLM_SHM_EMBEDS_MIN_BYTES": min_bytes,
    "VLLM_SHM_EMBEDS_DIR": shm_dir,
    "VLLM_SHM_EMBEDS_STATS_DIR": stats_dir,
    "VLLM_SHM_EMBEDS_WRITERS": writers,
    "VLLM_SHM_EMBEDS_BINARY_MAX_BYTES": lambda: settings().binary_max_bytes,
    "VLLM_SHM_EMBEDS_JSON": lambda: settings().json,
    "VLLM_SHM_EMBEDS_MAX_BYTES": budget_bytes,
    "VLLM_SHM_EMBEDS_MAX_SEGMENTS": max_segments,
    "VLLM_SHM_EMBEDS_BODY_TIMEOUT_S": body_timeout_s,
    "VLLM_SHM_EMBEDS_BODY_MIN_RATE": lambda: settings().body_min_rate,
    "VLLM_SHM_EMBEDS_INFLIGHT_BYTES": inflight_bytes,
    "VLLM_SHM_EMBEDS_BINARY_MAX_TENSORS": binary_max_tensors,
    "VLLM_SHM_EMBEDS_REGIONS": regions_path,
    "VLLM_SHM_EMBEDS_REGIONS_GROUP": regions_group,
    "VLLM_SHM_EMBEDS_REGIONS_UIDS": lambda: settings().regions_uids,
    "VLLM_SHM_EMBEDS_REGIONS_MAX": regions_max,
    "VLLM_SHM_EMBEDS_REGIONS_MAX_BYTES": regions_max_bytes,
    "VLLM_SHM_EMBEDS_REGIONS_TTL_S": regions_ttl_s,
    "VLLM_SHM_EMBEDS_REGIONS_IDLE_S": regions_idle_s,
    "VLLM_SHM_EMBEDS_REGIONS_REFS_MAX": regions_refs_max,
    "VLLM_SHM_EMBEDS_REGIONS_LEASES_MAX": regions_leases_max,
}
