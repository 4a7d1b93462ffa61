# SPDX-License-Identifier: Apache-2.0
"""The ``held`` extension (``ext/held``): a holder's memfd crosses hop 1 by descriptor
and hop 2 by the EngineCore's descriptors, no copy; its failures are clear errors that
leave nothing behind; its hop-1 metadata parser is fuzzed."""

import errno
import fcntl
import os
import types

import pytest
import torch
from helpers import delta
from hypothesis import example, given
from hypothesis import strategies as st

from vllm._shm_embeds import counters, extensions, handle
from vllm._shm_embeds.hops import hop1, hop2
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.procfs import pid_namespace

held = extensions.require("held", "held")


def _sealed_memfd(t: torch.Tensor) -> int:
    """A producer's region: ``t``'s bytes in a memfd sealed against any change."""
    fd = os.memfd_create("test-region", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    while data:
        data = data[os.write(fd, data):]
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK
                | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def _memfd_refs() -> int:
    """This process's mappings and fds of test regions."""
    maps = sum("memfd:test-region" in line for line in open("/proc/self/maps"))
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += "memfd:test-region" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return maps + fds


def _holding(monkeypatch, src: torch.Tensor, fd: int, ino: int | None = None) -> None:
    """A holder that maps exactly ``src`` from ``fd`` (inode ``ino``: a wrong one)."""
    found = (os.getpid(), fd, os.fstat(fd).st_ino if ino is None else ino)
    monkeypatch.setattr(process.current(), "holders", [types.SimpleNamespace(
        find=lambda t: found if t is src else None, is_held=lambda t: t is src)])


def _send(src: torch.Tensor) -> tuple[hop1.HandleOOBConsumer, dict | None]:
    consumer = hop1.HandleOOBConsumer()
    consumer.arm(src)
    return consumer, consumer(src)


def test_held_file_crosses_both_hops_without_a_copy(shm_env, monkeypatch):
    """Hop 1 sends a header-only segment and the memfd's descriptor; the EngineCore
    opens it through /proc/<pid>/fd and hop 2's reader through the EngineCore's fds;
    nobody copies its bytes, and every mapping and fd of it goes when it is freed."""
    src = torch.randn(1024, 32)
    fd = _sealed_memfd(src)
    _holding(monkeypatch, src, fd)
    assert held.is_held(src) and not held.is_held(src.clone())
    before = counters.stats()
    consumer, meta = _send(src)
    sent = meta[hop1.META_KEY]
    assert sent[held.KEY] == [os.getpid(), fd, os.fstat(fd).st_ino]
    assert os.path.getsize(os.path.join(shm_env, sent["name"])) == handle.HEADER_BYTES
    adopted = hop1.HandleOOBProvider()("float32", (1024, 32), meta)  # the EngineCore
    assert torch.equal(adopted, src)
    os.close(fd)  # the API server lets go: the EngineCore holds its own fd
    hb = hop2.externalize(adopted, readers=1)
    assert len(hb.owner_files) == 2 and hb.unnamed_data
    reader = transfer.open_tensor(hb, 0)  # a TP worker, through the EngineCore's fds
    assert torch.equal(reader, src)
    d = delta(before, counters.stats())
    assert d.get("copied_bytes", 0) == 0 and d.get("hop2_reused_tensors", 0) == 1
    assert d.get("hop1_region_tensors") == 1 and d.get("hop1_region_adopted") == 1, d
    assert d.get("hop1_shm_bytes") == 2 * src.nbytes  # sent, and adopted
    assert process.collect() == 0 and len(os.listdir(shm_env)) == 1  # the header file
    del reader
    assert transfer.release_adopted(adopted)
    assert os.listdir(shm_env) == []
    assert _memfd_refs() == 0 and not adopted.any()
    assert consumer.take_created()  # the header, adopted: nothing for the caller to remove


def test_held_file_over_the_segment_cap_is_read(shm_env, monkeypatch):
    """At ``MAX_SEGMENTS`` the EngineCore reads the memfd instead (counted), and the
    header goes."""
    src = torch.randn(64, 32)
    fd = _sealed_memfd(src)
    _holding(monkeypatch, src, fd)
    (_, meta), (_, headless) = _send(src), _send(src)
    os.unlink(os.path.join(shm_env, headless[hop1.META_KEY]["name"]))

    def full():
        raise transfer.seg.TooManySegments(1)

    monkeypatch.setattr(process.current(), "check_segments", full)
    before = counters.stats()
    provider = hop1.HandleOOBProvider()
    out = provider("float32", (64, 32), meta)
    assert torch.equal(out, src) and os.listdir(shm_env) == []
    d = delta(before, counters.stats())
    assert d.get("fallback.hop1.segments") == 1 and d.get("copied_bytes") == src.nbytes, d
    # without the sender's header file (gone, or not ours) the memfd is never read
    assert provider.is_failed(provider("float32", (64, 32), headless))
    assert delta(before, counters.stats()).get("copied_bytes") == src.nbytes
    os.close(fd)


def test_held_file_gone_before_adoption_is_a_clear_error(shm_env, monkeypatch):
    """The API server's descriptor closed (request aborted, region gone) or reused by
    another file: the EngineCore refuses the handle and leaves nothing behind."""
    src = torch.randn(64, 32)
    fd = _sealed_memfd(src)
    h, memfd = held.from_meta(held.share(_holder_of(monkeypatch, src, fd))[1])
    os.close(fd)
    with pytest.raises(handle.ShmEmbedsError, match="held file is gone"):
        held.adopt(h, memfd)
    other = _sealed_memfd(src)  # very likely the same number, another inode
    h, memfd = held.from_meta(held.share(_holder_of(monkeypatch, src, other, 1))[1])
    with pytest.raises(handle.ShmEmbedsError, match="held file is gone"):
        held.adopt(h, memfd)
    os.close(other)
    # the number reused by a FIFO's read end (no writer): refused, never blocks
    fifo = os.path.join(shm_env, "fifo")
    os.mkfifo(fifo)
    rd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    h, memfd = held.from_meta(held.share(_holder_of(monkeypatch, src, rd))[1])
    with pytest.raises(handle.ShmEmbedsError, match="held file is gone"):
        held.adopt(h, memfd)
    os.close(rd)
    os.unlink(fifo)
    # a TP reader without the owner's fds never opens the data file by name (planted)
    planted = h.renamed(process.current().new_name())
    open(os.path.join(shm_env, handle.part_name(planted.name, 1)), "wb").close()
    with pytest.raises(handle.ShmEmbedsError, match="only through its owner"):
        transfer.open_tensor(planted, 0)
    os.unlink(os.path.join(shm_env, handle.part_name(planted.name, 1)))
    process.collect()
    assert os.listdir(shm_env) == [] and _memfd_refs() == 0


def _holder_of(monkeypatch, src: torch.Tensor, fd: int, ino_delta: int = 0) -> torch.Tensor:
    _holding(monkeypatch, src, fd, os.fstat(fd).st_ino + ino_delta)
    return src


def test_held_metadata_without_the_extension_is_refused(shm_env, monkeypatch):
    """An EngineCore without ``ext/held`` rejects the request (never reads by name)."""
    src = torch.randn(64, 32)
    fd = _sealed_memfd(src)
    _holding(monkeypatch, src, fd)
    _, meta = _send(src)
    os.close(fd)
    monkeypatch.setattr(hop1, "held_module", lambda: None)
    provider = hop1.HandleOOBProvider()
    assert provider.is_failed(provider("float32", (64, 32), meta))
    assert os.listdir(shm_env) == []  # the sender's header went too


def test_held_header_on_a_full_dev_shm_goes_inline(shm_env, monkeypatch):
    """A held file still needs a 4 KiB header file (hop 2's reader flags); with
    ``/dev/shm`` full it goes the stock way, inline, counted, and leaves nothing."""
    src = torch.randn(64, 32)
    fd = _sealed_memfd(src)
    try:
        _holding(monkeypatch, src, fd)

        def no_space(fd, buf, offset):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwrite", no_space)
        before = counters.stats()
        consumer, meta = _send(src)
        assert meta is None  # inline: the stock way
        d = delta(before, counters.stats())
        assert d.get("fallback.hop1.no_space", 0) == 1
        assert d.get("hop1_stock_bytes", 0) == src.nbytes
        assert d.get("hop1_region_tensors", 0) == 0
        assert consumer.take_created() == [] and os.listdir(shm_env) == []
    finally:
        os.close(fd)


_ints = st.integers(-(2**70), 2**70)
_held = st.one_of(st.lists(_ints | st.booleans() | st.none() | st.text(max_size=3),
                           max_size=5), st.none(), _ints, st.text(max_size=5),
                  st.just([os.getpid(), 3, 4]))
_OURS = str(handle.SegmentName(pid_namespace(), os.getpid(), 1, 1))


@given(st.fixed_dictionaries(
    {"name": st.sampled_from([_OURS, f"{handle.SEGMENT_PREFIX}.1.2.3.4", "x", "../etc", 7]),
     "dtype": st.sampled_from(["float32", "bfloat16", "", "__class__", None]),
     "shape": st.lists(st.integers(-2, 2**40) | st.none(), max_size=3)},
    optional={"held": _held, "split": st.lists(_ints, max_size=2)}) | st.none() | _held)
@example({"name": _OURS, "dtype": "float32", "shape": [2], "held": [1, 3, 4]})  # not its pid
@example({"name": _OURS, "dtype": "float32", "shape": [0], "held": [os.getpid(), 3, 4]})
@example({"name": _OURS, "dtype": "float32", "shape": [2], "held": [os.getpid(), 3, True]})
def test_fuzz_held_from_meta(meta):
    """Any metadata: a handle whose data is a held file named by the segment's own pid,
    or ShmEmbedsError, never another exception."""
    try:
        h, memfd = held.from_meta(meta)
    except handle.ShmEmbedsError:
        return
    assert h.unnamed_data and h.nbytes > 0 and len(memfd) == 3 and min(memfd) > 0
    assert memfd[0] == handle.SegmentName.parse(h.name).pid
