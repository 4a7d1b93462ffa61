# SPDX-License-Identifier: Apache-2.0
"""Registered regions (server: ``VLLM_SHM_EMBEDS_REGIONS``; docs/regions.md).

A same-host producer registers its tensors as sealed memfds over the
server's Unix socket (:class:`RegionClient`); requests then name them
(:class:`Region`, :meth:`Region.to_json`) instead of carrying the bytes.
torch only (no httpx).
"""

from __future__ import annotations

import array
import ctypes
import json
import os
import socket
import struct
import sys
import threading
import weakref
from typing import Any

import torch

from shm_embeds_client._tensors import _DATATYPES, _bytes_of, _wire
from shm_embeds_client.wire import (MAX_MESSAGE, MEMFD_NAME, REGION, REGION_BYTE_SIZE,
                                    REGION_OFFSET, REGIONS_ENV)

__all__ = ["MAX_MESSAGE", "MEMFD_NAME", "Region", "RegionClient", "RegionRefused",
           "connect_regions"]

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_WRITE_CHUNK = 1 << 30           # Linux writes at most 0x7ffff000 bytes per call
# mmap(2) flags the stdlib does not name (values of every Linux architecture).
_PROT_NONE, _MAP_FIXED, _MAP_NORESERVE = 0, 0x10, 0x4000
_libc: Any = None


class RegionRefused(RuntimeError):
    """The region server answered ``{"error": message}`` (``.message``): a
    registration it refused (not sealed, size, hidden size, uid, limits, ...)
    or an unregister of an id it does not know (any more)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Region:
    """A registered region: a sealed memfd the server holds, named by ``id``.

    Attributes:
        id: the server-generated id (an opaque string). It is a capability:
            any client of the HTTP API that has it can use the tensor as its
            prompt, so keep it out of logs (``repr`` leaves it out).
        byte_size: bytes of the tensor (``T * H * itemsize``).
        datatype: ``"FP32"``, ``"FP16"`` or ``"BF16"``.
        shape: ``(T, H)``.
        tensor: for :meth:`RegionClient.seal`, the tensor now mapped read-only
            over the sealed bytes (writing to it kills the process with
            SIGSEGV); None for :meth:`RegionClient.register`.

    Pass it as ``prompt_embeds`` to :func:`complete`/:func:`chat` (or put
    :meth:`to_json` in a request yourself). As a context manager it
    unregisters on exit.
    """

    def __init__(self, client: RegionClient, id: str, byte_size: int, datatype: str,
                 shape: tuple[int, int], tensor: torch.Tensor | None = None) -> None:
        self._client = client
        self.id = id
        self.byte_size = byte_size
        self.datatype = datatype
        self.shape = shape
        self.tensor = tensor

    def to_json(self) -> dict:
        """The reference to put where a ``prompt_embeds`` tensor goes in a plain
        JSON request (Triton's system shared-memory parameter names)."""
        return {"datatype": self.datatype, "shape": list(self.shape),
                "parameters": {REGION: self.id, REGION_BYTE_SIZE: self.byte_size,
                               REGION_OFFSET: 0}}

    @property
    def registered(self) -> bool:
        """True until unregistered here or its client's connection closed (the
        server may still have dropped it: idle TTL)."""
        return self._client._is_live(self.id)

    def unregister(self) -> None:
        """:meth:`RegionClient.unregister` of this region (no-op if it already is)."""
        self._client.unregister(self)

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        # Gone either way if the server does not know it (TTL) or closed the connection.
        try:
            self.unregister()
        except (RegionRefused, ConnectionError):
            pass

    def __repr__(self) -> str:  # never the id: whoever has it can use the region
        return (f"Region(datatype={self.datatype!r}, shape={self.shape}, "
                f"byte_size={self.byte_size}, registered={self.registered})")


class _Pending:
    """A tensor from :meth:`RegionClient.empty`, not sealed yet."""

    __slots__ = ("addr", "dtype", "fd", "nbytes", "shape")

    def __init__(self, fd: int, addr: int, nbytes: int, shape: tuple[int, int],
                 dtype: torch.dtype) -> None:
        self.fd, self.addr, self.nbytes, self.shape, self.dtype = fd, addr, nbytes, shape, dtype


def _mmap(addr: int | None, length: int, prot: int, flags: int, fd: int) -> int:
    """mmap(2) through libc (the stdlib cannot map at a fixed address)."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = libc
    got = _libc.mmap(addr, length, prot, flags, fd, 0)
    if got is None or got == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")
    return got


def _release_mapping(pending: dict, entry: _Pending) -> None:
    """Finalizer of an :meth:`RegionClient.empty` buffer (every tensor over it
    is gone): unmap it, and close its memfd if it was never sealed."""
    try:
        if pending.pop(entry.addr, None) is entry:
            os.close(entry.fd)
    finally:
        _libc.munmap(entry.addr, entry.nbytes)


def _seal(fd: int) -> None:
    """Add the seals the server requires, ``F_SEAL_SEAL`` last."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)


def _shape(shape: Any) -> tuple[int, int]:
    try:
        t, h = (int(d) for d in shape)
    except (TypeError, ValueError):
        raise ValueError(f"shape must be (num_tokens, hidden_size), got {shape!r}") from None
    if t < 1 or h < 1:
        raise ValueError(f"shape must be positive, got {(t, h)}")
    return t, h


class RegionClient:
    """One registration connection to the server's region socket.

    Regions registered over it stay registered until :meth:`unregister`, until
    the connection closes (:meth:`close`, the end of a ``with`` block, or this
    process dying: the server then unregisters them all), or until they stay
    unused for the server's idle TTL (600 s, fixed). A request already running keeps its region's memory until it ends.

    Methods are synchronous and thread-safe (one exchange at a time); each is
    one round trip of a small message, plus the copy in :meth:`register`. From
    async code, ``await asyncio.to_thread(client.register, tensor)`` for large
    tensors.

    Args:
        path: the socket path, as the server's ``VLLM_SHM_EMBEDS_REGIONS``.
        timeout: seconds to wait for the server to connect or answer (the
            server hashes a tensor for the prefix cache before it answers a
            registration); None waits forever.
        server_uid: the uid the server must run as (checked with
            ``SO_PEERCRED`` before any memfd is sent: whoever serves the socket
            gets the tensors); default this process's uid.
    Raises:
        FileNotFoundError: no socket at ``path`` (the server runs without
            ``VLLM_SHM_EMBEDS_REGIONS``, or another path).
        ConnectionRefusedError: nobody listens there (the server stopped).
        PermissionError: the socket's mode does not let this user in, or
            the process serving it is not of ``server_uid``.
    """

    def __init__(self, path: str, *, timeout: float | None = 300.0,
                 server_uid: int | None = None) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("registered regions hold little-endian bytes; this host is not")
        self.path = path
        self.timeout = timeout
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._pending: dict[int, _Pending] = {}
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            expected = os.getuid() if server_uid is None else server_uid
            _, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                     _CRED.size))
            if uid != expected:
                raise PermissionError(f"the region socket {path} is served by uid {uid}, not "
                                      f"uid {expected} (server_uid): no memfd sent")
        except BaseException:
            sock.close()
            raise
        self._sock: socket.socket | None = sock

    # -- registration -------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> Region:
        """Copy ``tensor`` into a fresh sealed memfd and register it.

        The bytes are written from the tensor's own memory (one copy, into
        the memfd; another before it only if the tensor is not on the CPU, not
        contiguous, or not FP32/FP16/BF16: other float dtypes are sent as
        FP32). This process keeps no descriptor or mapping of the memfd: its
        memory lives as long as the registration (and any request using it).

        Args:
            tensor: ``(T, H)`` floating-point tensor, ``T, H >= 1``.
        Returns:
            the :class:`Region` (``tensor`` attribute None).
        Raises:
            ValueError: not a 2-D floating-point tensor, or empty.
            RegionRefused: the server refused it (its message says why).
            ConnectionError, TimeoutError: the connection is gone (or the
                server did not answer in ``timeout``: the client is then
                closed, and every region of it unregistered).
            OSError: creating or writing the memfd failed (e.g. ENOMEM).
        """
        wire, desc = _wire(tensor)
        shape = _shape(wire.shape)
        nbytes = wire.nbytes
        self._check_open()
        fd = os.memfd_create(MEMFD_NAME, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            view = _bytes_of(wire)
            done = 0
            while done < nbytes:
                done += os.write(fd, view[done : done + _WRITE_CHUNK])
            _seal(fd)
            return self._register(fd, desc["datatype"], shape, nbytes, None)
        finally:
            os.close(fd)  # the server holds its own descriptor

    def empty(self, shape: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A writable ``(T, H)`` tensor over a fresh memfd, to fill in place.

        The tensor is a ``MAP_SHARED`` mapping of the memfd (zero-filled): what
        the producer writes into it is what the server will get, with no copy.
        Pass it to :meth:`seal` when it is complete. Dropping it unsealed
        frees the memfd.

        Args:
            shape: ``(T, H)``, both >= 1.
            dtype: ``torch.float32``, ``torch.float16`` or ``torch.bfloat16``.
        Raises:
            ValueError: another shape or dtype.
            ConnectionError: the client is closed.
            OSError: creating or mapping the memfd failed.
        """
        t, h = _shape(shape)
        if dtype not in _DATATYPES:
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        nbytes = t * h * torch.empty((), dtype=dtype).element_size()
        self._check_open()
        fd = os.memfd_create(MEMFD_NAME, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            # Allocated now, not at first touch: the server refuses a memfd with
            # holes (it would pay for the pages), and a full tmpfs fails here,
            # not as a SIGBUS while the producer fills the tensor.
            os.posix_fallocate(fd, 0, nbytes)
            import mmap

            addr = _mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd)
        except BaseException:
            os.close(fd)
            raise
        buf = (ctypes.c_ubyte * nbytes).from_address(addr)
        entry = _Pending(fd, addr, nbytes, (t, h), dtype)
        self._pending[addr] = entry
        # The tensor keeps ``buf`` alive; when the last tensor over it goes, unmap.
        weakref.finalize(buf, _release_mapping, self._pending, entry).atexit = False
        return torch.frombuffer(buf, dtype=dtype).view(t, h)

    def seal(self, tensor: torch.Tensor) -> Region:
        """Seal and register a tensor from :meth:`empty`, with no copy.

        The kernel refuses ``F_SEAL_WRITE`` while a writable shared mapping
        exists, so the writable mapping is first replaced (at the same address)
        by an inaccessible one, the memfd sealed, and the sealed bytes mapped
        back there read-only: ``tensor`` (and ``region.tensor``, the same
        tensor) then reads the registered bytes, and writing to it kills the
        process with SIGSEGV. Drop it when done: its mapping keeps the pages
        alive (they stay as long as the registration anyway).

        Args:
            tensor: the tensor :meth:`empty` returned (same shape and dtype, not
                a view of part of it), not sealed yet.
        Returns:
            the :class:`Region` (its ``tensor`` is ``tensor``).
        Raises:
            ValueError: not an unsealed tensor from this client's :meth:`empty`.
            RegionRefused: the server refused it; ``tensor`` stays read-only.
            ConnectionError, TimeoutError: as :meth:`register`.
            OSError: sealing or remapping failed (if sealing failed, ``tensor``
                is writable again and may be sealed again).
        """
        import mmap

        self._check_open()
        entry = self._pending.get(tensor.data_ptr()) if isinstance(tensor, torch.Tensor) else None
        if (entry is None or tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype
                or not tensor.is_contiguous()):
            raise ValueError("seal() takes a tensor that this client's empty() returned, "
                             "whole and not sealed yet")
        if self._pending.pop(entry.addr, None) is not entry:
            raise ValueError("this tensor is being sealed already")
        fd, addr, n = entry.fd, entry.addr, entry.nbytes
        keep = False
        try:
            # Replace the writable mapping in one step (the range stays reserved).
            _mmap(addr, n, _PROT_NONE,
                  mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE, -1)
            try:
                _seal(fd)
            except OSError:
                _mmap(addr, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd)
                keep = True
                raise
            _mmap(addr, n, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd)
            return self._register(fd, _DATATYPES[entry.dtype], entry.shape, n, tensor)
        finally:
            if keep:
                self._pending[addr] = entry
            else:
                os.close(fd)  # the server holds its own descriptor

    def unregister(self, region: Region) -> None:
        """Unregister ``region``: new requests naming it get HTTP 400; requests
        already using it finish. No-op if it is not registered any more here
        (unregistered before, or the connection closed).

        Raises:
            ValueError: ``region`` belongs to another client.
            RegionRefused: the server does not know the id (e.g. its idle TTL
                ran out); it is gone either way.
            ConnectionError, TimeoutError: as :meth:`register`.
        """
        if region._client is not self:
            raise ValueError("this region was registered by another RegionClient")
        if not self._is_live(region.id):
            return
        try:
            self._call({"op": "unregister", "region": region.id})
        finally:
            self._live.discard(region.id)

    def close(self) -> None:
        """Close the connection: the server unregisters every region of it
        (requests already using one finish). Tensors from :meth:`empty` not
        sealed yet stay usable as memory but can no longer be sealed.
        Idempotent."""
        sock = self._sock
        if sock is not None:
            try:  # wakes a thread waiting for an answer
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            self._close_locked()

    @property
    def closed(self) -> bool:
        return self._sock is None

    def __enter__(self) -> RegionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------

    def _is_live(self, rid: str) -> bool:
        return self._sock is not None and rid in self._live

    def _check_open(self) -> None:
        if self._sock is None:
            raise ConnectionError("the RegionClient is closed")

    def _close_locked(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        self._live.clear()
        for addr in list(self._pending):
            entry = self._pending.pop(addr, None)
            if entry is not None:
                os.close(entry.fd)

    def _register(self, fd: int, datatype: str, shape: tuple[int, int], nbytes: int,
                  tensor: torch.Tensor | None) -> Region:
        answer = self._call({"op": "register", "datatype": datatype, "shape": list(shape)}, fd)
        rid, size = answer.get("region"), answer.get("byte_size")
        if not isinstance(rid, str) or not rid or size != nbytes:
            self.close()  # a server that speaks another protocol: leave nothing registered
            raise RuntimeError(f"the region server's answer to a register is not "
                               f'{{"region": <id>, "byte_size": {nbytes}}}: {answer!r:.200}')
        self._live.add(rid)
        return Region(self, rid, nbytes, datatype, shape, tensor)

    def _call(self, message: dict, fd: int | None = None) -> dict:
        """Send one message (with ``fd`` attached) and return the answer object.

        Raises:
            RegionRefused: the answer is ``{"error": ...}``.
            ConnectionError, TimeoutError, RuntimeError: the exchange failed; the
                client is closed (its state with the server is unknown).
        """
        payload = json.dumps(message, separators=(",", ":")).encode()
        if len(payload) > MAX_MESSAGE:
            raise ValueError(f"message of {len(payload)} bytes; at most {MAX_MESSAGE}")
        ancillary = [] if fd is None else [
            (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
        with self._lock:
            sock = self._sock
            if sock is None:
                raise ConnectionError("the RegionClient is closed")
            try:
                sock.sendmsg([payload], ancillary)
                data = sock.recv(MAX_MESSAGE)
            except (TimeoutError, ConnectionError) as e:
                self._close_locked()
                if isinstance(e, TimeoutError):
                    raise TimeoutError(f"the region server did not answer within "
                                       f"{self.timeout} s; connection closed (its "
                                       "regions are unregistered)") from None
                raise
            except OSError:
                if self._sock is None:  # closed by close() meanwhile
                    raise ConnectionError("the RegionClient is closed") from None
                raise
            if not data:
                self._close_locked()
                raise ConnectionError("the region server closed the connection (its regions "
                                      "are unregistered)")
            try:
                answer = json.loads(data)
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                self._close_locked()
                raise RuntimeError(f"the region server's answer is not a JSON object: "
                                   f"{data[:200]!r}")
        if "error" in answer:
            raise RegionRefused(str(answer["error"]))
        return answer


def connect_regions(path: str | None = None, *, timeout: float | None = 300.0,
                    server_uid: int | None = None) -> RegionClient:
    """A :class:`RegionClient` connected to ``path`` (default: the
    ``VLLM_SHM_EMBEDS_REGIONS`` environment variable, as the server reads it).

    Raises:
        ValueError: no ``path`` and the variable is unset.
        and the errors of :class:`RegionClient`.
    """
    path = path or os.environ.get(REGIONS_ENV)
    if not path:
        raise ValueError("no region socket path (and VLLM_SHM_EMBEDS_REGIONS is unset)")
    return RegionClient(path, timeout=timeout, server_uid=server_uid)
