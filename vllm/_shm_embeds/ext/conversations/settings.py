# SPDX-License-Identifier: Apache-2.0
"""The ``conversations`` extension's fixed limits, and their getters.

:data:`LIMITS` (its ``EXTENSION.limits``): how long and how much an API server
keeps; changed only by tests through ``config.TEST_LIMITS``.
May import: the core's ``config``.
"""

from __future__ import annotations

from vllm._shm_embeds import config
from vllm._shm_embeds.config import BYTES, COUNT, SECONDS, Setting

KEEP_MAX_S = 3600.0  # an hour: a conversation that pauses longer resends its history once
KEEP_MAX_ENTRIES = 1024  # per API server; more conversations at once evict the least recent

LIMITS: tuple[Setting, ...] = (
    Setting("KEEP_MAX_S", SECONDS, KEEP_MAX_S, "seconds",
        "the longest a request may ask its prompt_embeds to be kept (`Shm-Embeds-Keep`); "
        "longer asks are cut to it."),
    Setting("KEEP_MAX_ENTRIES", COUNT, KEEP_MAX_ENTRIES, "tensors",
        "kept tensors one API server holds at once; beyond it the least recently used "
        "one no request is reading goes."),
    Setting("KEEP_MAX_BYTES", BYTES, None, "bytes",  # the segment budget decides
        "bytes of kept tensors one API server holds at once; beyond it the least recently "
        "used go.", shown="half the segment budget (`VLLM_SHM_EMBEDS_MAX_BYTES`)"),
)

_GET = {s.field: config.getter(s) for s in LIMITS}
keep_max_s = _GET["keep_max_s"]
keep_max_entries = _GET["keep_max_entries"]


def keep_max_bytes() -> int:
    """Bytes of kept tensors one API server may hold: ``KEEP_MAX_BYTES``, else half
    the segment budget (``config.budget_bytes``)."""
    given = _GET["keep_max_bytes"]()
    return given if given is not None else config.budget_bytes() // 2
