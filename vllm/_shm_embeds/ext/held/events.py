# SPDX-License-Identifier: Apache-2.0
"""The ``held`` extension's counted events (``EXTENSION.events``)."""

from vllm._shm_embeds.counters import EventKind


class HeldEvent(EventKind):
    """Events of the ``held`` extension (``counters.EventKind``)."""

    HOP1_REGION_TENSORS = ("hop1_region_tensors", "reused_tensors",
                           "held files (regions, kept conversations) sent at hop 1 by "
                           "descriptor")
    HOP1_REGION_BYTES = ("hop1_region_bytes", None, "their bytes")
    HOP1_REGION_ADOPTED = ("hop1_region_adopted", None, "held files the EngineCore opened")
