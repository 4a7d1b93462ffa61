# SPDX-License-Identifier: Apache-2.0
"""The one seam between the core and its extensions (``docs/design.md``, "Extensions"):
the core reaches an extension's modules only through :func:`get` (None when absent).

May import: base (this module imports nothing of the package but logging).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

from vllm.logger import init_logger

logger = init_logger(__name__)

PACKAGE = __name__.rpartition(".")[0]
HERE = os.path.dirname(os.path.abspath(__file__))

# Extension name -> its folder, relative to this package. In load order: an
# extension comes after every one it needs.
EXTENSIONS: dict[str, str] = {name: f"ext/{name}" for name in (
    "digests", "metrics", "binary", "json", "held", "regions", "conversations", "nodes")}


class Group(NamedTuple):
    """A group of sites, patched all or none.

    Attributes:
        needs: groups that must not be off (one not considered here does not
            count); checked in :data:`GROUPS` order.
        server_only: considered only in an API server.
        message: the warning when it stays stock (pid, problems).
        covers: what it is, for the generated table in ``docs/design.md``.
        wanted: None, or a configuration check; a group not wanted is skipped silently.
        before_patch: None, or what to run once its sites hold, before patching.
    """

    needs: tuple[str, ...]
    server_only: bool
    message: str
    covers: str
    wanted: Callable[[], bool] | None = None
    before_patch: Callable[[], Any] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Extension:
    """What an extension's ``__init__`` declares as ``EXTENSION``.

    Attributes:
        what: one line, for logs and ``docs/design.md``.
        needs: extensions it cannot work without (absent: it is not loaded).
        api: its modules other extensions and the core may reach (:func:`get`).
        sites: its modules that declare ``SITES`` (vLLM sites it patches).
        groups: its site groups, ``name ->`` :class:`Group`, patched all or none.
        provides: entries for other extensions' registries, by name (e.g. ``body_formats``).
        settings: its ``VLLM_SHM_EMBEDS_*`` variables (``config.Setting``).
        limits: its fixed limits (``config.Setting``; changed only by tests).
        events: its counted events (a ``counters.EventKind`` enum), or None.
    """

    what: str
    needs: tuple[str, ...] = ()
    api: tuple[str, ...] = ()
    sites: tuple[str, ...] = ()
    groups: dict[str, Group] = dataclasses.field(default_factory=dict)
    provides: dict[str, tuple] = dataclasses.field(default_factory=dict)
    settings: tuple = ()
    limits: tuple = ()
    events: Any = None


_LOADED: dict[str, Extension] | None = None
MISSING: dict[str, str] = {}  # extension -> why it is not loaded
_SITE_MODULES: dict[str, list[ModuleType]] = {}


def present(name: str) -> bool:
    folder = EXTENSIONS.get(name)
    return folder is not None and os.path.isfile(os.path.join(HERE, folder, "__init__.py"))


def package_of(name: str, module: str = "") -> str:
    """The package of extension ``name`` (with ``module``: that module's name)."""
    base = f"{PACKAGE}.{EXTENSIONS[name].replace('/', '.')}"
    return f"{base}.{module}" if module else base


def loaded() -> dict[str, Extension]:
    """Every extension present whose needs are loaded, in :data:`EXTENSIONS` order
    (computed once, from each ``__init__`` alone). Never raises: one whose declaration
    fails to load is logged and left out, and so is what needs it."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    _LOADED = out = {}
    for name in EXTENSIONS:
        if not present(name):
            MISSING[name] = "not installed (its folder is absent)"
            continue
        try:
            ext = importlib.import_module(package_of(name)).EXTENSION
        except Exception:
            MISSING[name] = "failed to load"
            logger.warning("shm-embeds: extension %s not loaded", name, exc_info=True)
            continue
        lacking = [n for n in ext.needs if n not in out]
        if lacking:
            MISSING[name] = f"needs {', '.join(lacking)}"
            logger.info("shm-embeds: extension %s off: needs %s", name, ", ".join(lacking))
            continue
        out[name] = ext
    return out


def _drop(name: str, why: str) -> None:
    """Leave ``name`` out of :func:`loaded`, and every extension that needs it."""
    MISSING[name] = why
    loaded().pop(name, None)
    for other, ext in list(loaded().items()):
        if name in ext.needs:
            _drop(other, f"needs {name}")


def get(name: str, module: str) -> ModuleType | None:
    """Module ``module`` of extension ``name`` (one of its ``api``), None when it is not
    loaded. Raises ValueError for a module it does not publish (a programming error)."""
    ext = loaded().get(name)
    if ext is None:
        return None
    if module not in ext.api:
        raise ValueError(f"extension {name} does not publish {module}")
    return importlib.import_module(package_of(name, module))


def require(name: str, module: str) -> ModuleType:
    """:func:`get`, for an extension listed in the caller's ``needs``:
    raises ImportError when it is absent (the caller is then not loaded)."""
    found = get(name, module) if present(name) else None
    if found is None:
        raise ImportError(f"shm-embeds extension {name} is not installed")
    return found


def provided(registry: str) -> list[tuple[str, Any]]:
    """``(extension, entry)`` for every entry the loaded extensions provide to ``registry``."""
    return [(name, entry) for name, ext in loaded().items()
            for entry in ext.provides.get(registry, ())]


def site_modules() -> list[ModuleType]:
    """The loaded extensions' modules that declare ``SITES`` (imported once); an
    extension one of which fails to import is left out (:func:`_drop`), never half patched."""
    for name, ext in list(loaded().items()):
        if name in _SITE_MODULES or name not in loaded():
            continue
        try:
            _SITE_MODULES[name] = [importlib.import_module(package_of(name, m)) for m in ext.sites]
        except Exception:
            logger.warning("shm-embeds: extension %s not loaded (its vLLM sites)", name,
                           exc_info=True)
            _drop(name, "failed to load")
    return [m for name in loaded() for m in _SITE_MODULES.get(name, ())]
