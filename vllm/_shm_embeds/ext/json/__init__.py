# SPDX-License-Identifier: Apache-2.0
"""Extension ``json``: base64 JSON ``prompt_embeds`` decoded off the event loop into segments.

``json_body.py`` (the body format), ``json_read.py`` (reading the body),
``json_strings.py`` (its long strings found, its skeleton built),
``torch_save.py`` and ``pickle_scan.py`` (a plain ``torch.save`` payload
decoded straight into a segment), ``site_embed_utils.py`` (vLLM's loader for
the rest). A body format of the ``binary`` extension.
May import: the core; of vLLM ``vllm.logger`` and ``vllm.renderers.embed_utils``.
"""

from vllm._shm_embeds.config import FLAG, Setting, getter
from vllm._shm_embeds.extensions import Extension, Group
from vllm._shm_embeds.ext.json.events import JsonEvent

JSON = Setting("VLLM_SHM_EMBEDS_JSON", FLAG, True, "flag",
    "off leaves JSON bodies to vLLM's own decode (the [JSON path](json-path.md) off; the "
    "EngineCore computes the prefix-cache digests again).")
json_on = getter(JSON)

EXTENSION = Extension(
    what="base64 JSON prompt_embeds decoded off the event loop into shared memory",
    events=JsonEvent,
    needs=("digests", "binary"),
    api=("json_body", "torch_save"),
    sites=("site_embed_utils",),
    groups={"json": Group(("hop1", "binary"), True, "shm-embeds: JSON body path off in "
                          "pid %d: %s", "base64 JSON bodies (API server)")},
    provides={"body_formats": ({
        "name": "json", "target": "json_body:JsonFormat", "group": "json", "order": 30,
        "enabled": lambda: json_on(),
        "what": "base64 JSON prompt_embeds decoded off the event loop into shared memory"},)},
    settings=(JSON,),
)
