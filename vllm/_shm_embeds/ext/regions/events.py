# SPDX-License-Identifier: Apache-2.0
"""The ``regions`` extension's counted events (registered regions).

``EXTENSION.events``; ``counters.events()`` lists them with the core's.
"""

from vllm._shm_embeds.counters import EventKind


class RegionEvent(EventKind):
    """Events of the ``regions`` extension (``counters.EventKind``)."""

    REGIONS_REGISTERED = ("regions_registered", "regions_registered", "regions registered")
    REGION_BYTES = ("region_bytes", "region_bytes", "their bytes")
    REGION_LEASES = ("region_leases", "region_leases", "uses of regions by requests")
    REGION_LOOKUPS = ("region_lookups", "region_lookups",
                      "regions looked up at the sibling API server")
    REGION_LOOKUP_TRIMMED = ("region_lookup_trimmed", "region_lookup_trimmed",
                             "lookup answers sent without digests")
    REGIONS_FREED = ("regions_freed", "regions_freed", "regions whose memory was let go")
    REGION_REQUESTS = ("region_requests", None, "requests that referenced regions")
    REGION_TENSORS = ("region_tensors", None, "their region references")
    REGION_UNREGISTERED = ("region_unregistered", "region_unregistered",
                           "regions unregistered", ("reason",))
    REGION_REFUSED = ("region_refused", "region_refused",
                      "registrations and references refused", ("reason",))
    REGION_LEASE_REFUSED = ("region_lease_refused", "region_lease_refused",
                            "references that matched no registration", ("reason",))
