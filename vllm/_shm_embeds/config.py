# SPDX-License-Identifier: Apache-2.0
"""Every ``VLLM_SHM_EMBEDS*`` setting and fixed limit, parsed with one rule; the only reader
of the environment. A bad value never raises: the default is used and ``Settings.problems``
says so. Base layer: may import the other base modules.
Design notes: docs/design.md, "Module notes"."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

import pydantic

from vllm._shm_embeds import private_dir

MAX_WRITERS = 16  # files a segment may be striped over (handles refuse more)
DEFAULT_MIN_BYTES = 1 << 20
RING_RESERVE_BYTES = 64 << 20  # left free for vLLM's own broadcast rings


@dataclasses.dataclass(frozen=True)
class Kind:
    """``adapter``: the pydantic validator (None: the text is the value); ``what`` a bad
    value "is not"; ``strip``: drop surrounding spaces first (paths are taken as given)."""

    adapter: pydantic.TypeAdapter | None = None
    what: str = ""
    strip: bool = True


FLAG = Kind(pydantic.TypeAdapter(bool), "a flag (1/0)")
BYTES = Kind(pydantic.TypeAdapter(Annotated[int, pydantic.Field(ge=0)]), "a byte count")
WRITER_COUNT = Kind(pydantic.TypeAdapter(Annotated[int, pydantic.Field(ge=1, le=MAX_WRITERS)]),
               f"a count in 1..{MAX_WRITERS}")
SECONDS = Kind(pydantic.TypeAdapter(Annotated[float, pydantic.Field(gt=0)]), "a number of seconds")
COUNT = Kind(pydantic.TypeAdapter(Annotated[int, pydantic.Field(ge=1)]), "a positive count")
NAME = Kind()  # text, stripped; unset or blank: the default
PATH = Kind(strip=False)  # text as given


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting (a variable) or one fixed limit (:data:`LIMITS`). ``name``: the
    variable, or the limit's name in :data:`TEST_LIMITS`; ``default``: the value when
    unset, blank or bad (a callable is asked at each parse; None: derived elsewhere, e.g.
    :func:`budget_bytes`); ``doc`` and ``shown`` (the default, where the value alone does
    not say it): cells of ``docs/configuration.md``; ``field``: the :class:`Settings`
    attribute (default: the name after ``VLLM_SHM_EMBEDS_``, lower case)."""

    name: str
    kind: Kind
    default: Any
    unit: str
    doc: str
    shown: str = ""
    field: str = ""

    def __post_init__(self) -> None:
        if not self.field:
            object.__setattr__(self, "field", self.name.removeprefix("VLLM_SHM_EMBEDS_").lower())

    def parse(self, raw: str | None, problems: list[str], label: str = "") -> Any:
        """The value of ``raw``; a bad one gives the default and a message in
        ``problems`` naming ``label`` (default: the variable)."""
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
        "the tmpfs where segments live, in a private directory when it is shared (below). If it"
        " is missing, not writable, or lets other users rename entries, the plugin stays off "
        "and says why."),
    Setting("VLLM_SHM_EMBEDS_STATS_DIR", PATH, None, "path",
        "where every process of the server keeps its counters "
        "([metrics.md](metrics.md#how-the-values-are-collected)); unset: the OpenAI server uses "
        "a private one, removed at exit. If set, use a fresh one per run: files left are counted."),
    Setting("VLLM_SHM_EMBEDS_MAX_BYTES", BYTES, None, "bytes",
        "a cap on this server's segments (what counts: below), checked before each new one; a "
        "tensor that would go over takes the stock path, counted with reason `budget`; nothing "
        "is refused for it.",
        shown="half the segment directory's file system; on `/dev/shm`'s, at most what was "
              f"free at start less {RING_RESERVE_BYTES >> 20} MiB (vLLM's broadcast rings)"),
    Setting("VLLM_SHM_EMBEDS_STRICT", FLAG, False, "flag",
        "on: an illegal segment lifecycle transition (a plugin bug) raises `IllegalTransition` "
        "instead of being logged and refused; for tests only (`tests/conftest.py` sets it)."),
)

MAX_SEGMENTS = 4096  # far beyond what running requests hold; 4096 x 5 VMAs < vm.max_map_count

# Changed only by TEST_LIMITS; callables and None are computed.
LIMITS: tuple[Setting, ...] = (
    Setting("WRITERS", WRITER_COUNT, _default_writers, "threads",  # the machine's CPUs decide
        f"1 to {MAX_WRITERS} threads writing a tensor of 8 MiB or more, each into a file of its "
        "own (tmpfs serializes writes to one file), mapped back to back by readers.",
        shown="usable CPUs, at most 4"),
    Setting("MAX_SEGMENTS", COUNT, MAX_SEGMENTS, "segments",
        "segments one process may own and map at once (up to 1 + files VMAs each). Beyond it a"
        " sender takes the stock path and the EngineCore reads an arriving segment into its own"
        " memory, both counted with reason `segments`."),
)

# Internal, unsupported (tests, benchmarks), e.g. "BODY_TIMEOUT_S=2,INFLIGHT_BYTES=1048576".
TEST_LIMITS = "VLLM_SHM_EMBEDS_TEST_LIMITS"


class Declared(NamedTuple):
    """``variables``: each setting's name, then :data:`TEST_LIMITS`."""

    extensions: tuple[str, ...]
    settings: tuple[Setting, ...]
    limits: tuple[Setting, ...]
    variables: tuple[str, ...]


class Settings:
    """This process's parsed values (frozen): one attribute per setting and limit (its
    ``field``), ``problems`` (each bad value a default replaced) and ``fatal`` (what keeps
    the feature off: no usable segment directory)."""

    problems: tuple[str, ...]
    fatal: tuple[str, ...]

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


class ProcessCache:
    """What this process worked out from its environment, until :meth:`reset`; ``budget``
    and ``shares`` per segment directory."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.declared: Declared | None = None
        self.parsed: tuple[tuple, Settings] | None = None
        self.budget: dict[str, int] = {}
        self.shares: dict[str, bool] = {}


CACHE = ProcessCache()


def declared() -> Declared:
    """The core's :data:`SETTINGS` and :data:`LIMITS`, then each loaded extension's."""
    from vllm._shm_embeds import extensions

    exts = dict(extensions.loaded())
    if CACHE.declared is None or CACHE.declared.extensions != tuple(exts):
        settings = SETTINGS + tuple(s for e in exts.values() for s in e.settings)
        CACHE.declared = Declared(tuple(exts), settings,
                                  LIMITS + tuple(s for e in exts.values() for s in e.limits),
                                  (*(s.name for s in settings), TEST_LIMITS))
    return CACHE.declared


def _limits(limits: tuple[Setting, ...], raw: str | None, problems: list[str]) -> dict[str, Any]:
    """The ``limits``' values, but for those ``raw`` (``NAME=value,...``) names; a bad
    entry keeps the constant and puts a message in ``problems``."""
    by_name = {limit.name: limit for limit in limits}
    given: dict[str, str] = {}
    for item in (raw or "").split(","):
        if not item.strip():
            continue
        name, eq, value = item.partition("=")
        name = name.strip().upper()
        if not eq or name not in by_name:
            problems.append(f"{TEST_LIMITS}: {item.strip()[:64]!r} is not NAME=value with "
                            "NAME one of the declared limits; ignored")
            continue
        given[name] = value
    return {limit.field: limit.parse(given.get(limit.name), problems,
                                     f"{TEST_LIMITS}: {limit.name}") for limit in limits}


def _parse(d: Declared, raw: tuple[str | None, ...]) -> Settings:
    problems: list[str] = []
    values = {s.field: s.parse(value, problems) for s, value in zip(d.settings, raw)}
    values |= _limits(d.limits, raw[len(d.settings)], problems)
    directory = values["dir"]
    usable = os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)
    fatal = () if usable else (f"segment directory {directory} is missing or not writable",)
    return Settings(values | {"problems": tuple(problems), "fatal": fatal})


def settings() -> Settings:
    """This process's settings; parsed again only when a variable or the set of loaded
    extensions changed."""
    d = declared()
    key = (d.extensions, tuple(os.environ.get(name) for name in d.variables))
    parsed = CACHE.parsed
    if parsed is None or parsed[0] != key:
        parsed = CACHE.parsed = (key, _parse(d, key[1]))
    return parsed[1]


def getter(setting: Setting) -> Callable[[], Any]:
    """The getter of a setting's or limit's value; its default while its extension is
    not loaded (still loading, or left out)."""

    def get() -> Any:
        s = settings()
        return getattr(s, setting.field) if hasattr(s, setting.field) else setting.parse(None, [])

    get.__name__ = get.__qualname__ = setting.field
    return get


_CORE = {s.field: s for s in SETTINGS + LIMITS}
enabled = getter(_CORE["enabled"])
min_bytes = getter(_CORE["min_bytes"])
stats_dir = getter(_CORE["stats_dir"])
writers = getter(_CORE["writers"])
max_segments = getter(_CORE["max_segments"])
strict = getter(_CORE["strict"])


def shm_dir() -> str:
    """The segment directory (``private_dir.resolve``). Raises OSError if none can be
    made under ``VLLM_SHM_EMBEDS_DIR``."""
    return private_dir.resolve(settings().dir)


def budget_bytes() -> int:
    """The most this server's segments may hold, in bytes (``VLLM_SHM_EMBEDS_MAX_BYTES``;
    its default is fixed when first asked)."""
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
    """True if the segment directory is on ``/dev/shm``'s file system, or that cannot
    be told (asked once per directory)."""
    d = settings().dir
    if d not in CACHE.shares:
        try:
            CACHE.shares[d] = os.stat(d).st_dev == os.stat("/dev/shm").st_dev
        except OSError:
            CACHE.shares[d] = True
    return CACHE.shares[d]


def env_vars() -> dict[str, Callable[[], Any]]:
    """Name -> getter for vLLM's ``vllm/envs.py`` ``environment_variables``, so that
    vLLM does not warn about our variables (:data:`TEST_LIMITS` included)."""
    return {s.name: getter(s) for s in declared().settings} | {
        "VLLM_SHM_EMBEDS_MAX_BYTES": budget_bytes, TEST_LIMITS: lambda: os.environ.get(TEST_LIMITS)}


def markdown_table() -> str:
    """The variables table of ``docs/configuration.md``."""
    from vllm._shm_embeds import extensions

    owned = [("core", s) for s in SETTINGS] + [
        (name, s) for name, ext in extensions.loaded().items() for s in ext.settings]
    rows = ["| variable | extension | default | unit | meaning |", "|---|---|---|---|---|"]
    rows += [f"| `{s.name}` | {owner} | {s.default_text()} | {s.unit} | {s.doc} |"
             for owner, s in owned]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m vllm._shm_embeds.config --markdown")
    sys.stdout.write(markdown_table())
