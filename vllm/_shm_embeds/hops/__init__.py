# SPDX-License-Identifier: Apache-2.0
"""hops: what crosses hop 1 (API server -> EngineCore) and hop 2 (EngineCore -> workers).

May import: base, files, lifetime.
Of vLLM only ``vllm.logger``, its protocols duck-typed (``LAYERS`` in the tests).
"""
