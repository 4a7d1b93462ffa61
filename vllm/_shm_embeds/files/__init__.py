# SPDX-License-Identifier: Apache-2.0
"""files: segments and their files, and all file I/O on the segment directory.

``segment.py`` (create, write, map, open, rename, unlink a segment's files),
``segment_dir.py`` (what is in the segment directory, the sweep of dead
owners' segments), ``census.py`` (the bytes our segment files hold there),
``sizing.py`` (how large ``/dev/shm`` should be). Who owns a segment and when
it goes is ``lifetime/``'s.

May import: base.

(base: the modules at the package's top, ``config``, ``handle``,
``counters``, ``procfs``, ``private_dir``.) Of vLLM only ``vllm.logger``;
nothing of lifetime, hops, formats, regions, http or sites.
``tests/test_registry_tables.py`` (``LAYERS``) fails on any other import.
"""
