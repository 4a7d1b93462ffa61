# SPDX-License-Identifier: Apache-2.0
"""Every ``VLLM_SHM_EMBEDS*`` setting and fixed limit, declared once and parsed with one rule.

:data:`SETTINGS` declares each variable (name, kind, default, unit, meaning);
:data:`LIMITS` the fixed limits, changed only by tests and benchmarks through
:data:`TEST_LIMITS`. From them come :func:`settings`, the :class:`Settings` attributes,
the getters, vLLM's ``envs`` table (:data:`ENV_VARS`) and ``docs/configuration.md``'s
table (``python -m vllm._shm_embeds.config --markdown``). The environment is read only
here; a bad value never raises: the default is used, :attr:`Settings.problems` says so.

Base layer: may import the other base modules and vLLM's logger; no HTTP.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any

import pydantic

from vllm._shm_embeds import private_dir

MAX_WRITERS = 16  # files a segment may be striped over (handles refuse more)
DEFAULT_MIN_BYTES = 1 << 20
MIN_INFLIGHT_BYTES = 1 << 30  # the default in-flight cap is never below this
RING_RESERVE_BYTES = 64 << 20  # left free for vLLM's own broadcast rings


@dataclasses.dataclass(frozen=True)
class Kind:
    """How a variable's text becomes a value: ``adapter``, the pydantic validator (None:
    the text is the value); ``what`` a bad value "is not", in the problem message;
    ``strip``: drop surrounding spaces first (the directories' paths are taken as given)."""

    adapter: pydantic.TypeAdapter | None = None
    what: str = ""
    strip: bool = True


_COUNT = pydantic.TypeAdapter(Annotated[int, pydantic.Field(ge=1, strict=False)])
_BYTES = pydantic.TypeAdapter(Annotated[int, pydantic.Field(ge=0, strict=False)])
FLAG = Kind(pydantic.TypeAdapter(bool), "a flag (1/0)")
BYTES = Kind(_BYTES, "a byte count")
BYTES_OR_MODEL = Kind(pydantic.TypeAdapter(Annotated[  # 0: the model's default (None)
    int, pydantic.Field(ge=0, strict=False), pydantic.AfterValidator(lambda v: v or None)]),
    "a byte count")
WRITER_COUNT = Kind(pydantic.TypeAdapter(Annotated[int, pydantic.Field(ge=1, le=MAX_WRITERS)]),
               f"a count in 1..{MAX_WRITERS}")
SECONDS = Kind(pydantic.TypeAdapter(Annotated[float, pydantic.Field(gt=0)]),
               "a number of seconds")
COUNT = Kind(_COUNT, "a positive count")
POSITIVE_BYTES = Kind(_COUNT, "a positive byte count")
RATE = Kind(_COUNT, "a positive byte rate")
UIDS = Kind(pydantic.TypeAdapter(Annotated[
    tuple[Annotated[int, pydantic.Field(ge=0)], ...],
    pydantic.BeforeValidator(
        lambda v: [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v),
]), "a comma-separated list of uids")
NAME = Kind()  # text, stripped; unset or blank: the default
PATH = Kind(strip=False)  # text as given


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting (a variable) or one fixed limit (:data:`LIMITS`).

    Attributes:
        name: the environment variable; a limit's name in :data:`TEST_LIMITS`.
        kind: how its text is parsed (:class:`Kind`).
        default: the value when unset, blank or bad; a callable is asked at each
            parse; None where derived elsewhere (:func:`budget_bytes`,
            :func:`inflight_bytes`, :func:`binary_max_bytes`).
        unit: what the value counts (bytes, seconds, ...).
        doc: what it does: the "meaning" cell of ``docs/configuration.md``.
        shown: the default as the doc says it, where the value alone does not.
        field: the :class:`Settings` attribute; default: the name after
            ``VLLM_SHM_EMBEDS_``, lower case.
    """

    name: str
    kind: Kind
    default: Any
    unit: str
    doc: str
    shown: str = ""
    field: str = ""

    def __post_init__(self) -> None:
        if not self.field:
            object.__setattr__(self, "field",
                               self.name.removeprefix("VLLM_SHM_EMBEDS_").lower())

    def parse(self, raw: str | None, problems: list[str], label: str = "") -> Any:
        """The value of ``raw``; a bad one gives the default and a message in
        ``problems`` (naming ``label``, else the variable)."""
        default = self.default() if callable(self.default) else self.default
        value = (raw or "").strip() if self.kind.strip else (raw or "")
        if not value:
            return default
        if self.kind.adapter is None:
            return value
        try:
            return self.kind.adapter.validate_python(value)
        except pydantic.ValidationError:
            problems.append(f"{label or self.name}={value[:64]!r} is not {self.kind.what}; "
                            f"using {default}")
            return default

    def default_text(self) -> str:
        """The default as ``docs/configuration.md`` shows it."""
        d = self.default
        if self.shown:
            return self.shown
        if isinstance(d, bool):
            return "on" if d else "off"
        if d is None or d == ():
            return "unset"
        text = f"`{d:g}`" if isinstance(d, float) else f"`{d}`"
        for unit, shift in (("GiB", 30), ("MiB", 20)):
            if self.unit.startswith("bytes") and d >= 1 << shift and d % (1 << shift) == 0:
                return f"{text} ({d >> shift} {unit}{self.unit[5:]})"
        return text


def _default_writers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


SETTINGS: tuple[Setting, ...] = (
    Setting("VLLM_SHM_EMBEDS", FLAG, False, "flag",
        "on enables the plugin; off: nothing is patched and no counter moves in any process.",
        field="enabled"),
    Setting("VLLM_SHM_EMBEDS_MIN_BYTES", BYTES, DEFAULT_MIN_BYTES, "bytes",
        "tensors smaller than this take the stock path (counted as `fallback.hop1.small`), and "
        "JSON bodies smaller than this go to vLLM's own decode; a binary body's tensor goes by "
        "shared memory whatever its size."),
    Setting("VLLM_SHM_EMBEDS_DIR", PATH, "/dev/shm", "path",
        "the tmpfs where segments live. When other users may write there (`/dev/shm`), the server"
        " keeps its segments in a directory of its own inside, mode 0700, removed at exit "
        "([security.md](security.md#the-private-segment-directory)). If it is missing, not "
        "writable, or lets other users rename entries (writable by them and not sticky), the "
        "plugin stays off and says why."),
    Setting("VLLM_SHM_EMBEDS_STATS_DIR", PATH, None, "path",
        "the per-server directory in which every process keeps its counters "
        "([metrics.md](metrics.md#how-the-values-are-collected)). Unset: the OpenAI server uses a"
        " private directory and removes it at exit. If you set it, use a fresh directory per run:"
        " files left in it are counted."),
    Setting("VLLM_SHM_EMBEDS_JSON", FLAG, True, "flag",
        "off leaves JSON bodies to vLLM's own decode (the [JSON path](json-path.md) off; the "
        "EngineCore computes the prefix-cache digests again)."),
    Setting("VLLM_SHM_EMBEDS_MAX_BYTES", BYTES, None, "bytes",
        "a cap on this server's shm-embeds segments (every process of the server; a body still arriving counts by what it has written, plus what this process's bodies"
        " will still write). A segment keeps its name until vLLM frees its request, so the named "
        "segments are what running requests hold, on `/dev/shm` as on a file system of its own. "
        "It is checked before each new segment; a tensor that would go over takes the stock path,"
        " counted with reason `budget`; nothing is refused for it. On a segment directory with a "
        "file system of its own (e.g. a tmpfs mounted for it) everything in use there counts too,"
        " which also covers the TP workers' mappings in the one step after a request is freed. A "
        "full `/dev/shm` means ENOSPC, which also takes the stock path.",
        shown="half the segment directory's file system; on `/dev/shm`'s file system at most "
              f"what was free at start less {RING_RESERVE_BYTES >> 20} MiB (vLLM's broadcast "
              "rings live there)"),
    Setting("VLLM_SHM_EMBEDS_REGIONS", NAME, None, "path",
        "path of a Unix socket (`SOCK_SEQPACKET`) on which same-host producers register sealed "
        "memfds holding `prompt_embeds`; requests then name them by region id. Start-up fails if "
        "the path exists and is not a socket; a stale socket is replaced.",
        shown="unset (off)"),
    Setting("VLLM_SHM_EMBEDS_REGIONS_GROUP", NAME, None, "group",
        "a group name: the socket file gets that group and mode 0660 (unset: mode 0600, the "
        "server's user only)."),
    Setting("VLLM_SHM_EMBEDS_REGIONS_UIDS", UIDS, (), "uids",
        "comma-separated uids that may register regions besides the server's own (checked with "
        "`SO_PEERCRED`), e.g. `1001,1002`."),
    Setting("VLLM_SHM_EMBEDS_STRICT", FLAG, False, "flag",
        "on: an illegal segment lifecycle transition (a bug of the plugin) raises "
        "`IllegalTransition` instead of being logged and refused; for tests (`tests/conftest.py` "
        "sets it), leave it off in production."),
)

# The fixed limits (settings until issue 38, "fewer knobs"), each a constant for the
# reason on its line; only tests and benchmarks change them, through TEST_LIMITS.
MAX_SEGMENTS = 4096  # far beyond what running requests hold; 4096 x 5 VMAs < vm.max_map_count
BODY_TIMEOUT_S = 30.0  # a body that sends no byte for 30 s is stalled on any network
BODY_MIN_RATE = 1 << 20  # 1 MiB/s on average after that grace: any working link is faster
BINARY_MAX_TENSORS = 256  # far more prompts than one request has; bounds the header's parse
REGIONS_MAX = 64  # per uid: producers register a few large tensors, more is a leak
REGIONS_MAX_BYTES = 16 << 30  # per uid: the producer's own memory; this only bounds a leak
REGIONS_TTL_S = 600.0  # 10 min unnamed: outlives any request; the producer can register again
REGIONS_IDLE_S = 60.0  # a connection holding no region has a minute to register one
REGIONS_REFS_MAX = 64  # per request, as many as a uid may register (2 fds, 2 maps each)
REGIONS_LEASES_MAX = 1024  # per API server, freed as responses start: only a flood meets it

# Changed only by TEST_LIMITS ("NAME=value,..."); callables and None are computed.
LIMITS: tuple[Setting, ...] = (
    Setting("WRITERS", WRITER_COUNT, _default_writers, "threads",  # the machine's CPUs decide
        f"1 to {MAX_WRITERS} threads that write one tensor of 8 MiB or more into its segment, "
        "each into a file of its own (tmpfs serializes writes to one file). Readers map the "
        "files back to back, so the tensor stays contiguous.",
        shown="usable CPUs, at most 4"),
    Setting("MAX_SEGMENTS", COUNT, MAX_SEGMENTS, "segments",
        "segments one process may own and map at once (each is a mapping of up to 1 + files VMAs,"
        " well under `vm.max_map_count`). Beyond it a sender (API server, hop 2 in the "
        "EngineCore) takes the stock path and the EngineCore reads an arriving segment into its "
        "own memory (what stock holds), both counted with reason `segments`."),
    Setting("BODY_TIMEOUT_S", SECONDS, BODY_TIMEOUT_S, "seconds",
        "a binary or large JSON request body that sends no bytes for this many seconds gets HTTP "
        "408, and what it held is freed at once."),
    Setting("BODY_MIN_RATE", RATE, BODY_MIN_RATE, "bytes/s",
        "bytes per second a binary or large JSON body must average: a body of `n` bytes that has "
        "not fully arrived after `BODY_TIMEOUT_S + n / BODY_MIN_RATE` seconds gets HTTP 408 (a "
        "client trickling a byte now and then cannot hold a request open forever)."),
    Setting("INFLIGHT_BYTES", BYTES, None, "bytes",  # the budget decides (VLLM_SHM_EMBEDS_MAX_BYTES)
        "bytes of the large JSON bodies the API server's JSON path holds at once, charged as "
        "they arrive (never by `Content-Length`); a body that reaches the cap goes to vLLM with "
        "every byte (the stock path, counted `json_fallback.busy`). JSON bodies larger than the "
        "base64 of `BINARY_MAX_BYTES` plus 1 MiB always take the stock path "
        "(`json_fallback.too_large`), and with `--enable-prompt-embeds` off no body takes our "
        "paths. A binary body's JSON header counts here too, as it arrives, until the body has "
        "arrived; one that finds or reaches the cap gets HTTP 503.",
        shown="the segment budget (`VLLM_SHM_EMBEDS_MAX_BYTES`), at least "
              f"{MIN_INFLIGHT_BYTES >> 30} GiB"),
    Setting("BINARY_MAX_BYTES", BYTES_OR_MODEL, None, "bytes",  # the model decides
        "largest tensor bytes one binary body may carry; above it the request gets a 413 before "
        "its tensor bytes are read. `0` means the default.",
        shown="`--max-model-len` x hidden size x 4"),
    Setting("BINARY_MAX_TENSORS", COUNT, BINARY_MAX_TENSORS, "tensors",
        "tensors (`prompt_embeds` descriptors) one binary body may carry; more get HTTP 400 "
        "(`binary_rejected.too_many`) before any is read."),
    Setting("REGIONS_MAX", COUNT, REGIONS_MAX, "regions",
        "regions one uid may hold at once (an unregistered region still used by a request counts "
        "until that request ends)."),
    Setting("REGIONS_MAX_BYTES", POSITIVE_BYTES, REGIONS_MAX_BYTES, "bytes",
        "bytes one uid's regions may hold at once (counted the same way)."),
    Setting("REGIONS_TTL_S", SECONDS, REGIONS_TTL_S, "seconds",
        "a region no request has used for this many seconds is unregistered (its producer's "
        "connection staying open does not keep it)."),
    Setting("REGIONS_IDLE_S", SECONDS, REGIONS_IDLE_S, "seconds",
        "a producer connection that holds no registered region and sent nothing for this many "
        "seconds is closed."),
    Setting("REGIONS_REFS_MAX", COUNT, REGIONS_REFS_MAX, "references",
        "region references one request may make; more get 400."),
    Setting("REGIONS_LEASES_MAX", COUNT, REGIONS_LEASES_MAX, "references",
        "region references of requests in flight one API server may hold until their "
        "response starts (a slow reader holds none); more get 429."),
)

# Internal, unsupported, may change: the test suite and benchmarks shrink (or
# grow) the LIMITS with it, e.g. "BODY_TIMEOUT_S=2,INFLIGHT_BYTES=1048576".
TEST_LIMITS = "VLLM_SHM_EMBEDS_TEST_LIMITS"
_LIMIT_BY_NAME = {limit.name: limit for limit in LIMITS}

VARIABLES = (*(s.name for s in SETTINGS), TEST_LIMITS)

Settings = dataclasses.make_dataclass(
    "Settings",
    [(s.field, Any) for s in SETTINGS + LIMITS]
    + [("problems", tuple[str, ...], dataclasses.field(default=())),
       ("fatal", tuple[str, ...], dataclasses.field(default=()))],
    frozen=True)
Settings.__module__ = __name__
Settings.__doc__ = """The parsed variables of this process.

One attribute per :data:`SETTINGS` and :data:`LIMITS` entry (its ``field``:
``enabled``, ``min_bytes``, ``dir``, ..., ``body_timeout_s``, ...), plus
``problems`` (one message per bad value that a default replaced, and the
``fatal`` messages) and ``fatal`` (messages that keep the feature off: no
usable segment directory).
"""


def _limits(raw: str | None, problems: list[str]) -> dict[str, Any]:
    """The :data:`LIMITS`' values: their constants, but for those that
    ``raw`` (:data:`TEST_LIMITS`: ``NAME=value,...``) names; a bad entry keeps
    the constant and puts a message in ``problems``."""
    given: dict[str, str] = {}
    for item in (raw or "").split(","):
        if not item.strip():
            continue
        name, eq, value = item.partition("=")
        name = name.strip().upper()
        if not eq or name not in _LIMIT_BY_NAME:
            problems.append(f"{TEST_LIMITS}: {item.strip()[:64]!r} is not NAME=value with "
                            "NAME one of config.LIMITS; ignored")
            continue
        given[name] = value
    return {limit.field: limit.parse(given.get(limit.name), problems,
                                     f"{TEST_LIMITS}: {limit.name}") for limit in LIMITS}


def _parse(raw: tuple[str | None, ...]) -> Settings:
    problems: list[str] = []
    values = {s.field: s.parse(value, problems) for s, value in zip(SETTINGS, raw)}
    values |= _limits(raw[len(SETTINGS)], problems)
    directory = values["dir"]
    fatal = ()
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        fatal = (f"segment directory {directory} is missing or not writable",)
    return Settings(**values, problems=tuple(problems), fatal=fatal)


class ProcessCache:
    """What this process worked out from its environment, until :meth:`reset`:
    ``parsed`` (the raw :data:`VARIABLES` and their :class:`Settings`, or None),
    ``budget`` (segment directory -> default budget in bytes, fixed when first asked)
    and ``shares`` (segment directory -> on ``/dev/shm``'s file system)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next question reads environment and file systems again."""
        self.parsed: tuple[tuple[str | None, ...], Settings] | None = None
        self.budget: dict[str, int] = {}
        self.shares: dict[str, bool] = {}


CACHE = ProcessCache()


def settings() -> Settings:
    """This process's settings; parsed again only when a variable changed."""
    key = tuple(os.environ.get(name) for name in VARIABLES)
    parsed = CACHE.parsed
    if parsed is None or parsed[0] != key:
        parsed = CACHE.parsed = (key, _parse(key))
    return parsed[1]


def _getter(field: str) -> Callable[[], Any]:
    """The getter of one :class:`Settings` attribute (documented by its
    :data:`SETTINGS` or :data:`LIMITS` entry)."""
    [setting] = [s for s in SETTINGS + LIMITS if s.field == field]

    def get() -> Any:
        return getattr(settings(), field)

    get.__name__ = get.__qualname__ = field
    what = "constant " if setting in LIMITS else ""
    get.__doc__ = f"``{setting.name}`` ({what}{setting.unit}): {setting.doc}"
    return get


# The getters the package imports, one per setting or limit that is used as it is.
enabled = _getter("enabled")
min_bytes = _getter("min_bytes")
mount_dir = _getter("dir")
stats_dir = _getter("stats_dir")
writers = _getter("writers")
max_segments = _getter("max_segments")
body_timeout_s = _getter("body_timeout_s")
binary_max_tensors = _getter("binary_max_tensors")
regions_path = _getter("regions")
regions_group = _getter("regions_group")
regions_max = _getter("regions_max")
regions_max_bytes = _getter("regions_max_bytes")
regions_ttl_s = _getter("regions_ttl_s")
regions_idle_s = _getter("regions_idle_s")
regions_refs_max = _getter("regions_refs_max")
regions_leases_max = _getter("regions_leases_max")
strict = _getter("strict")


def shm_dir() -> str:
    """The segment directory: ``VLLM_SHM_EMBEDS_DIR`` if only this uid can enter it, else
    this server's private directory in it (``private_dir.resolve``: made by the first
    process that asks). Raises OSError if none can be made there."""
    return private_dir.resolve(settings().dir)


def set_stats_dir(path: str) -> None:
    """Export ``path`` as ``VLLM_SHM_EMBEDS_STATS_DIR`` (children inherit it)."""
    os.environ["VLLM_SHM_EMBEDS_STATS_DIR"] = path


def binary_max_bytes(max_model_len: int, hidden_size: int) -> int:
    """Cap (bytes) on one binary body's tensors: ``max_model_len * hidden_size * 4``
    (the ``BINARY_MAX_BYTES`` limit, unless :data:`TEST_LIMITS` sets it)."""
    return settings().binary_max_bytes or max_model_len * hidden_size * 4


def budget_bytes() -> int:
    """The most this server's segments may hold (bytes): ``VLLM_SHM_EMBEDS_MAX_BYTES``,
    else half the segment directory's file system; when that is the file
    system of ``/dev/shm`` (where vLLM keeps its broadcast rings), at most what
    was free the first time this was asked less :data:`RING_RESERVE_BYTES`."""
    s = settings()
    if s.max_bytes is not None:
        return s.max_bytes
    if s.dir not in CACHE.budget:
        try:
            st = os.statvfs(s.dir)
            size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        except OSError:
            size = free = 0
        budget = size // 2
        if shares_dev_shm():
            budget = min(budget, free - RING_RESERVE_BYTES)
        CACHE.budget[s.dir] = max(0, budget)
    return CACHE.budget[s.dir]


def shares_dev_shm() -> bool:
    """True if the segment directory is on the file system of ``/dev/shm`` (or
    that cannot be told): others' files share it; asked once per directory."""
    d = settings().dir
    if d not in CACHE.shares:
        try:
            CACHE.shares[d] = os.stat(d).st_dev == os.stat("/dev/shm").st_dev
        except OSError:
            CACHE.shares[d] = True
    return CACHE.shares[d]


def body_deadline_s(nbytes: int) -> float:
    """Seconds a body of ``nbytes`` may take in all before it gets 408:
    :data:`BODY_TIMEOUT_S` ``+ nbytes /`` :data:`BODY_MIN_RATE`."""
    s = settings()
    return s.body_timeout_s + max(0, nbytes) / s.body_min_rate


def inflight_bytes() -> int:
    """Cap (bytes) on the declared size of the JSON bodies the API server's body
    paths take at once: :func:`budget_bytes`, at least :data:`MIN_INFLIGHT_BYTES`
    (the ``INFLIGHT_BYTES`` limit, unless :data:`TEST_LIMITS` sets it)."""
    s = settings()
    if s.inflight_bytes is not None:
        return s.inflight_bytes
    return max(MIN_INFLIGHT_BYTES, budget_bytes())


def regions_allowed_uids() -> frozenset[int]:
    """Uids that may register regions: this process's and ``VLLM_SHM_EMBEDS_REGIONS_UIDS``."""
    return frozenset((os.getuid(), *settings().regions_uids))


# What vLLM's ``vllm/envs.py`` ``environment_variables`` gets (name -> getter; a derived
# default gives the value in use), so ``Platform.validate_environ`` knows our variables;
# TEST_LIMITS too (its text), so that vLLM does not warn about it either.
ENV_VARS: dict[str, Callable[[], Any]] = {
    s.name: _getter(s.field) for s in SETTINGS
} | {"VLLM_SHM_EMBEDS_MAX_BYTES": budget_bytes, TEST_LIMITS: lambda: os.environ.get(TEST_LIMITS)}


def markdown_table() -> str:
    """The variables table of ``docs/configuration.md``, from :data:`SETTINGS`."""
    rows = ["| variable | default | unit | meaning |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.default_text()} | {s.unit} | {s.doc} |" for s in SETTINGS]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m vllm._shm_embeds.config --markdown")
    sys.stdout.write(markdown_table())
