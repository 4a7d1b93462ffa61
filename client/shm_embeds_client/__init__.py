# SPDX-License-Identifier: Apache-2.0
"""One-line client for binary ``prompt_embeds`` bodies.

A vLLM OpenAI server with the shm-embeds plugin (``VLLM_SHM_EMBEDS=1``,
``--enable-prompt-embeds``) accepts the tensor as raw bytes after the JSON
request (KServe v2 binary-data framing) instead of base64 of ``torch.save``::

    import shm_embeds_client as sec
    out = sec.complete("http://localhost:8000", "my-model", embeds, max_tokens=16)
    out = sec.chat("http://localhost:8000", "my-model", embeds, max_tokens=16)
    out = await sec.acomplete(...)   # and sec.achat(...)

``embeds`` is a ``(num_tokens, hidden_size)`` CPU tensor of float32, float16
or bfloat16 (other float dtypes are sent as float32); a list of tensors is a
batch for ``complete``. Its bytes are sent from the tensor's own memory (no
copy unless it is not contiguous). Every other keyword is the usual request
field (``max_tokens``, ``temperature``, ``logprobs``, ``n``, ``cache_salt``,
``stream``, ...). The result is the response JSON; with ``stream=True`` the
list of streamed chunk objects.

The same with ``curl`` (a 5 x 4096 float32 tensor in ``embeds.bin``, i.e.
81920 raw little-endian bytes; the JSON is 120 bytes here, count yours)::

    printf '%s' '{"model":"m","max_tokens":8,"prompt_embeds":{"datatype":"FP32",'\
    '"shape":[5,4096],"parameters":{"binary_data_size":81920}}}' > header.json
    cat header.json embeds.bin > body.bin
    curl http://localhost:8000/v1/completions \\
      -H 'Content-Type: application/octet-stream' \\
      -H "Inference-Header-Content-Length: $(stat -c %s header.json)" \\
      --data-binary @body.bin

Same-host producers can instead register their tensors once as sealed memfds
with the server (``VLLM_SHM_EMBEDS_REGIONS=<socket path>`` on the server) and
send plain JSON requests that reference them: no byte of the tensor is copied
by the server or sent over HTTP (``docs/regions.md``)::

    with sec.connect_regions("/run/vllm/regions.sock") as rc:
        region = rc.register(embeds)          # one copy, into the memfd
        out = sec.complete("http://localhost:8000", "my-model", region, max_tokens=16)

        t = rc.empty((num_tokens, hidden_size))   # or fill the memfd in place:
        produce_into(t)                           # zero copies
        with rc.seal(t) as region2:               # unregistered on exit
            out = sec.chat("http://localhost:8000", "my-model", region2, max_tokens=16)

A conversation sends only each turn's new rows: the server keeps a
request's ``prompt_embeds`` for ``ttl_s`` seconds (``Shm-Embeds-Keep``) and
the next request names them as its prefix (``sec.Continuation``); a server
without the feature, or a kept prefix expired or evicted, costs one resend
of the whole history (``conversation.py``, ``docs/conversations.md``)::

    conv = sec.Conversation("http://localhost:8000", "my-model", ttl_s=600)
    out = conv.complete(turn1, max_tokens=16)   # the whole tensor, kept
    out = conv.complete(turn2, max_tokens=16)   # only turn2's rows after it
    branch = conv.fork()                        # another turn from the same prefix
    conv.close()                                # its connections (or: with sec.Conversation(...))
    out = await sec.AsyncConversation(...).acomplete(turn1, max_tokens=16)

A chat keeps its embeds parts the same way (``chat_conversation.py``)::

    chat = sec.ChatConversation("http://localhost:8000", "my-model", ttl_s=600)
    out = chat.send(turn1_embeds, max_tokens=16)     # the part sent, kept
    out = chat.send(turn2_embeds, max_tokens=16)     # turn 1's part by id, turn 2's sent

Calls reuse their connections (``pool.py``): the one-shot helpers share one
``httpx`` client per process, a conversation keeps one of its own for its turns.

For a client that must keep the OpenAI JSON wire format (a server without
the plugin): ``sec.complete_openai_json(...)`` and ``sec.chat_openai_json``
(async: ``acomplete_openai_json``, ``achat_openai_json``) send base64 of
``torch.save`` as vLLM reads it, in a body built by ``sec.openai_json_body``
with each byte written once (``openai_json.py``)::

    out = sec.complete_openai_json("http://localhost:8000", "my-model", embeds,
                                   max_tokens=16)
    body = sec.openai_json_body("my-model", embeds, max_tokens=16)   # a bytearray

Install it alone (no vLLM) with ``pip install ./client`` from a checkout of
the repository. It needs ``httpx`` and ``torch`` (the tensors are torch
tensors, sent from their own memory; numpy is not needed). The package is
split by transport: ``http`` (sync), ``aio`` (async), ``regions``,
``conversation``, and ``wire`` (the constants both sides spell; the standard
library only). The names here import their submodule on first use, so
``import shm_embeds_client.wire`` needs neither torch nor httpx.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AsyncConversation", "ChatConversation", "Continuation", "Conversation", "KeptPart",
           "Region", "RegionClient", "RegionRefused", "achat", "achat_openai_json",
           "acomplete", "acomplete_openai_json", "chat", "chat_openai_json", "complete",
           "complete_openai_json", "connect_regions", "frame", "openai_json_body"]

# Public name -> the submodule that defines it (imported on first use, PEP 562).
_SUBMODULE = {
    "complete": "http", "chat": "http",
    "acomplete": "aio", "achat": "aio",
    "frame": "_framing", "Continuation": "_framing", "KeptPart": "_framing",
    "ChatConversation": "chat_conversation",
    "Conversation": "conversation", "AsyncConversation": "conversation",
    "complete_openai_json": "http", "chat_openai_json": "http",
    "acomplete_openai_json": "aio", "achat_openai_json": "aio",
    "openai_json_body": "openai_json",
    "Region": "regions", "RegionClient": "regions", "RegionRefused": "regions",
    "connect_regions": "regions", "MAX_MESSAGE": "regions", "MEMFD_NAME": "regions",
}


def __getattr__(name: str) -> Any:
    sub = _SUBMODULE.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{sub}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULE})
