# SPDX-License-Identifier: Apache-2.0
"""The ``digests`` extension's counted events (prefix-cache digests).

``EXTENSION.events``; ``counters.events()`` lists them with the core's
(``hash_rejected_meta`` is the core's: hop 1 counts it too).
"""

from vllm._shm_embeds.counters import EventKind


class DigestEvent(EventKind):
    """Events of the ``digests`` extension (``counters.EventKind``)."""

    HASH_API_TENSORS = ("hash_api_tensors", None, "tensors the API server hashed")
    HASH_API_BLOCKS = ("hash_api_blocks", None, "their blocks")
    HASH_SENT_TENSORS = ("hash_sent_tensors", None, "tensors sent with their digests")
    HASH_ADOPTED_TENSORS = ("hash_adopted_tensors", None,
                            "tensors whose digests the EngineCore took")
    HASH_REUSED_BLOCKS = ("hash_reused_blocks", None, "blocks whose digest was reused")
    HASH_ENGINE_BLOCKS = ("hash_engine_blocks", None, "blocks vLLM hashed itself")
    HASH_MASKED_BLOCKS = ("hash_masked_blocks", None, "blocks of a mixed prompt keyed with "
                          "their is-token-ids mask")
