# SPDX-License-Identifier: Apache-2.0
"""lifetime: who owns a segment, and when it goes.

``lifecycle.py`` (kinds, states, the one table of allowed transitions), ``owned.py``
(one process's books), ``process.py`` (per-process state, exit, the reaper, the stale
sweep), ``transfer.py`` (share / adopt / open, the budget), ``streamed.py`` (a request
body written into a segment as it arrives, handed over at hop 1 without a copy).

May import: base, files.

Of vLLM only ``vllm.logger`` (``LAYERS`` in ``tests/test_registry_tables.py``).
"""
