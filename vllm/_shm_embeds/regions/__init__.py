# SPDX-License-Identifier: Apache-2.0
"""Registered regions: sealed memfds a same-host producer registers over a Unix
socket, then names in request bodies (``docs/regions.md``).

``registry.py`` (the checks, the registry, leases, per-uid limits),
``server.py`` (the registration socket), ``sockets.py`` (peer credentials,
the start-up lock, descriptors), ``mirror.py`` (the registry of a sibling API
server), ``service.py`` (starting and stopping them in an API server). The
request side, which knows HTTP, is ``http/region_refs.py``.
"""
