# SPDX-License-Identifier: Apache-2.0
"""formats: payload formats parsed without vLLM or HTTP.

``torch_save.py`` (the ``torch.save`` plain-tensor check and the direct
decode into a segment), ``pickle_scan.py`` (a ``data.pkl`` read without
unpickling it).

May import: base, hops.

hops for ``hops/digests.py``: the direct decode hashes each chunk for the
prefix cache as it writes it, into a segment that ``digests.fill_segment``
makes. Of vLLM only ``vllm.logger``; nothing of files, lifetime, regions,
http or sites. ``tests/test_registry_tables.py`` (``LAYERS``) fails on any
other import.
"""
