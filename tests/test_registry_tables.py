# SPDX-License-Identifier: Apache-2.0
"""Tables declared once, and what is generated from or checked against them.

* counter events: every event counted anywhere in the package is a declared
  one (``counters.events()``: the core's :class:`counters.Event` and each
  extension's ``events``; an extension counts only its own and the core's),
  counted the way it is declared (plain or labelled), and reaches
  ``/metrics`` exactly as declared (its family, or none for the summary-only
  ones); ``ext/metrics/metrics.py`` maps only declared events;
  ``docs/metrics.md`` names each;
* vLLM sites: each says what, why and what would retire it;
  ``docs/design.md``'s sites tables are what ``tools/check_sites.py --doc``
  generates from ``SITES`` and ``GROUPS``; ``tools/vllm_sites.md``'s letters
  name real sites; a group that needs a group that is off is off;
* modules: every module of the package is in ``docs/design.md``'s layout
  table, and the table names no module that does not exist; no module
  docstring is over 15 lines (the rest is in its "Module notes" section).
* imports: no module of the package reaches itself through its imports;
* layers: :data:`LAYERS` says what each layer of the package may import (of
  the package, of vLLM, HTTP libraries); every import of every module (one
  inside a function too) keeps to it, and each subpackage's docstring says
  the same.
"""

import ast
import os
import re
import sys
import types
from typing import NamedTuple

import pytest
from helpers import REPO

from vllm._shm_embeds import counters, extensions, sites
from vllm._shm_embeds.counters import Event, EventKind, Key
from vllm._shm_embeds.ext.metrics import metrics

sys.path.insert(0, os.path.join(REPO, "tools"))
import check_sites  # noqa: E402

PACKAGE = os.path.join(REPO, "vllm", "_shm_embeds")
COUNT_CALLS = ("count", "count_many", "count_reason")


def _read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def _package_files() -> list[str]:
    """Paths of the package's modules, relative to the package directory."""
    out = []
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [os.path.relpath(os.path.join(root, f), PACKAGE)
                for f in files if f.endswith(".py")]
    return sorted(out)


def _event_kinds() -> dict[str, type[EventKind]]:
    """Class name -> every declared event class (``E``: the core's, as metrics.py names it)."""
    kinds = {type(e).__name__: type(e) for e in counters.events()}
    return {**kinds, "E": Event}


def _event_of(node: ast.expr, where: str) -> EventKind:
    """The declared event an argument names: ``Event.X`` (or an extension's
    ``BinaryEvent.X``...) or a string value."""
    kinds = _event_kinds()
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in kinds):
        kind = kinds[node.value.id]
        assert node.attr in kind.__members__, f"{where}: no {node.value.id}.{node.attr}"
        return kind[node.attr]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        declared = {e.value: e for e in counters.events()}
        assert node.value in declared, f"{where}: undeclared {node.value!r}"
        return declared[node.value]
    raise AssertionError(f"{where}: the event is not named ({ast.dump(node)})")


def counted_events() -> list[tuple[EventKind, bool, str]]:
    """``(event, labelled, where)`` for every count call in the package."""
    found = []
    for rel in _package_files():
        if rel == "counters.py":
            continue
        tree = ast.parse(_read("vllm", "_shm_embeds", rel))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else (
                f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                and f.value.id == "counters" else None)
            if name not in COUNT_CALLS:
                continue
            where = f"{rel}:{node.lineno}"
            if name == "count_reason":
                found.append((_event_of(node.args[0], where), True, where))
            elif name == "count_many":
                arg = node.args[0]
                assert isinstance(arg, ast.Dict), f"{where}: count_many needs a dict display"
                found += [(_event_of(k, where), False, where) for k in arg.keys]
            else:
                found += [(_event_of(a, where), False, where) for a in node.args[:1]]
    return found


def test_every_counted_event_is_declared_and_counted_as_declared():
    found = counted_events()
    assert len(found) > 60  # the scan sees the call sites (about 85 events counted)
    loaded = extensions.loaded()
    for event, labelled, where in found:
        assert bool(event.labels) == labelled, (
            f"{where}: {event} is declared with labels {event.labels}")
        # An extension counts its own events and the core's, never another's.
        ext = where.split(os.sep)[1] if where.startswith("ext" + os.sep) else None
        assert type(event) is Event or (ext is not None and type(event) is loaded[ext].events), (
            f"{where}: {event} is {type(event).__name__}'s, not {ext or 'the core'}'s")
    # Every declared event is counted somewhere (none left over after a rename).
    assert {e for e, _, _ in found} == set(counters.events())


def test_events_are_the_cores_and_the_extensions():
    """``counters.events()``: the core's, then each loaded extension's; one stored
    name each."""
    loaded = extensions.loaded()
    kinds = [Event] + [ext.events for ext in loaded.values() if ext.events is not None]
    assert len(kinds) > 1 and all(issubclass(k, EventKind) for k in kinds)
    assert counters.events() == [e for k in kinds for e in k]
    assert len({e.value for e in counters.events()}) == len(counters.events())


def _families_fed(event: EventKind, tmp_path) -> set[str]:
    """The /metrics families whose values change when ``event`` is counted once
    by a sending process (no role)."""
    key = Key(event.value, "1" if "hop" in event.labels else "",
              "some_reason" if "reason" in event.labels else "")
    base = metrics.aggregate({}, set(), seg_dir=str(tmp_path))
    got = metrics.aggregate({(key, ""): 3}, set(), seg_dir=str(tmp_path))
    return {m for m in got if m not in ("dir_free_bytes", "dir_size_bytes")
            and got[m] != base[m]}


def test_each_event_reaches_metrics_as_declared(tmp_path):
    """An event declared for a family feeds that family (and only it); one
    declared summary-only (``metric=None``) feeds none: /metrics maps
    exactly what the declarations say."""
    for event in counters.events():
        fed = _families_fed(event, tmp_path)
        want = {event.metric} if event.metric else set()
        assert fed == want, f"{event}: feeds {fed}, declared {want}"
    # Every counter family of /metrics is fed by some declared event.
    counter_families = {m for m, (kind, _, _) in metrics.METRICS.items() if kind == "counter"}
    assert metrics.families() == metrics.METRICS  # every extension loaded
    fed_by_receiver = {"received_tensors"}  # hop shm tensors counted by a receiver
    assert counter_families - fed_by_receiver == {
        e.metric for e in counters.events() if e.metric}


def test_metrics_maps_only_declared_events():
    assert metrics._HOP_EVENTS and all(isinstance(e, Event) for e in metrics._HOP_EVENTS)
    declared = {e.value for e in counters.events()}
    named = {*metrics._HOW, *metrics._COUNTED_IN, *metrics._COUNTED_IN.values()}
    assert named <= declared, named - declared


def test_every_event_is_in_the_metrics_doc():
    doc = _read("docs", "metrics.md")
    missing = [e.value for e in counters.events() if f"`{e.value}" not in doc]
    assert not missing, f"docs/metrics.md does not name {missing}"


def test_stored_names_are_the_event_values(tmp_path, monkeypatch):
    """Named constants store their values as plain strings."""
    monkeypatch.setenv("VLLM_SHM_EMBEDS_STATS_DIR", str(tmp_path))
    counters.reset()
    counters.count(Event.COPIED_BYTES, 3)
    counters.count(Event.COPIED_BYTES, 4)
    counters.count_many({Event.SEGMENTS_CREATED: 1, Event.HOP1_SHM_BYTES: 2})
    counters.count_reason(Event.FALLBACK, "small", hop="1")
    assert counters.stats() == {"copied_bytes": 7, "segments_created": 1,
                                "hop1_shm_bytes": 2, "fallback.hop1.small": 1}
    values = metrics.read_server(str(tmp_path))
    assert {type(k.event) for k, _ in values} == {str}
    counters.reset()


# --------------------------------------------------------------------------
# sites


def test_every_site_says_what_why_and_what_retires_it():
    for site in sites.SITES:
        assert site.group in sites.GROUPS, site.key
        assert site.what and site.why and site.retire, site.key
    order = list(sites.GROUPS)
    for name, group in sites.GROUPS.items():
        # needs are checked in order: a needed group is decided first
        assert all(order.index(n) < order.index(name) for n in group.needs), name


def test_design_doc_sites_tables_are_generated_from_the_registry():
    text = _read("docs", "design.md")
    want = check_sites.doc_with_tables(text, check_sites.sites_tables(sites))
    assert text == want, "docs/design.md drifted: run python tools/check_sites.py --doc"


def test_vllm_sites_md_letters_name_real_sites():
    text = _read("tools", "vllm_sites.md")
    rows = re.findall(r"^\| ([a-i]) \| ([^|]*) \|", text, re.M)
    assert [r[0] for r in rows] == list("abcdefghi")
    named = {k for _, cell in rows for k in re.findall(r"`(\w+)`", cell)}
    keys = {s.key for s in sites.SITES}
    assert named <= keys, f"not sites: {named - keys}"
    hops = {s.key for s in sites.SITES if s.group in ("hop1", "hop2")}
    assert hops <= named, f"hop sites not read: {hops - named}"


@pytest.mark.parametrize("failing", ["binary", "hop1"])
def test_group_that_needs_an_off_group_is_off(monkeypatch, failing):
    """In an API server, JSON and regions ride on the binary group's
    middleware: with it off they say so (and the middleware adds neither)."""
    from vllm._shm_embeds.ext.regions import settings as regions_settings

    monkeypatch.setattr(regions_settings, "regions_path", lambda: "/tmp/socket")
    monkeypatch.setattr(sites, "STATUS", {})
    monkeypatch.setitem(sys.modules, sites.APP_MODULE, types.ModuleType("app"))
    monkeypatch.setattr(sites, "check", lambda group: (
        [f"{group}: missing"] if group == failing else [], []))
    status = sites.apply()
    for group in ("json", "regions", "binary"):
        assert status[group], (group, status)
    assert status["hop2"] == [] and status["metrics"] == []


def test_regions_group_only_when_configured(monkeypatch):
    from vllm._shm_embeds.ext.regions import settings as regions_settings

    monkeypatch.setattr(regions_settings, "regions_path", lambda: "")
    monkeypatch.setattr(sites, "STATUS", {})
    monkeypatch.setitem(sys.modules, sites.APP_MODULE, types.ModuleType("app"))
    monkeypatch.setattr(sites, "check", lambda group: ([], []))
    assert "regions" not in sites.apply() and sites.STATUS["json"] == []


def test_a_body_format_only_with_its_group_and_setting(monkeypatch):
    """The body gate gets the formats of ``formats.formats()`` whose sites
    group is patched and whose setting is on, in the registry's order."""
    from vllm._shm_embeds.ext.regions import settings as regions_settings
    from vllm._shm_embeds.ext.binary.formats import formats as all_formats
    from vllm._shm_embeds.ext.binary import site_entrypoints as entrypoints

    def names():
        return [f.name for f in entrypoints.body_formats()]

    monkeypatch.setattr(regions_settings, "regions_path", lambda: "/tmp/socket")
    for f in all_formats():
        monkeypatch.setitem(entrypoints.STATUS, f.group, [])
    assert names() == [f.name for f in all_formats()] == ["binary", "regions", "json"]
    monkeypatch.setitem(entrypoints.STATUS, "regions", ["binary is off"])
    assert names() == ["binary", "json"]
    monkeypatch.setattr(regions_settings, "regions_path", lambda: "")
    monkeypatch.setitem(entrypoints.STATUS, "regions", [])
    monkeypatch.setenv("VLLM_SHM_EMBEDS_JSON", "0")
    assert names() == ["binary"]


# --------------------------------------------------------------------------
# modules


def test_every_module_is_in_the_design_doc_layout():
    text = _read("docs", "design.md")
    section = text[text.index("## Package layout"):text.index("## The vLLM sites")]
    listed: set[str] = set()
    for row in re.findall(r"^\| (`[^|]*) \|", section, re.M):
        listed.update(re.findall(r"`([\w/]+\.py)`", row))
    files = set(_package_files())
    assert not files - listed, f"modules not in docs/design.md: {sorted(files - listed)}"
    assert not listed - files, f"docs/design.md names no module: {sorted(listed - files)}"


MAX_MODULE_DOC_LINES = 15


def test_module_docstrings_are_short():
    """A module's docstring says what it does and may import, in at most
    :data:`MAX_MODULE_DOC_LINES` lines (every line counted); the design, its
    cases and version notes live in ``docs/design.md``'s "Module notes"."""
    assert len(_package_files()) > 50  # the walk saw the package
    long = []
    for rel in _package_files():
        doc = ast.get_docstring(ast.parse(_read("vllm", "_shm_embeds", rel)), clean=False)
        n = len(doc.splitlines()) if doc else 0
        if n > MAX_MODULE_DOC_LINES:
            long.append(f"{rel} ({n} lines)")
    assert not long, (f"module docstrings over {MAX_MODULE_DOC_LINES} lines (move the rest "
                      f"to docs/design.md, \"Module notes\"): {', '.join(long)}")


MAX_MODULE_LINES = 500


def test_modules_are_small():
    """A module of the package does one job in at most :data:`MAX_MODULE_LINES` lines
    (issue 53): split it where its jobs part."""
    long = [f"{rel} ({n} lines)" for rel in _package_files()
            if (n := len(_read("vllm", "_shm_embeds", rel).splitlines())) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {', '.join(long)}"


def test_design_doc_states_the_sizes():
    """``docs/design.md`` states the core's and the extensions' lines (``wc -l``) as
    they are: a change that grows or shrinks either says so there."""
    sizes = {"core": 0, "ext": 0}
    for rel in _package_files():
        with open(os.path.join(PACKAGE, rel), "rb") as f:
            sizes["ext" if rel.startswith("ext/") else "core"] += f.read().count(b"\n")
    text = " ".join(_read("docs", "design.md").split())
    core = re.search(r"the core is ([\d,]+) lines", text)
    ext = re.search(r"the \w+ extensions are ([\d,]+)", text)
    assert core and ext, "docs/design.md states no size"
    assert (int(core[1].replace(",", "")), int(ext[1].replace(",", ""))) == (
        sizes["core"], sizes["ext"]), f"docs/design.md's sizes; the package's: {sizes}"


def _module_name(rel: str) -> str:
    """``"sites/__init__.py"`` -> ``"vllm._shm_embeds.sites"``."""
    return ".".join(["vllm._shm_embeds", *rel[:-3].split(os.sep)]).removesuffix(".__init__")


def _imports(rel: str, source: str | None = None) -> set[str]:
    """Every module the package's module ``rel`` imports, anywhere in its body
    (a lazy import inside a function counts), by its full name. ``from X
    import Y`` imports X (a package's ``__init__`` runs) and X.Y: a module, a
    name from X (``X.Y`` then names no module), or a module of X's package."""
    mod = _module_name(rel)
    package = mod if rel.endswith("__init__.py") else mod.rsplit(".", 1)[0]
    tree = ast.parse(source if source is not None else _read("vllm", "_shm_embeds", rel))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    found.discard(mod)
    return found


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (:func:`_imports`)."""
    names = {_module_name(rel) for rel in _package_files()}
    return {_module_name(rel): _imports(rel) & names for rel in _package_files()}


def test_no_import_cycle():
    """A reader knows from a module's imports what it may touch: no module of
    the package reaches itself through its imports (``sites/`` modules that
    need the registry's ``apply`` call ``site.apply_again``)."""
    graph = _import_graph()
    assert "vllm._shm_embeds.sites.multiproc_executor" in graph  # the walk saw the package
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


# --------------------------------------------------------------------------
# layers


class Layer(NamedTuple):
    may_import: tuple[str, ...]  # the layers below it that it may import (its own: always)
    vllm: tuple[str, ...] | None  # the vLLM modules it may import (and theirs); None: any
    http_libs: bool = False  # may it import an HTTP library (HTTP_LIBS)


# The package's layers, lowest first: the one table of what each may import.
# No layer names one above it; the mechanism (base to regions) imports nothing
# of http or sites, no HTTP library, and of vLLM only its logger.
BASE = ("config", "handle", "counters", "procfs", "private_dir",  # at the package's top
        "extensions", "pools")
ENTRY = ("__init__", "plugin")  # at the package's top: what vLLM and users load
HTTP_LIBS = ("starlette", "fastapi", "uvicorn", "httpx", "aiohttp", "h11")
LOGGER = ("vllm.logger",)
LAYERS = {
    "base": Layer((), LOGGER),
    "files": Layer(("base",), LOGGER),
    "lifetime": Layer(("base", "files"), LOGGER),
    "hops": Layer(("base", "files", "lifetime"), LOGGER),
    "sites": Layer(("base", "files", "lifetime", "hops"), None),
    "entry": Layer(("base", "files", "lifetime", "hops", "sites"), None),
    # An extension (ext/<name>/): the core's mechanism, its own modules, never
    # another extension (extensions.require reaches one); vllm.renderers.embed_utils:
    # a JSON payload the direct decode does not take goes to vLLM's own loader.
    "ext": Layer(("base", "files", "lifetime", "hops"),
                 (*LOGGER, "vllm.renderers.embed_utils"), http_libs=True),
    # An extension's site modules (ext/<name>/site_*.py) and its __init__.
    "ext_sites": Layer(("base", "files", "lifetime", "hops", "sites"), None, http_libs=True),
}
CORE = ("base", "files", "lifetime", "hops", "sites", "entry")
PACKAGE_NAME = "vllm._shm_embeds"
EXT = PACKAGE_NAME + ".ext"


def _ext_of(name: str) -> str | None:
    """The extension a module of the package belongs to (None: the core)."""
    rest = name.removeprefix(EXT + ".")
    return rest.split(".")[0] if name.startswith(EXT + ".") else None


def _layer_of(name: str) -> str | None:
    """The layer of the package's module ``name`` (a module, or a name from
    one: the public names of the package's ``__init__`` are entry's); None
    for the package itself, whose ``__init__`` imports nothing."""
    rest = name.removeprefix(PACKAGE_NAME + ".").split(".")
    if name == PACKAGE_NAME:
        return None
    if rest[0] == "ext":
        leaf = rest[-1]
        return "ext_sites" if len(rest) <= 2 or leaf.startswith("site_") or (
            len(rest) == 3 and os.path.isdir(os.path.join(PACKAGE, *rest))) else "ext"
    if rest[0] in LAYERS and os.path.isdir(os.path.join(PACKAGE, rest[0])):
        return rest[0]
    if rest[0] in BASE:
        return "base"
    return "entry"  # plugin, __init__'s public names, or a module in no layer


def _in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layer_violations(rel: str, source: str | None = None) -> list[str]:
    """What the module ``rel`` (its file, or ``source`` as if it were that
    file) imports against :data:`LAYERS`: the core imports no extension, an
    extension no other extension."""
    me = _module_name(rel)
    layer = _layer_of(me)
    rule = LAYERS[layer or "entry"]
    bad = []
    for name in sorted(_imports(rel, source)):
        top = name.split(".")[0]
        if name == PACKAGE_NAME or name.startswith(PACKAGE_NAME + "."):
            dep, ext = _layer_of(name), _ext_of(name)
            if ext is not None and _ext_of(me) != ext:
                bad.append(f"{rel} ({_ext_of(me) or 'core'}) imports {name} "
                           f"(extension {ext}): reach it through extensions.get/require")
            elif ext is None and dep is not None and dep != layer and \
                    dep not in rule.may_import:
                bad.append(f"{rel} ({layer}) imports {name} ({dep})")
        elif top == "vllm":
            if rule.vllm is not None and name != "vllm" and not _in(name, rule.vllm):
                bad.append(f"{rel} ({layer}) imports vLLM's {name}")
        elif top in HTTP_LIBS and not rule.http_libs:
            bad.append(f"{rel} ({layer}) imports the HTTP library {name}")
    return bad


def test_layers_table_is_ordered():
    """A layer names only layers below it (lower layers never import higher
    ones), and every module of the package is in a layer."""
    order = list(LAYERS)
    for name, rule in LAYERS.items():
        assert all(order.index(d) < order.index(name) for d in rule.may_import), name
    subpackages = {rel.split(os.sep)[0] for rel in _package_files() if os.sep in rel}
    assert subpackages - {"ext"} <= set(LAYERS), (
        f"subpackages in no layer: {subpackages - {'ext'} - set(LAYERS)}")
    top = {rel[:-3] for rel in _package_files() if os.sep not in rel}
    assert top == set(BASE) | set(ENTRY), (
        f"modules at the package's top in no layer: {sorted(top - set(BASE) - set(ENTRY))}")


def test_each_layer_says_what_it_may_import():
    """Each subpackage's docstring has the line ``May import: a, b.`` naming
    exactly the layers of :data:`LAYERS` (so the two cannot drift)."""
    for rel in _package_files():
        if not rel.endswith(os.sep + "__init__.py"):
            continue
        layer = rel.split(os.sep)[0]
        doc = ast.get_docstring(ast.parse(_read("vllm", "_shm_embeds", rel))) or ""
        lines = re.findall(r"^May import: (.*)\.$", doc, re.M)
        assert len(lines) == 1, f"{rel}: no one 'May import: ...' line"
        if layer == "ext":  # an extension: the core, never another extension
            assert lines[0].startswith("the core"), rel
        else:
            assert tuple(lines[0].split(", ")) == LAYERS[layer].may_import, rel


def _seam_calls(rel: str) -> list[tuple[str, str, str, int]]:
    """``(function, extension, module, line)`` of every ``extensions.get`` or
    ``extensions.require`` call with literal arguments in module ``rel``."""
    out = []
    for node in ast.walk(ast.parse(_read("vllm", "_shm_embeds", rel))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "extensions"
                and node.func.attr in ("get", "require")):
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            assert len(args) == 2, f"{rel}:{node.lineno}: name the extension and module"
            out.append((node.func.attr, *args, node.lineno))
    return out


def test_extensions_reach_each_other_only_as_declared():
    """The seam (``extensions.py``): every extension in :data:`EXTENSIONS`
    has its folder, each ``require`` of an extension names one of its
    ``needs`` (the core never requires one: it ``get``s, and copes with
    None), and every module reached is one the other publishes (``api``)."""
    from vllm._shm_embeds import extensions

    exts = extensions.loaded()
    assert set(exts) == set(extensions.EXTENSIONS), extensions.MISSING
    calls = 0
    for rel in _package_files():
        me = _ext_of(_module_name(rel))
        for fn, name, module, line in _seam_calls(rel):
            calls += 1
            where = f"{rel}:{line}"
            assert name in exts and module in exts[name].api, f"{where}: {name}.{module}"
            if fn == "require":
                assert me is not None, f"{where}: the core requires no extension"
                assert name in exts[me].needs, f"{where}: {me} does not declare it needs {name}"
    assert calls > 10  # the scan saw the calls


def test_no_module_imports_against_its_layer():
    """Every import of every module of the package (one inside a function
    included) is one its layer may make (:data:`LAYERS`)."""
    assert len(_package_files()) > 50  # the walk saw the package
    bad = [v for rel in _package_files() for v in layer_violations(rel)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("rel", "source"), [
    ("files/segment.py", "def f():\n    from vllm._shm_embeds.lifetime import process\n"),
    ("config.py", "import vllm._shm_embeds.files.segment\n"),
    ("lifetime/owned.py", "from vllm._shm_embeds.hops import hop2\n"),
    ("hops/hop2.py", "from vllm.v1.engine import EngineCoreRequest\n"),
    ("hops/hop1.py", "from vllm import envs\n"),
    ("ext/json/torch_save.py", "from vllm._shm_embeds.sites import site\n"),
    ("ext/regions/memfd.py", "from ...binary import common\n"),
    ("ext/json/json_body.py", "from vllm._shm_embeds.ext.binary.gate import Body\n"),
    ("ext/digests/digests.py", "from vllm.v1.engine import EngineCoreRequest\n"),
    ("hops/hop1.py", "from vllm._shm_embeds.ext.digests import digests\n"),
    ("sites/core_client.py", "def f():\n    import vllm._shm_embeds.ext.metrics.metrics\n"),
    ("plugin.py", "from vllm._shm_embeds.ext import binary\n"),
    ("files/census.py", "from vllm._shm_embeds import externalize\n"),
    ("lifetime/process.py", "import starlette.requests\n"),
    ("ext/binary/common.py", "from vllm._shm_embeds.sites import site\n"),
    ("ext/binary/binary.py", "from vllm._shm_embeds import plugin\n"),
    ("sites/site.py", "from vllm._shm_embeds.plugin import register\n"),
])
def test_an_import_against_the_layers_fails(rel, source):
    """The check sees what it must: each of these imports is against the table."""
    assert layer_violations(rel, source), source
    assert not layer_violations(rel, "import os\nfrom vllm.logger import init_logger\n")


def test_pyproject_finds_every_subpackage():
    """A wheel holds every folder of the package and nothing else: ``[tool.setuptools.
    packages.find]`` (setuptools' own discovery, as ``pip install .`` runs it) finds
    each subpackage, so deleting an ``ext/`` folder needs no edit there."""
    import tomllib

    from setuptools import find_namespace_packages

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        find = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]
    assert find.get("namespaces") is True
    listed = set(find_namespace_packages(REPO, include=find["include"],
                                         exclude=find.get("exclude", ()))) - {"vllm"}
    found = {_module_name(rel) for rel in _package_files() if rel.endswith("__init__.py")}
    assert listed == found
