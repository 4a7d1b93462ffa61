# SPDX-License-Identifier: Apache-2.0
"""Extension ``binary``: request bodies read straight into shared memory.

The body gate in vLLM's app (``gate.py``, ``site_entrypoints.py``) offers each
request to the body formats (``formats.py``: binary here, and those other
extensions provide as ``body_formats``); a format writes the tensors into
segments and puts placeholders in the body (``placeholders.py``) that vLLM's
renderers resolve (``site_renderers.py``). Binary bodies: ``binary.py``,
``binary_header.py``; limits: ``body_limits.py``, ``common.py``,
``settings.py`` (its fixed limits).
May import: the core; of vLLM only ``vllm.logger`` outside its site modules.
"""

from vllm._shm_embeds.extensions import Extension, Group
from vllm._shm_embeds.ext.binary import settings
from vllm._shm_embeds.ext.binary.events import BinaryEvent

EXTENSION = Extension(
    what="binary prompt_embeds bodies, and the body gate other formats plug into",
    events=BinaryEvent,
    needs=("digests",),
    api=("gate", "placeholders", "common", "body_limits"),
    sites=("site_renderers", "site_entrypoints"),
    groups={"binary": Group(("hop1",), True, "shm-embeds: binary request bodies off in "
                            "pid %d: %s",
                            "our middlewares in vLLM's app, binary bodies, and the "
                            "placeholders every body path resolves")},
    limits=settings.LIMITS,
)
