# SPDX-License-Identifier: Apache-2.0
"""Reading a large JSON body into memory that follows the bytes (``ext/json/json_body.py``).

:func:`read_body` copies the chunks of a body into one anonymous mapping of
its declared length, of which only the bytes that arrived plus a bounded
look-ahead are ever faulted in (by a worker thread, :func:`populate`), so a
client that declares gigabytes and stalls costs what it sent, as in stock.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import mmap
from typing import Any

from vllm._shm_embeds import extensions

_gate = extensions.require("binary", "gate")
Body, Busy = _gate.Body, _gate.Busy

LOOKAHEAD_MIN = 64 << 10  # bytes of a body buffer faulted in before they arrive: at least,
LOOKAHEAD_MAX = 16 << 20  # at most (and never more than what already arrived)


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14, <asm-generic/mman-common.h>
_libc: Any = None
_can_populate = True


def body_buffer(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of ``nbytes``: address space only.

    No page is touched (``MAP_NORESERVE``: no commit charge either), so a
    body that declares gigabytes and never sends them costs nothing here;
    :func:`populate` faults pages in as bytes come. Raises OSError (ENOMEM).
    """
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    return mmap.mmap(-1, max(1, nbytes), flags=flags)


def _address(buf: mmap.mmap) -> int:
    """The address of ``buf``'s first byte (no export of it outlives this call)."""
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def populate(address: int, start: int, stop: int) -> None:
    """Fault in the pages of bytes ``[start, stop)`` of the mapping at ``address``
    (worker thread) with ``madvise(MADV_POPULATE_WRITE)`` through ctypes,
    which releases the GIL; the bytes are left as they are, so the loop may
    write into the same pages meanwhile. Where the kernel lacks it nothing is
    done (the copy faults the pages on the loop instead)."""
    global _libc, _can_populate
    if not _can_populate:
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    first = start // page * page
    if _libc.madvise(ctypes.c_void_p(address + first), ctypes.c_size_t(stop - first),
                     _MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == errno.EINVAL:
        _can_populate = False


def _lookahead(filled: int) -> int:
    """Bytes past ``filled`` that may be faulted in before they arrive: as many as
    arrived, within ``[LOOKAHEAD_MIN, LOOKAHEAD_MAX]`` (the buffer grows
    geometrically, never by more than what the client has sent)."""
    return min(LOOKAHEAD_MAX, max(LOOKAHEAD_MIN, filled))


async def read_body(body: Body, length: int) -> mmap.mmap | bytes:
    """The whole ``body`` of ``Content-Length`` ``length``, copied piece by piece
    into a :func:`body_buffer` whose next pages a worker thread faults in
    meanwhile (:func:`populate`, at most :func:`_lookahead` past the bytes
    that arrived: memory follows the bytes, not the declared length).

    Returns ``bytes`` when no buffer could be made or the body did not match
    ``length`` (the stock app then judges it as it is); else the buffer (the
    caller closes it).
    Raises (what was read is freed first):
        gate.Busy: the in-flight cap was reached; it carries every byte read
            so far, for vLLM's own path.
        gate.Refused: 408, the body stalled or arrived too slowly (``gate.Body``).
        gate.Disconnected: the client went away.
    """
    loop = asyncio.get_running_loop()
    try:
        buf: mmap.mmap | None = body_buffer(length)
        address = _address(buf)
    except OSError:
        buf = None
    pending: asyncio.Future | None = None  # the populate in flight
    populated, filled = 0, 0
    rest: list[bytes] = []  # chunks that do not fit the buffer (or no buffer)
    try:
        while True:
            try:
                chunk = await body.piece()
            except Busy as e:  # the bytes so far, for vLLM's own path
                kept = filled - sum(map(len, rest))
                head = buf[:kept] if buf is not None else b""
                raise Busy(b"".join([head, *rest, e.received]), e.more) from None
            if chunk is None:
                break
            if buf is not None and not rest and filled + len(chunk) <= length:
                buf[filled:filled + len(chunk)] = chunk
                target = min(length, filled + len(chunk) + _lookahead(filled))
                if (pending is None or pending.done()) and \
                        populated - filled < _lookahead(filled) // 2 and target > populated:
                    start = max(populated, filled + len(chunk))
                    pending = loop.run_in_executor(None, populate, address, start, target)
                    populated = target
            else:
                rest.append(chunk)  # longer than announced: kept whole for stock
            filled += len(chunk)
        if buf is None or rest or filled != length:
            kept = filled - sum(map(len, rest))
            return (buf[:kept] if buf is not None else b"") + b"".join(rest)
        if pending is not None:
            await asyncio.wait([pending])
        result, buf = buf, None
        return result
    finally:
        if buf is not None:
            if pending is None or pending.done():
                buf.close()
            else:  # the thread finishes with the pages before they are unmapped
                pending.add_done_callback(lambda _f, b=buf: b.close())
