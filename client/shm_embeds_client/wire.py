# SPDX-License-Identifier: Apache-2.0
"""The wire constants client and server both spell; the standard library only.

The server (``vllm/_shm_embeds/``) imports these, so a spelling exists once.
Binary bodies follow KServe v2's binary-data framing; region references use
Triton's system shared-memory parameter names (docs/binary-protocol.md,
docs/regions.md).
"""

from __future__ import annotations

from typing import NamedTuple


class Datatype(NamedTuple):
    """One KServe datatype: ``size`` bytes per element; ``torch``, the name of
    its torch dtype (``getattr(torch, dt.torch)``)."""

    size: int
    torch: str


# The datatypes a prompt_embeds tensor may have, by KServe name.
DATATYPES: dict[str, Datatype] = {
    "FP32": Datatype(4, "float32"),
    "FP16": Datatype(2, "float16"),
    "BF16": Datatype(2, "bfloat16"),
}

# Binary bodies: the JSON header's length in bytes, then the tensors' bytes.
HEADER_LENGTH = "Inference-Header-Content-Length"
CONTENT_TYPE = "application/octet-stream"
JSON_CONTENT_TYPE = "application/json"  # a request naming regions is plain JSON
BINARY_DATA_SIZE = "binary_data_size"  # descriptor parameter: the tensor's bytes

# A region reference's parameters (in place of binary_data_size).
REGION = "shared_memory_region"
REGION_BYTE_SIZE = "shared_memory_byte_size"
REGION_OFFSET = "shared_memory_offset"

# The region socket (AF_UNIX, SOCK_SEQPACKET).
REGIONS_ENV = "VLLM_SHM_EMBEDS_REGIONS"  # the server's socket path
MAX_MESSAGE = 64 * 1024  # bytes of one JSON message, either way
MEMFD_NAME = "shm-embeds-region"  # the name of a producer's memfd

# Conversations (docs/conversations.md): keep a request's prompt_embeds, then
# name them as the prefix of a later request that sends only the rows after it.
KEEP_HEADER = "Shm-Embeds-Keep"  # request: keep its prompt_embeds this many seconds
KEPT_HEADER = "Shm-Embeds-Kept"  # response: the opaque id of the kept prompt_embeds
PREFIX = "shm_embeds_prefix"  # descriptor parameter: the kept rows this tensor follows
PREFIX_NOT_FOUND = "PrefixNotFound"  # error type (HTTP 404): unknown, expired or evicted
# A base64 JSON continuation: "prompt_embeds": {PREFIX: id, PREFIX_ROWS: kept rows,
# PREFIX_DATA: base64 torch.save of the new rows} (stock vLLM refuses an object there).
PREFIX_ROWS = "prefix_rows"
PREFIX_DATA = "data"
# Chat: a kept turn's embeds part k named as the data of a prompt_embeds content
# part, PART + id + "." + k (stock vLLM refuses it: not base64).
PART = "shm-embeds-part:"
