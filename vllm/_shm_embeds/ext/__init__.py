# SPDX-License-Identifier: Apache-2.0
"""Extensions of the core: each folder here may be deleted.

``extensions.EXTENSIONS`` (the package's ``extensions.py``) lists them; the
core loads what is present. An extension may import the core, never another
extension (it reaches one through ``extensions.get``/``require``).

May import: the core.
``tests/test_registry_tables.py`` (``LAYERS``) fails on any other import.
"""
