# SPDX-License-Identifier: Apache-2.0
"""The API server's HTTP side: binary and base64 JSON ``prompt_embeds`` bodies
into shared memory, and ``/metrics``. Only this package knows HTTP.

May import: base, files, lifetime, hops, formats, regions.

Of vLLM ``vllm.logger``, and ``vllm.renderers.embed_utils`` (the JSON path
hands a payload that the direct decode does not take to vLLM's own
``safe_load_prompt_embeds``); nothing of sites.
``tests/test_registry_tables.py`` (``LAYERS``) fails on any other import.
"""
