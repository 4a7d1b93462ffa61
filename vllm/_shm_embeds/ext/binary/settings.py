# SPDX-License-Identifier: Apache-2.0
"""The ``binary`` extension's fixed limits on untrusted bodies, and their getters.

:data:`LIMITS` (its ``EXTENSION.limits``): a body's timeout and minimum rate, the
bytes of bodies in flight, a binary body's tensor bytes and tensors; changed only by
tests through ``config.TEST_LIMITS``. :func:`body_deadline_s`,
:func:`inflight_bytes` and :func:`binary_max_bytes` derive the values in use.
May import: the core's ``config`` (and pydantic).
"""

from __future__ import annotations

from typing import Annotated

import pydantic

from vllm._shm_embeds import config
from vllm._shm_embeds.config import COUNT, SECONDS, Kind, Setting

MIN_INFLIGHT_BYTES = 1 << 30  # the default in-flight cap is never below this
BODY_TIMEOUT_S = 30.0  # a body that sends no byte for 30 s is stalled on any network
BODY_MIN_RATE = 1 << 20  # 1 MiB/s on average after that grace: any working link is faster
BINARY_MAX_TENSORS = 256  # far more prompts than one request has; bounds the header's parse

RATE = Kind(COUNT.adapter, "a positive byte rate")
BYTES_OR_MODEL = Kind(pydantic.TypeAdapter(Annotated[  # 0: the model's default (None)
    int, pydantic.Field(ge=0, strict=False), pydantic.AfterValidator(lambda v: v or None)]),
    "a byte count")

LIMITS: tuple[Setting, ...] = (
    Setting("BODY_TIMEOUT_S", SECONDS, BODY_TIMEOUT_S, "seconds",
        "a binary or large JSON request body that sends no bytes for this many seconds gets HTTP "
        "408, and what it held is freed at once."),
    Setting("BODY_MIN_RATE", RATE, BODY_MIN_RATE, "bytes/s",
        "bytes per second a binary or large JSON body must average: a body of `n` bytes that has "
        "not fully arrived after `BODY_TIMEOUT_S + n / BODY_MIN_RATE` seconds gets HTTP 408 (a "
        "client trickling a byte now and then cannot hold a request open forever)."),
    Setting("INFLIGHT_BYTES", config.BYTES, None, "bytes",  # the budget decides
        "bytes of the large JSON bodies the API server's JSON path holds at once, charged as "
        "they arrive (never by `Content-Length`); a body that reaches the cap goes to vLLM with "
        "every byte (the stock path, counted `json_fallback.busy`). JSON bodies larger than the "
        "base64 of `BINARY_MAX_BYTES` plus 1 MiB always take the stock path "
        "(`json_fallback.too_large`), and with `--enable-prompt-embeds` off no body takes our "
        "paths. A binary body's JSON header counts here too, as it arrives, until the body has "
        "arrived; one that finds or reaches the cap gets HTTP 503.",
        shown="the segment budget (`VLLM_SHM_EMBEDS_MAX_BYTES`), at least "
              f"{MIN_INFLIGHT_BYTES >> 30} GiB"),
    Setting("BINARY_MAX_BYTES", BYTES_OR_MODEL, None, "bytes",  # the model decides
        "largest tensor bytes one binary body may carry; above it the request gets a 413 before "
        "its tensor bytes are read. `0` means the default.",
        shown="`--max-model-len` x hidden size x 4"),
    Setting("BINARY_MAX_TENSORS", COUNT, BINARY_MAX_TENSORS, "tensors",
        "tensors (`prompt_embeds` descriptors) one binary body may carry; more get HTTP 400 "
        "(`binary_rejected.too_many`) before any is read."),
)

_GET = {limit.field: config.getter(limit) for limit in LIMITS}
body_timeout_s = _GET["body_timeout_s"]
binary_max_tensors = _GET["binary_max_tensors"]


def body_deadline_s(nbytes: int) -> float:
    """Seconds a body of ``nbytes`` may take in all before it gets 408:
    ``BODY_TIMEOUT_S + nbytes / BODY_MIN_RATE``."""
    return body_timeout_s() + max(0, nbytes) / _GET["body_min_rate"]()


def inflight_bytes() -> int:
    """Cap (bytes) on the JSON bodies the API server's body paths take at once:
    ``config.budget_bytes()``, at least :data:`MIN_INFLIGHT_BYTES` (the
    ``INFLIGHT_BYTES`` limit, unless ``config.TEST_LIMITS`` sets it)."""
    cap = _GET["inflight_bytes"]()
    return cap if cap is not None else max(MIN_INFLIGHT_BYTES, config.budget_bytes())


def binary_max_bytes(max_model_len: int, hidden_size: int) -> int:
    """Cap (bytes) on one binary body's tensors: ``max_model_len * hidden_size * 4``
    (the ``BINARY_MAX_BYTES`` limit, unless ``config.TEST_LIMITS`` sets it)."""
    return _GET["binary_max_bytes"]() or max_model_len * hidden_size * 4
