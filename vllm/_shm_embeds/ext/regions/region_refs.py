# SPDX-License-Identifier: Apache-2.0
"""Registered regions in the API server's requests: references in request bodies.

With ``VLLM_SHM_EMBEDS_REGIONS=<path>``, same-host producers register sealed memfds
holding ``prompt_embeds`` tensors over a Unix socket (``regions/``; protocol in
``docs/regions.md``), and a plain JSON body names a region, with Triton's parameter
names, wherever a ``prompt_embeds`` tensor can appear. :class:`RegionRefsFormat` (a
body format of the one body gate, ``gate.BodyGate``) starts the registry and socket
server at the app's ``lifespan`` start-up (``ext/regions/service.py``), leases each
region a request names (``RegionRegistry.lease``) and puts a placeholder there that
resolves, in this request's context only, to the region's read-only tensor; hop 1
then sends the memfd's descriptor instead of the bytes.

Knows HTTP and the registry; no vLLM class.
Design notes: docs/design.md, "Module notes".
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from shm_embeds_client.wire import JSON_CONTENT_TYPE, REGION, REGION_BYTE_SIZE, REGION_OFFSET
from vllm.logger import init_logger

from vllm._shm_embeds import extensions
from vllm._shm_embeds.counters import count_many, count_reason
from vllm._shm_embeds.ext.regions.events import RegionEvent
from vllm._shm_embeds.ext.regions.registry import RegionError
from vllm._shm_embeds.ext.regions.service import current, start_regions, stop_regions
from vllm._shm_embeds.ext.regions.settings import regions_path, regions_refs_max

_body_limits = extensions.require("binary", "body_limits")
byte_count = _body_limits.byte_count
_common = extensions.require("binary", "common")
ServerContext, content_type, embeds_slots = _common.ServerContext, _common.content_type, _common.embeds_slots
_gate = extensions.require("binary", "gate")
Body, Claim, Outcome, Refused = _gate.Body, _gate.Claim, _gate.Outcome, _gate.Refused
_placeholders = extensions.require("binary", "placeholders")
Upload, new_token, placeholder = _placeholders.Upload, _placeholders.new_token, _placeholders.placeholder

logger = init_logger(__name__)

REF_KEY = f'"{REGION}"'.encode()
JSON_TYPE = JSON_CONTENT_TYPE.encode()  # the bodies that may name regions
MAX_BODY_BYTES = 1 << 20  # larger bodies are not searched for region references


def _region_ref(value: Any) -> dict | None:
    """``value``'s ``parameters`` if it is a region reference, else None."""
    if not isinstance(value, dict):
        return None
    params = value.get("parameters")
    if isinstance(params, dict) and REGION in params:
        return params
    return None


def lease_refs(path: str, body: Any, registry: Any) -> Upload | None:
    """Replace each region reference in ``body`` (in place) by a placeholder.

    Returns the request's :class:`~vllm._shm_embeds.ext.binary.placeholders.Upload`
    (its tensors are the regions', its leases end with it), or None when the
    body names no region.

    Raises:
        regions.RegionError: a reference that does not match a registration,
            more than ``settings.REGIONS_REFS_MAX`` references (``refs``),
            or the server's leases are all in use (``leases``) (client-safe
            message; the leases taken so far are released).
    """
    token, tensors, leases = new_token(), [], []
    slots = [(where, container, key) for where, container, key in embeds_slots(path, body)
             if isinstance(container, list) or key in container]
    refs = [s for s in slots if _region_ref(s[1][s[2]]) is not None]
    if refs and len(refs) != len(slots):
        # A base64 tensor beside them would go through the JSON path, whose
        # placeholders would then hide ours: refuse clearly instead.
        raise RegionError("a request that names registered regions cannot also carry "
                          "other prompt_embeds", "mixed")
    if len(refs) > (most := regions_refs_max()):
        raise RegionError(f"names {len(refs)} registered regions; at most {most} per "
                          "request", "refs")
    try:
        for where, container, key in refs:
            ref = container[key]
            params = _region_ref(ref)
            try:
                lease = registry.lease(params.get(REGION),
                                       ref.get("datatype"), ref.get("shape"),
                                       params.get(REGION_BYTE_SIZE),
                                       params.get(REGION_OFFSET, 0))
            except RegionError as e:
                raise RegionError(f"{where}: {e}", e.reason) from None
            leases.append(lease)
            container[key] = placeholder(token, len(tensors))
            tensors.append(lease.tensor)
    except BaseException:
        for lease in leases:
            lease.release()
        raise
    if not leases:
        return None
    return Upload(token, tensors, leases=leases)


async def _lease(path: str, body: Any, registry: Any) -> Upload | None:
    """:func:`lease_refs`; off the event loop when the registry is a sibling's
    (``ext/regions/mirror.py``: a socket round trip per region). Leases taken by a
    lookup whose request was cancelled meanwhile are released."""
    if not getattr(registry, "remote", False):
        return lease_refs(path, body, registry)  # in-process: a dict lookup
    fut = asyncio.get_running_loop().run_in_executor(None, lease_refs, path, body, registry)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(_release_late)
        raise


def _release_late(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is None and fut.result() is not None:
        fut.result().release()


class RegionRefsFormat:
    """Region references in small JSON bodies (``gate.BodyFormat``; see the
    module doc), and the region socket's lifetime (the app's lifespan)."""

    name = "regions"

    def __init__(self) -> None:
        self.server: Any = None

    def claim(self, path: str, h: Any, ctx: ServerContext | None) -> Claim | None:
        """A JSON body of at most :data:`MAX_BODY_BYTES` while regions are
        served. Not charged to the in-flight cap: most such bodies are
        ordinary small requests, which stock takes whatever the cap."""
        if current() is None or content_type(h) != JSON_TYPE:
            return None
        length = byte_count(h.get("content-length"))
        if length is None or length > MAX_BODY_BYTES:
            return None
        return Claim(length=length)

    async def prepare(self, path: str, body: Body, ctx: ServerContext | None,
                      claim: Claim) -> Outcome:
        """Lease every region the body names; a body that names none is
        offered on as it came."""
        raw = await body.rest(MAX_BODY_BYTES)
        registry = current()
        parsed = None
        if REF_KEY in raw and registry is not None:
            try:
                parsed = json.loads(raw)
            except (ValueError, RecursionError):
                parsed = None  # vLLM answers a body that is not JSON (or nests too deep)
        if parsed is None:
            return Outcome(raw, offer_on=True)
        try:
            upload = await _lease(path, parsed, registry)
        except RegionError as e:  # leases all in use: the server's, not the request's fault
            raise Refused(429 if e.reason == "leases" else 400, "reference",
                          f"prompt_embeds region reference {e}") from None
        if upload is None:
            return Outcome(raw, offer_on=True)
        upload.hash_block_tokens = getattr(ctx, "hash_block_tokens", None)
        count_many({RegionEvent.REGION_REQUESTS: 1, RegionEvent.REGION_TENSORS: len(upload.leases)})
        return Outcome(json.dumps(parsed).encode(), upload)

    def counted(self, reason: str) -> None:
        if reason == "reference":
            count_reason(RegionEvent.REGION_REFUSED, "reference")

    def startup(self, scope: dict) -> None:
        """Start the registry and the socket server; never raises."""
        path = regions_path()
        if not path or self.server is not None:
            return
        try:
            ctx = ServerContext.of_app(scope)
            if ctx is None:
                raise RuntimeError("the app has no vllm_config")
            if not ctx.enable_prompt_embeds:
                logger.warning("shm-embeds: VLLM_SHM_EMBEDS_REGIONS is set but "
                               "--enable-prompt-embeds is not: registered regions are off")
                return
            self.server = start_regions(path, ctx)
        except Exception:
            logger.exception("shm-embeds: registered regions not served")

    def shutdown(self) -> None:
        server, self.server = self.server, None
        if server is not None or current() is not None:
            stop_regions(server)
