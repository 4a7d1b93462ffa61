# SPDX-License-Identifier: Apache-2.0
"""hops: what crosses hop 1 (API server -> EngineCore) and hop 2 (EngineCore ->
workers).

``hop1.py`` (the msgpack out-of-band consumer and provider), ``hop2.py``
(externalize / internalize around the ``SchedulerOutput`` broadcast, the
ranks' agreement), ``digests.py`` (the prefix-cache digests computed once in
the API server, sent along at hop 1). The forms that cross hop 2 and their
version (``HOP2_WIRE``) are ``handle.py``'s.

May import: base, files, lifetime.

Of vLLM only ``vllm.logger`` (vLLM's protocols are duck-typed); nothing of
formats, regions, http or sites. ``tests/test_registry_tables.py``
(``LAYERS``) fails on any other import.
"""
