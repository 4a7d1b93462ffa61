# SPDX-License-Identifier: Apache-2.0
"""Extension ``json``: base64 JSON ``prompt_embeds`` decoded off the event loop into segments.

``json_body.py`` (the body format), ``json_read.py`` (reading the body),
``torch_save.py`` and ``pickle_scan.py`` (a plain ``torch.save`` payload
decoded straight into a segment), ``site_embed_utils.py`` (vLLM's loader for
the rest). A body format of the ``binary`` extension.
May import: the core; of vLLM ``vllm.logger`` and ``vllm.renderers.embed_utils``.
"""

from vllm._shm_embeds import config
from vllm._shm_embeds.extensions import Extension, Group

EXTENSION = Extension(
    what="base64 JSON prompt_embeds decoded off the event loop into shared memory",
    needs=("digests", "binary"),
    api=("json_body", "torch_save"),
    sites=("site_embed_utils",),
    groups={"json": Group(("hop1", "binary"), True, "shm-embeds: JSON body path off in "
                          "pid %d: %s", "base64 JSON bodies (API server)")},
    provides={"body_formats": ({
        "name": "json", "target": "json_body:JsonFormat", "group": "json", "order": 30,
        "enabled": lambda: config.settings().json,
        "what": "base64 JSON prompt_embeds decoded off the event loop into shared memory"},)},
)
