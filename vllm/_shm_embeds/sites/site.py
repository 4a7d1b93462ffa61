# SPDX-License-Identifier: Apache-2.0
"""The one type of the sites registry: a vLLM function or method, checked, then wrapped."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

WRAPPED = "__shm_embeds_wrapped__"

# group -> problems (empty: patched) in this process; no entry: not considered here.
STATUS: dict[str, list[str]] = {}
# ``sites.apply``, registered by ``sites/__init__.py`` (no import cycle).
APPLY: list[Callable[[], Any]] = []


def apply_again() -> None:
    """Run the registry's ``apply`` again (groups already decided are skipped)."""
    for apply in APPLY:
        apply()


def is_wrapped(fn: Any) -> bool:
    """True if ``fn`` is one of our wrappers (patching twice is a no-op)."""
    return bool(getattr(fn, WRAPPED, False))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Site:
    """One vLLM attribute we check, and wrap if ``wrap`` is given (keywords only).

    Attributes:
        group: a key of ``sites.GROUPS``; patched only if all its sites hold.
        module: e.g. ``"vllm.v1.engine.core_client"``; ``alt_modules``: other paths
            tried after it (vLLM moved some between 0.32 and 0.33).
        qualname: ``"Class.method"``, or ``"function"`` (module-level, or a global).
        params: parameter names it must accept; ``marks``: strings its source must contain.
        wrap: builds the replacement from the original (:meth:`patch` gives it the
            original's name and ``__wrapped__``); None: checked only.
        patch_in: a module that imported the function by name: its global is replaced.
        what, why, retire: what the plugin does there, why, and the upstream change that
            would retire it (``tools/check_sites.py --doc`` makes design.md's tables).
    """

    key: str
    group: str
    module: str
    qualname: str
    params: tuple[str, ...] = ()
    marks: tuple[str, ...] = ()
    wrap: Callable[[Callable], Callable] | None = None
    alt_modules: tuple[str, ...] = ()
    patch_in: str | None = None
    what: str = ""
    why: str = ""
    retire: str = ""

    def resolve(self) -> tuple[Any, str, Callable]:
        """``(owner, attribute name, function)``. Raises LookupError or TypeError."""
        errors = []
        for module in (self.module, *self.alt_modules):
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                errors.append(f"{module}: {e}")
                continue
            owner: Any = mod
            attr = self.qualname
            if "." in attr:
                cls_name, attr = attr.split(".")
                owner = mod.__dict__.get(cls_name)
                if not isinstance(owner, type):
                    errors.append(f"{module}: no class {cls_name}")
                    continue
            fn = owner.__dict__.get(attr)
            if not callable(fn):
                errors.append(f"{module}: {self.qualname} is not a function")
                continue
            if not is_wrapped(fn):
                self._check(fn)
            if self.patch_in is not None:
                return self._caller_global(attr, fn)
            return owner, attr, fn
        raise LookupError("; ".join(errors))

    def _caller_global(self, attr: str, fn: Callable) -> tuple[Any, str, Callable]:
        caller = importlib.import_module(self.patch_in)
        current = caller.__dict__.get(attr)
        if current is not fn and getattr(current, "__wrapped__", None) is not fn:
            raise LookupError(f"{self.patch_in} does not call vLLM's {attr}")
        return caller, attr, current

    def _check(self, fn: Callable) -> None:
        names = set(inspect.signature(fn).parameters)
        missing = [p for p in self.params if p not in names]
        if missing:
            raise TypeError(f"{self.qualname} lacks parameter(s) {missing}")
        if self.marks:
            src = inspect.getsource(fn)
            absent = [m for m in self.marks if m not in src]
            if absent:
                raise LookupError(f"{self.qualname} no longer contains {absent}")

    def patch(self, owner: Any, attr: str, fn: Callable) -> None:
        """Replace ``owner.attr`` by ``wrap(fn)`` (once; nothing if no ``wrap``)."""
        if self.wrap is None or is_wrapped(fn):
            return
        new = functools.wraps(fn)(self.wrap(fn))
        setattr(new, WRAPPED, True)
        setattr(owner, attr, new)
