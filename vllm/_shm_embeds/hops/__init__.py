# SPDX-License-Identifier: Apache-2.0
"""hops: what crosses hop 1 (API server -> EngineCore) and hop 2 (EngineCore -> workers).

``hop1.py`` (the msgpack out-of-band consumer and provider), ``hop2.py`` (externalize /
internalize around the ``SchedulerOutput`` broadcast, the ranks' agreement). The forms
that cross hop 2 and their version (``HOP2_WIRE``) are ``handle.py``'s.

May import: base, files, lifetime.

Of vLLM only ``vllm.logger``, its protocols duck-typed (``LAYERS`` in the tests).
"""
