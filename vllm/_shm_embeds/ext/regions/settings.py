# SPDX-License-Identifier: Apache-2.0
"""The ``regions`` extension's variables and fixed limits, and their getters.

:data:`SETTINGS` (its ``EXTENSION.settings``): the socket path, its group, the uids
that may register; :data:`LIMITS` (``EXTENSION.limits``): per-uid regions and bytes,
their lifetimes, per-request references and the server's leases, changed only by
tests through ``config.TEST_LIMITS``.
May import: the core's ``config`` (and pydantic).
"""

from __future__ import annotations

import os
from typing import Annotated

import pydantic

from vllm._shm_embeds import config
from vllm._shm_embeds.config import COUNT, NAME, SECONDS, Kind, Setting

REGIONS_MAX = 64  # per uid: producers register a few large tensors, more is a leak
REGIONS_MAX_BYTES = 16 << 30  # per uid: the producer's own memory; this only bounds a leak
REGIONS_TTL_S = 600.0  # 10 min unnamed: outlives any request; the producer can register again
REGIONS_IDLE_S = 60.0  # a connection holding no region has a minute to register one
REGIONS_REFS_MAX = 64  # per request, as many as a uid may register (2 fds, 2 maps each)
REGIONS_LEASES_MAX = 1024  # per API server, freed as responses start: only a flood meets it

POSITIVE_BYTES = Kind(COUNT.adapter, "a positive byte count")
UIDS = Kind(pydantic.TypeAdapter(Annotated[
    tuple[Annotated[int, pydantic.Field(ge=0)], ...],
    pydantic.BeforeValidator(
        lambda v: [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v),
]), "a comma-separated list of uids")

SETTINGS: tuple[Setting, ...] = (
    Setting("VLLM_SHM_EMBEDS_REGIONS", NAME, None, "path",
        "path of a Unix socket (`SOCK_SEQPACKET`) on which same-host producers register sealed "
        "memfds holding `prompt_embeds`; requests then name them by region id. Start-up fails if "
        "the path exists and is not a socket; a stale socket is replaced.",
        shown="unset (off)"),
    Setting("VLLM_SHM_EMBEDS_REGIONS_GROUP", NAME, None, "group",
        "a group name: the socket file gets that group and mode 0660 (unset: mode 0600, the "
        "server's user only)."),
    Setting("VLLM_SHM_EMBEDS_REGIONS_UIDS", UIDS, (), "uids",
        "comma-separated uids that may register regions besides the server's own (checked with "
        "`SO_PEERCRED`), e.g. `1001,1002`."),
)

LIMITS: tuple[Setting, ...] = (
    Setting("REGIONS_MAX", COUNT, REGIONS_MAX, "regions",
        "regions one uid may hold at once (an unregistered region still used by a request counts "
        "until that request ends)."),
    Setting("REGIONS_MAX_BYTES", POSITIVE_BYTES, REGIONS_MAX_BYTES, "bytes",
        "bytes one uid's regions may hold at once (counted the same way)."),
    Setting("REGIONS_TTL_S", SECONDS, REGIONS_TTL_S, "seconds",
        "a region no request has used for this many seconds is unregistered (its producer's "
        "connection staying open does not keep it)."),
    Setting("REGIONS_IDLE_S", SECONDS, REGIONS_IDLE_S, "seconds",
        "a producer connection that holds no registered region and sent nothing for this many "
        "seconds is closed."),
    Setting("REGIONS_REFS_MAX", COUNT, REGIONS_REFS_MAX, "references",
        "region references one request may make; more get 400."),
    Setting("REGIONS_LEASES_MAX", COUNT, REGIONS_LEASES_MAX, "references",
        "region references of requests in flight one API server may hold until their "
        "response starts (a slow reader holds none); more get 429."),
)

_GET = {s.field: config.getter(s) for s in SETTINGS + LIMITS}
regions_path = _GET["regions"]
regions_group = _GET["regions_group"]
regions_max = _GET["regions_max"]
regions_max_bytes = _GET["regions_max_bytes"]
regions_ttl_s = _GET["regions_ttl_s"]
regions_idle_s = _GET["regions_idle_s"]
regions_refs_max = _GET["regions_refs_max"]
regions_leases_max = _GET["regions_leases_max"]


def regions_allowed_uids() -> frozenset[int]:
    """Uids that may register regions: this process's and ``VLLM_SHM_EMBEDS_REGIONS_UIDS``."""
    return frozenset((os.getuid(), *_GET["regions_uids"]()))
