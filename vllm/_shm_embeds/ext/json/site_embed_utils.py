# SPDX-License-Identifier: Apache-2.0
"""Sites in ``vllm/renderers/embed_utils.py`` (API server): vLLM's own loader, which the JSON path calls.

Each site below says what it does, why, and what upstream change would retire it.
"""

from __future__ import annotations

from vllm._shm_embeds.sites.site import Site

RETIRE = ("a renderer hook for pre-decoded prompt_embeds (e.g. vllm#51472: upload "
          "once, reference by id)")

SITES = (
    # Called (not patched) by the JSON path on a memoryview of the body.
    Site(key="json_decode", group="json", module="vllm.renderers.embed_utils",
         qualname="safe_load_prompt_embeds",
         params=("model_config", "embed"),
         marks=("pybase64.b64decode(embed, validate=True)",),
         what="vLLM's own loader, called by the JSON path on a memoryview of the body for "
              "payloads that are not one plain tensor",
         why="the JSON path must load exactly what vLLM would",
         retire=RETIRE),
)
