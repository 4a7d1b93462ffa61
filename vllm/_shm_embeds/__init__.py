# SPDX-License-Identifier: Apache-2.0
"""shm-embeds: large ``prompt_embeds`` cross vLLM V1's process hops by shared memory.

With ``VLLM_SHM_EMBEDS=1`` this plugin puts the tensor in a shared-memory segment
once and sends a small :class:`SharedTensorHandle` over each hop (API server ->
EngineCore, EngineCore -> TP workers) instead of the bytes.

One file per job, in layers (``docs/design.md``, "Package layout", lists every
module); a layer imports only those below it (each subpackage's docstring says
which; ``LAYERS`` in ``tests/test_registry_tables.py`` fails on any other import).

Public names: :class:`SharedTensorHandle`, :class:`ShmEmbedsError`,
:func:`externalize` (a tensor -> its handle), :func:`internalize` (a handle ->
the mapped tensor).
Design notes: docs/design.md, "Module notes".
"""

from typing import Any

__all__ = ["SharedTensorHandle", "ShmEmbedsError", "externalize", "internalize"]

_HOME = {"SharedTensorHandle": "handle", "ShmEmbedsError": "handle",
         "externalize": "hops.hop2", "internalize": "hops.hop2"}


def __getattr__(name: str) -> Any:
    # Loaded on first use (PEP 562): importing the package, as vLLM's plugin
    # loader does for ``plugin.register``, loads no module it does not need,
    # and no submodule depends on this file.
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
