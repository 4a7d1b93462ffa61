# SPDX-License-Identifier: Apache-2.0
"""Registered regions: sealed memfds a same-host producer registers over a Unix
socket, then names in request bodies (``docs/regions.md``).

``memfd.py`` (what a registered memfd must be, its mapping), ``registry.py``
(the registry, leases, per-uid limits), ``server.py`` (the registration
socket), ``sockets.py`` (the socket file, peer credentials, the start-up lock,
descriptors), ``mirror.py`` (the registry of a sibling API
server), ``service.py`` (starting and stopping them in an API server). The
request side, which knows HTTP, is ``http/region_refs.py``.

May import: base, files, lifetime, hops.

Of vLLM only ``vllm.logger``; nothing of formats, http or sites.
``tests/test_registry_tables.py`` (``LAYERS``) fails on any other import.
"""
