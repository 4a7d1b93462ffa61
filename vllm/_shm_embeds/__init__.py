# SPDX-License-Identifier: Apache-2.0
"""shm-embeds: large ``prompt_embeds`` cross vLLM V1's process hops by shared memory.

vLLM V1 copies a request's ``prompt_embeds`` (``(num_tokens, hidden_size)``
in the model dtype; hundreds of MB for long prompts) from the API server to
the EngineCore (hop 1: msgpack + ZMQ frames) and from there to every TP
worker (hop 2: the ``SchedulerOutput`` broadcast). With
``VLLM_SHM_EMBEDS=1`` this plugin puts the tensor in a shared-memory segment
once and sends a small :class:`SharedTensorHandle` over each hop instead.

One file per job, in layers; ``docs/design.md`` ("Package layout") lists
every module and its job, the one such list (a test fails when a module is
missing). Lowest first; a layer imports only those below it (each
subpackage's docstring says which; ``LAYERS`` in
``tests/test_registry_tables.py`` fails on any other import):

* base, shared by every layer: ``config``, ``handle``, ``counters``,
  ``procfs``, ``private_dir`` (at the package's top);
* the mechanism, no vLLM classes, no HTTP: ``files/`` (segments and their
  files), ``lifetime/`` (who owns a segment and when it goes), ``hops/``
  (what crosses hop 1 and hop 2), ``formats/`` (payload formats),
  ``regions/`` (registered regions);
* the API server's HTTP side: ``http/``;
* every patched vLLM site, in one registry: ``sites/``; the entry point
  vLLM loads: ``plugin.register``.

Public names (the user's design names them): :class:`SharedTensorHandle`,
:class:`ShmEmbedsError`, :func:`externalize` (hop 2 sender: a tensor -> its
handle) and :func:`internalize` (hop 2 reader: a handle -> the mapped tensor).
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
