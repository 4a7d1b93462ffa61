# SPDX-License-Identifier: Apache-2.0
"""Registered regions in an API server: starting and stopping them.

:func:`start_regions` builds the registry (``registry.py``) for the served
model and serves it on the registration socket (``server.py``), or, when a
sibling API server (``--api-server-count`` > 1) already serves the path,
looks regions up there (``mirror.py``); either becomes
``current()`` (one of ``process.current().holders``), which the request side
(``ext/regions/region_refs.py``) leases from. :func:`stop_regions` closes them.
Digests computed at registration ride along with a sibling's answers.

Knows the regions and the process state; not vLLM and not HTTP.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from vllm._shm_embeds import extensions
from vllm._shm_embeds.ext.regions.settings import regions_group
from vllm._shm_embeds.lifetime import process

digests = extensions.require("digests", "digests")

logger = init_logger(__name__)


def _describe(tensor: Any) -> dict:
    """A sibling's lookup answer carries the region's digests (hex), if any."""
    d = digests.attached(tensor)
    if d is None:
        return {}
    return {"block_sha256": {"block": d.block_tokens, "rows": d.rows,
                             "digests": d.digests.hex()}}


def _on_mirrored(tensor: Any, answer: dict) -> None:
    """Attach the digests a sibling sent (computed there at registration)."""
    field = answer.get("block_sha256")
    try:
        d = digests.BlockDigests(int(field["block"]), int(field["rows"]),
                                 bytes.fromhex(field["digests"]))
    except (TypeError, KeyError, ValueError):
        return  # none sent: the EngineCore hashes this one
    digests.attach(tensor, d)


def _served_by_sibling(path: str) -> bool:
    """True if a sibling API server (same uid and parent) listens on ``path``
    now; False if nobody or another process does (it must never learn the
    region ids named here). One non-blocking try: never waits."""
    import socket

    from vllm._shm_embeds.files.sockets import peer_is_sibling

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.setblocking(False)
        sock.connect(path)
        return peer_is_sibling(sock)
    except OSError:
        return False
    finally:
        sock.close()


def current() -> Any:
    """This process's registry (or sibling's mirror), else None: the one of
    ``process.current().holders`` (the core hands the held files it finds
    there over at hop 1 by descriptor) that is ours."""
    return next((h for h in process.current().holders
                 if getattr(h, "holds", None) == "regions"), None)


def _install(registry: Any) -> None:
    holders = process.current().holders
    holders[:] = [h for h in holders if getattr(h, "holds", None) != "regions"]
    holders.append(registry)


def start_regions(path: str, ctx: Any) -> Any:
    """Serve registrations on ``path`` for the model of ``ctx`` (the served
    model: ``http.common.ServerContext``, or anything with its ``dtype``,
    ``hidden_size``, ``max_model_len`` and ``hash_block_tokens``); returns the
    started ``server.RegionServer``, or None when a sibling API server
    serves ``path`` (requests here then look regions up there:
    ``mirror.RegionMirror``). The registry (or the mirror) becomes
    :func:`current`. Never waits (it runs on the event loop): a
    sibling holding the start-up lock may still be starting; the mirror's
    lookups fail cleanly (400) until it serves. Raises OSError if the path
    cannot be used."""
    import errno

    from vllm._shm_embeds.ext.regions import mirror, registry, server
    from vllm._shm_embeds.files import sockets

    datatype = next((k for k, v in registry.DTYPES.items() if v == ctx.dtype), None)
    limits = registry.RegionLimits.from_config(ctx.hidden_size, ctx.max_model_len, datatype)
    block_tokens, model_dtype = ctx.hash_block_tokens, ctx.dtype

    def on_registered(tensor: Any) -> None:
        # Hashed once for the prefix cache: the seals keep these bytes as they
        # are. On the registration's own thread, not the pool requests wait on.
        if block_tokens and tensor.dtype == model_dtype:
            digests.attach(tensor, digests.hash_tensor_here(tensor, block_tokens))

    regs = registry.RegionRegistry(limits, on_registered)
    srv = server.RegionServer(path, regs, group=regions_group(), describe=_describe)
    try:
        srv.start()
    except OSError as e:
        regs.close()
        if e.errno != errno.EADDRINUSE:
            raise
        held_by_sibling = isinstance(e, sockets.LockHeld) and e.sibling
        if not held_by_sibling and not _served_by_sibling(path):
            raise OSError(errno.EADDRINUSE, "another process, not an API server of this "
                          "vllm serve, holds the regions socket", path) from None
        _install(mirror.RegionMirror(path, limits, _on_mirrored))
        logger.info("shm-embeds: registered prompt_embeds regions are served on %s by "
                    "another API server; requests here look them up there", path)
        return None
    except BaseException:
        regs.close()
        raise
    _install(regs)
    logger.info("shm-embeds: registered prompt_embeds regions served on %s (datatype %s, "
                "shape [T, %d]; uids %s, at most %d regions and %d bytes per uid, idle TTL "
                "%g s)", path, datatype, ctx.hidden_size, sorted(limits.allowed_uids),
                limits.max_regions_per_uid, limits.max_bytes_per_uid, limits.idle_ttl_s)
    return srv


def stop_regions(server: Any | None) -> None:
    """Close the socket server and the registry (regions in use by requests
    keep their memory until those end); never raises."""
    registry = current()
    if registry is not None:
        process.current().holders.remove(registry)
    try:
        if server is not None:
            server.close()
        if registry is not None:
            registry.close()
    except Exception:
        logger.exception("shm-embeds: closing the region socket failed")
