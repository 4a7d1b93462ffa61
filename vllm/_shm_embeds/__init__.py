# SPDX-License-Identifier: Apache-2.0
"""shm-embeds: large ``prompt_embeds`` cross vLLM V1's process hops by shared memory.

Public names: :class:`SharedTensorHandle`, :class:`ShmEmbedsError`,
:func:`externalize` (a tensor -> its handle), :func:`internalize` (a handle ->
the mapped tensor). Layers and modules: docs/design.md, "Package layout".
"""

from typing import Any

__all__ = ["SharedTensorHandle", "ShmEmbedsError", "externalize", "internalize"]

_HOME = {"SharedTensorHandle": "handle", "ShmEmbedsError": "handle",
         "externalize": "hops.hop2", "internalize": "hops.hop2"}


def __getattr__(name: str) -> Any:
    # PEP 562: importing the package (vLLM's plugin loader does) loads no submodule.
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
