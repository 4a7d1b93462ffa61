# SPDX-License-Identifier: Apache-2.0
"""files: segments and their files, and all file I/O on the segment directory.

May import: base.

(base: the modules at the package's top.) Of vLLM only ``vllm.logger``; checked by
``LAYERS`` in ``tests/test_registry_tables.py``.
"""
