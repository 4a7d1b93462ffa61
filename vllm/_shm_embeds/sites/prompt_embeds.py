# SPDX-License-Identifier: Apache-2.0
"""Site in ``vllm/v1/worker/gpu/model_states/prompt_embeds.py`` (the newer model runner,
"V2"): later pipeline stages do not upload ``prompt_embeds`` (group ``pp_upload``).
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

from vllm.logger import init_logger

from vllm._shm_embeds.sites.site import Site, apply_again

logger = init_logger(__name__)

MODULE = "vllm.v1.worker.gpu.model_states.prompt_embeds"
_RETIRE = ("vLLM skipping the upload on non-first PP ranks itself (or stripping "
           "prompt_embeds for them, as the legacy Ray path does with mm_features)")
_decided = False


def first_pp_stage() -> bool:
    """``get_pp_group().is_first_rank`` (``parallel_state.py`` 0.32/0.33), else True."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return bool(get_pp_group().is_first_rank)
    except Exception:
        return True


def wanted() -> bool:
    """The group is considered only where the newer runner's module is loaded."""
    return MODULE in sys.modules


def maybe_patch() -> None:
    """Decide the ``pp_upload`` group once its vLLM module is imported (worker)."""
    global _decided
    if _decided or MODULE not in sys.modules:
        return
    _decided = True
    apply_again()


def wrap_add_request(orig: Callable) -> Callable:
    def add_request(self, req_index, new_req_data, *args, **kwargs):
        data = new_req_data
        try:
            if getattr(data, "prompt_embeds", None) is not None and not first_pp_stage():
                data = copy.copy(new_req_data)
                data.prompt_embeds = None
        except Exception:  # never into vLLM's worker: upload as stock does
            logger.debug("shm-embeds: add_request left stock", exc_info=True)
            data = new_req_data
        return orig(self, req_index, data, *args, **kwargs)

    return add_request


SITES = (
    Site(key="v2_embeds_upload", group="pp_upload", module=MODULE,
         qualname="PromptEmbedsState.add_request",
         params=("req_index", "new_req_data"),
         marks=("if prompt_embeds is None:", "self.embeds_lens.np[req_index] = 0",
                "async_tensor_h2d(prompt_embeds"),
         wrap=wrap_add_request,
         what="on a later pipeline stage, vLLM's add_request gets a copy of the request "
              "without prompt_embeds: nothing staged, uploaded or held on the GPU; "
              "embeds_lens is 0 for the index",
         why="add_request uploads the whole tensor on every rank and holds it for the "
             "request's life (about 400 MB for 24k tokens at hidden 8192 bf16), but apply "
             "runs only on the first PP rank (checked by v2_embeds_first_rank)",
         retire=_RETIRE),
    Site(key="v2_embeds_first_rank", group="pp_upload", module="vllm.v1.worker.gpu.model_runner",
         qualname="GPUModelRunner.execute_model",
         marks=("if self.uses_inputs_embeds and self.is_first_pp_rank:",
                'model_inputs["inputs_embeds"] = None'),
         what="relied on: the newer runner prepares inputs_embeds (PromptEmbedsState.apply) "
              "on the first PP rank only, and passes none on later ranks",
         why="what makes skipping the upload on later ranks safe",
         retire=_RETIRE),
)
