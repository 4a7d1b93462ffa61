# SPDX-License-Identifier: Apache-2.0
"""files: segments and their files, and all file I/O on the segment directory.

May import: base.

(base: the modules at the package's top.) Of vLLM only ``vllm.logger``; nothing of
lifetime, hops or sites. ``tests/test_registry_tables.py`` (``LAYERS``) fails on any
other import.
"""
