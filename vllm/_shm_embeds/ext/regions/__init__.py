# SPDX-License-Identifier: Apache-2.0
"""Extension ``regions``: sealed memfds a same-host producer registers, then names in bodies.

``memfd.py`` (what a registered memfd must be), ``registry.py`` (registry,
leases, per-uid limits), ``server.py`` (the registration socket: its
connections and thread), ``operations.py`` (what each message does; the
socket plumbing is the core's ``files/sockets.py``), ``mirror.py`` (a
sibling API server's registry), ``service.py`` (start and stop),
``region_refs.py`` (the body format), ``settings.py`` (its variables and
limits). ``docs/regions.md``.
May import: the core; of vLLM only ``vllm.logger``.
"""

from vllm._shm_embeds.extensions import Extension, Group
from vllm._shm_embeds.ext.regions import settings
from vllm._shm_embeds.ext.regions.events import RegionEvent

EXTENSION = Extension(
    what="registered regions (VLLM_SHM_EMBEDS_REGIONS)",
    events=RegionEvent,
    needs=("digests", "binary"),
    api=("registry", "service"),
    groups={"regions": Group(("hop1", "binary"), True,
                             "shm-embeds: registered regions off in pid %d: %s",
                             "registered regions, when VLLM_SHM_EMBEDS_REGIONS is set; no "
                             "vLLM site of its own", lambda: bool(settings.regions_path()))},
    # Before the JSON format: a small JSON body that names no region is offered on.
    provides={"body_formats": ({
        "name": "regions", "target": "region_refs:RegionRefsFormat", "group": "regions",
        "order": 20, "enabled": lambda: bool(settings.regions_path()),
        "what": "registered regions named in JSON bodies (VLLM_SHM_EMBEDS_REGIONS)"},)},
    settings=settings.SETTINGS,
    limits=settings.LIMITS,
)
