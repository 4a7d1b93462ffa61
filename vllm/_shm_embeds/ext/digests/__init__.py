# SPDX-License-Identifier: Apache-2.0
"""Extension ``digests``: streamed segments, and prefix-cache block digests computed
in the API server.

``streamed.py`` writes a request body into a segment as it arrives (the body
formats' sink; the core hands it over at hop 1 without a copy). ``digests.py``
hashes ``prompt_embeds`` blocks as the bytes are written (or on a pool) and carries
them over hop 1; ``site_kv_cache_utils.py`` lets the EngineCore use them instead of
hashing again. Without it the body formats are off and the EngineCore hashes as
stock vLLM does.
May import: the core.
"""

from vllm._shm_embeds.extensions import Extension, Group
from vllm._shm_embeds.ext.digests.events import DigestEvent

EXTENSION = Extension(
    what="streamed segments, and prefix-cache digests of prompt_embeds computed in the API server",
    events=DigestEvent,
    api=("digests", "streamed"),
    sites=("site_kv_cache_utils",),
    groups={"digests": Group(("hop1",), False, "shm-embeds: API-server prefix-cache "
                             "digests off in pid %d (the EngineCore hashes): %s",
                             "the API server's prefix-cache digests, used by the EngineCore")},
)
