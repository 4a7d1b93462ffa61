# SPDX-License-Identifier: Apache-2.0
"""Extension ``held``: a tensor another extension maps from a memfd of the API server (a
registered region, a kept conversation's rows) crosses hop 1 by descriptor, no copy.

``held.py`` (the sender's metadata, the EngineCore's adoption), ``events.py``.
Hop 2 carries the adopted segment like any other (``SharedTensorHandle.unnamed_data``).
May import: the core.
"""

from vllm._shm_embeds.extensions import Extension
from vllm._shm_embeds.ext.held.events import HeldEvent

EXTENSION = Extension(
    what="memfds of the API server's extensions sent at hop 1 by descriptor",
    events=HeldEvent,
    api=("held",),
)
