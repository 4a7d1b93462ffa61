# SPDX-License-Identifier: Apache-2.0
"""Where the time goes when a tensor enters or leaves a segment (variant timings).

Nothing here is used by the plugin; it informs the benchmark report (the
shipped ``pwrite`` writer was chosen from these numbers). One
tensor of ``--mib`` MiB; every figure is the median of ``--repeats`` runs, in
milliseconds; variants are interleaved per repeat so machine noise hits them
alike.

Writer side (warm private tensor -> new file in ``/dev/shm``; hop 1's
``share_tensor`` and hop 2's ``externalize`` of a private tensor):

* ``share_tensor``          the plugin as shipped: open, ``os.pwrite`` of the
                            header page and then the tensor (no ``ftruncate`` or
                            ``fallocate``, no mapping): one kernel copy, no user
                            page faults; a full tmpfs gives ``ENOSPC`` from the
                            write, not a SIGBUS
* ``fallocate``             ``posix_fallocate`` alone (tmpfs allocates and
                            zero-fills every page)
* ``ftrunc+pwritev``        ``ftruncate`` + ``os.pwritev`` from the tensor
* ``falloc+pwritev``        the same after ``posix_fallocate``
* ``falloc+POPULATE_WRITE`` fallocate, mmap, ``madvise(MADV_POPULATE_WRITE)``,
                            then ``copy_`` (prefaulted mapping)

Reader side (mapped segment -> fresh private memory, what each TP worker's
model runner ends up doing after ``open_tensor``):

* ``open_tensor+copy``      as shipped (read-only shared mapping, reader flag set):
                            demand faults on the mapping while copying
* ``POPULATE_READ+copy``    ``madvise(MADV_POPULATE_READ)`` on the mapping first
* ``preadv``                no mapping: ``os.preadv`` into the fresh buffer
* ``floor``                 ``torch.empty(N).copy_(src)`` from warm private memory
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

os.environ.setdefault("VLLM_SHM_EMBEDS_MIN_BYTES", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from vllm._shm_embeds import config, transfer  # noqa: E402
from vllm._shm_embeds import handle as hdl  # noqa: E402

HDR = hdl.HEADER_BYTES
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
MAX_RW = 0x7FFFF000  # Linux caps one read/write call at this many bytes


def pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    """``os.pwritev`` until all of ``buf`` is written (raises OSError, e.g. ENOSPC)."""
    done = 0
    while done < len(buf):
        done += os.pwritev(fd, [buf[done : done + MAX_RW]], offset + done)


def pread_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done : done + MAX_RW]], offset + done)
        if not got:
            raise EOFError
        done += got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="tensor size in MiB")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    n = args.mib << 20
    src = torch.full((n // 4,), 1.5, dtype=torch.float32)  # warm, private
    raw = src.view(torch.uint8)
    raw_mv = memoryview(raw.numpy())
    path = os.path.join(config.shm_dir(), f"{hdl.SEGMENT_PREFIX}.proto.{os.getpid()}")

    def writer(prealloc: str, how: str) -> Callable[[], float]:
        def run() -> float:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                t = time.monotonic()
                if prealloc == "fallocate":
                    os.posix_fallocate(fd, 0, HDR + n)
                else:
                    os.ftruncate(fd, HDR + n)
                if how == "pwritev":
                    os.pwrite(fd, hdl.MAGIC, 0)
                    pwrite_all(fd, raw_mv, HDR)
                elif how.startswith("mmap"):
                    mm = mmap.mmap(fd, HDR + n, flags=mmap.MAP_SHARED)
                    if how == "mmap-populate":
                        mm.madvise(MADV_POPULATE_WRITE)
                    mm[: len(hdl.MAGIC)] = hdl.MAGIC
                    dst = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=HDR)
                    dst.copy_(raw)
                    del dst
                    mm.close()
                return time.monotonic() - t
            finally:
                os.close(fd)
                os.unlink(path)

        return run

    def share() -> float:
        t = time.monotonic()
        h = transfer.share_tensor(src)
        dt = time.monotonic() - t
        os.unlink(os.path.join(config.shm_dir(), h.name))
        return dt

    handle = transfer.share_tensor(src)
    seg = os.path.join(config.shm_dir(), handle.name)

    def open_copy() -> float:
        t = time.monotonic()
        x = transfer.open_tensor(handle, reader_index=0)  # as a worker: private mapping
        y = torch.empty_like(x).copy_(x)
        dt = time.monotonic() - t
        assert y[-1].item() == 1.5
        return dt

    def populate_copy() -> float:
        t = time.monotonic()
        fd = os.open(seg, os.O_RDONLY)
        mm = mmap.mmap(fd, HDR + n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        os.close(fd)
        mm.madvise(MADV_POPULATE_READ)
        x = torch.frombuffer(memoryview(mm)[HDR:], dtype=torch.uint8)
        y = torch.empty_like(x).copy_(x)
        dt = time.monotonic() - t
        assert y[-1].item() == raw[-1].item()
        return dt

    def preadv() -> float:
        t = time.monotonic()
        y = torch.empty(n, dtype=torch.uint8)
        fd = os.open(seg, os.O_RDONLY)
        pread_all(fd, memoryview(y.numpy()), HDR)
        os.close(fd)
        return time.monotonic() - t

    def floor() -> float:
        t = time.monotonic()
        y = torch.empty(n, dtype=torch.uint8).copy_(raw)
        dt = time.monotonic() - t
        del y
        return dt

    def fallocate_only() -> float:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        t = time.monotonic()
        os.posix_fallocate(fd, 0, HDR + n)
        dt = time.monotonic() - t
        os.close(fd)
        os.unlink(path)
        return dt

    variants = {
        "writer: share_tensor (as shipped)": share,
        "writer: fallocate alone": fallocate_only,
        "writer: ftrunc+pwritev": writer("ftruncate", "pwritev"),
        "writer: falloc+pwritev": writer("fallocate", "pwritev"),
        "writer: falloc+mmap+POPULATE_WRITE+copy": writer("fallocate", "mmap-populate"),
        "reader: open_tensor+copy (as shipped)": open_copy,
        "reader: mmap+POPULATE_READ+copy": populate_copy,
        "reader: preadv into fresh buffer": preadv,
        "floor: empty+copy from warm memory": floor,
    }
    times: dict[str, list[float]] = defaultdict(list)
    try:
        for _ in range(args.repeats):
            for name, fn in variants.items():
                times[name].append(fn() * 1e3)
    finally:
        os.unlink(seg)
    print(f"{args.mib} MiB, torch threads {torch.get_num_threads()}, median of "
          f"{args.repeats} (min) ms, load {os.getloadavg()[0]:.1f}")
    for name, ts in times.items():
        print(f"{name:42s} {statistics.median(ts):8.1f} ({min(ts):6.1f})")


if __name__ == "__main__":
    main()
