# SPDX-License-Identifier: Apache-2.0
"""Fuzzing the direct decode against vLLM's own loader.

Hypothesis mutates real ``torch.save`` zips (bytes changed, cut, inserted)
and the opcodes of their ``data.pkl`` (dropped, repeated, swapped, inserted
from a vocabulary of the tricks: huge memo indices, ``BUILD``, extra
persistent loads, ``BINGET``), rebuilt into zips laid out by ``torch.save``
itself. Each example runs in one forked child under ``RLIMIT_AS`` (its
address space at the fork plus :data:`HEADROOM`), batched: one child for
the whole module. Properties, per example:

* ``torch_save.direct_decode`` raises nothing (its only declared error,
  ``OSError``, needs a full ``/dev/shm``, which this test does not make);
* whenever it returns a tensor, ``safe_load_prompt_embeds`` returns an equal
  one (dtype, shape, bytes);
* the child's peak RSS stays within :data:`RSS_GROWTH` of where it was
  after a warm-up example (a.k.a. the memo trick costs nothing).
"""

import multiprocessing
import os
import pickletools
import resource
import shutil
import struct
import tempfile
import traceback

import pytest
import torch
import torch_save_cases as cases
from torch_save_cases import HIDDEN

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

HEADROOM = 1 << 30  # address space a child may add to what it had at fork
RSS_GROWTH = 128 << 20  # peak RSS a child may add after its warm-up example


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


def _child(conn, seg_dir: str, stats_dir: str) -> None:
    """Runs in the forked child: answers each payload with ``(verdict, detail)``."""
    import base64

    os.environ.update(VLLM_SHM_EMBEDS="1", VLLM_SHM_EMBEDS_DIR=seg_dir,
                      VLLM_SHM_EMBEDS_STATS_DIR=stats_dir, VLLM_SHM_EMBEDS_MIN_BYTES="0")
    from vllm._shm_embeds import counters
    from vllm._shm_embeds.ext.json import torch_save
    from vllm._shm_embeds.lifetime import process, transfer

    counters._state = counters._Counters()
    process._state = process.Process()
    ctx = cases.ctx()

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    warm = cases.saved(torch.randn(12, HIDDEN))
    transfer.release_streamed(torch_save.direct_decode(ctx, memoryview(base64.b64encode(warm))))
    cases.stock(warm)
    process.collect()
    rss0 = peak()
    limit = _vm_size() + HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    while True:
        raw = conn.recv()
        if raw is None:
            conn.send(("rss", peak() - rss0))
            return
        b64 = base64.b64encode(raw)
        try:
            ours = torch_save.direct_decode(ctx, memoryview(b64))
        except BaseException:  # anything is a finding here
            conn.send(("raised", traceback.format_exc()))
            continue
        verdict = ("none", None)
        if ours is not None:
            want = cases.stock(raw)
            if isinstance(want, BaseException):
                verdict = ("mismatch", f"stock raised {want!r}")
            elif (want.dtype != ours.dtype or want.shape != ours.shape
                  or not torch.equal(want.contiguous().view(torch.uint8),
                                     ours.contiguous().view(torch.uint8))):
                verdict = ("mismatch", f"{tuple(ours.shape)} {ours.dtype} vs "
                                       f"{tuple(want.shape)} {want.dtype}")
            else:
                verdict = ("tensor", None)
            transfer.release_streamed(ours)
            del ours, want
            process.collect()
        if peak() - rss0 > RSS_GROWTH:
            verdict = ("memory", f"peak RSS grew by {peak() - rss0} bytes")
            rss0 = peak()
        conn.send(verdict)  # after the release: the parent then checks the directory


class _Runner:
    """One forked child under ``RLIMIT_AS`` for many examples (restarted if it dies)."""

    def __init__(self) -> None:
        self.seg_dir = tempfile.mkdtemp(prefix="shm-embeds-fuzz-", dir="/dev/shm")
        self.stats_dir = tempfile.mkdtemp(prefix="shm-embeds-fuzz-stats-")
        self.proc = None
        self.seen: dict[str, int] = {}

    def start(self) -> None:
        import vllm.renderers.embed_utils  # noqa: F401 - imported once, before the fork

        ctx = multiprocessing.get_context("fork")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child_conn, self.seg_dir,
                                                     self.stats_dir), daemon=True)
        self.proc.start()
        child_conn.close()

    def check(self, raw: bytes) -> None:
        if self.proc is None or not self.proc.is_alive():
            self.start()
        self.conn.send(raw)
        if not self.conn.poll(60):
            self.proc.kill()
            self.proc = None
            raise AssertionError("the child took over 60 s on one payload")
        try:
            verdict, detail = self.conn.recv()
        except EOFError:
            code = self.proc.exitcode
            self.proc = None
            raise AssertionError(f"the child died (exit {code})") from None
        self.seen[verdict] = self.seen.get(verdict, 0) + 1
        assert verdict in ("none", "tensor"), f"{verdict}: {detail}"
        assert os.listdir(self.seg_dir) == []

    def close(self) -> int:
        """Stop the child; its peak RSS growth in bytes (0 when none ran)."""
        grown = 0
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            if self.conn.poll(30):
                _, grown = self.conn.recv()
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
        left = os.listdir(self.seg_dir)
        shutil.rmtree(self.seg_dir, ignore_errors=True)
        shutil.rmtree(self.stats_dir, ignore_errors=True)
        assert left == [], f"segments left: {left}"
        return grown


@pytest.fixture(scope="module")
def runner():
    r = _Runner()
    try:
        yield r
    finally:
        grown = r.close()
    assert grown < RSS_GROWTH, f"child RSS grew by {grown} bytes"


# -- strategies

_BASES = [  # (tensor, what torch.save writes): plain ones, a cast, a 3-d one, another hidden
    torch.randn(12, HIDDEN),
    torch.randn(1, 7, HIDDEN),
    torch.randn(5, HIDDEN).half(),
    torch.randn(3, HIDDEN + 1),
]
_SAVED = [cases.saved(t) for t in _BASES]


def _chunks(pkl: bytes) -> list[bytes]:
    """The opcodes of ``pkl`` with their arguments, one bytes each."""
    ops = list(pickletools.genops(pkl))
    ends = [pos for _, _, pos in ops[1:]] + [len(pkl)]
    return [pkl[pos:end] for (_, _, pos), end in zip(ops, ends)]


_VOCAB = [  # opcodes an attacker adds
    b"r" + struct.pack("<I", 0x7FFFFFF0),  # LONG_BINPUT huge: the memo trick
    b"r" + struct.pack("<I", 1 << 24),  # 256 MiB of memo array in a C unpickler
    b"q\xff", b"h\x00", b"h\xfe", b"j" + struct.pack("<I", 0x7FFFFFF0),  # BINPUT/BINGET
    b"b", b"0", b"(", b"t", b"R", b"N", b"\x88", b"\x89", b")", b"}", b"s", b"\x85",
    b"Q", cases.storage_pid("FloatStorage", 12 * HIDDEN + 1) + b"Q",
    cases.storage_pid("FloatStorage", 12 * HIDDEN) + b"Q",
    cases.storage_pid("HalfStorage", 24 * HIDDEN) + b"Q",
    b"K\x00", b"K\x01", b"J\xff\xff\xff\xff", b"\x8a\x08" + b"\xff" * 7 + b"\x7f",
    b"N}X\x04\x00\x00\x00argsK\x01s\x86b",  # BUILD with a slot state
]


@st.composite
def pickle_mutants(draw) -> bytes:
    """A zip by ``torch.save`` whose ``data.pkl`` has mutated opcodes."""
    index = draw(st.integers(0, len(_BASES) - 1))
    # Positions: 0 and 1 are PROTO's neighbours, -1 is before STOP (where most
    # tricks keep the pickle valid), others anywhere.
    where = st.one_of(st.sampled_from([1, -1, -2]), st.integers(0, 40))
    edits = draw(st.lists(st.tuples(st.sampled_from(["insert", "insert", "drop", "dup",
                                                     "swap"]),
                                    where, where, st.sampled_from(_VOCAB)),
                          min_size=1, max_size=3))

    def edit(pkl: bytes) -> bytes:
        chunks = _chunks(pkl)
        for kind, i, j, new in edits:
            i, j = i % len(chunks), j % len(chunks)  # -1: the STOP
            if kind == "drop" and len(chunks) > 1:
                del chunks[i]
            elif kind == "dup":
                chunks.insert(i, chunks[i])
            elif kind == "swap":
                chunks[i], chunks[j] = chunks[j], chunks[i]
            else:
                chunks.insert(i, new)
        return b"".join(chunks)

    return cases.save_with(_BASES[index], edit)


@st.composite
def zip_mutants(draw) -> bytes:
    """A ``torch.save`` zip with bytes changed, inserted, removed, or cut."""
    raw = bytearray(_SAVED[draw(st.integers(0, len(_SAVED) - 1))])
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["set", "set", "insert", "delete", "cut"]))
        at = draw(st.integers(0, len(raw) - 1))
        if kind == "set":
            raw[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del raw[at:at + draw(st.integers(1, 8))]
        elif at:
            del raw[at:]
        if not raw:
            raw = bytearray(b"\x00")
    return bytes(raw)


@hypothesis.given(pickle_mutants())
def test_fuzz_pickle_opcodes_against_stock(runner, raw):
    runner.check(raw)


@hypothesis.given(zip_mutants())
def test_fuzz_zip_bytes_against_stock(runner, raw):
    runner.check(raw)


def test_fuzz_saw_both_outcomes(runner):
    """The fuzzing reached the direct decode and the loader's side (a target
    whose every example is refused checks nothing)."""
    for raw in _SAVED[:2]:
        runner.check(raw)
    runner.check(cases.save_with(_BASES[0], cases.memo_trick(0x7FFFFFF0)))
    assert runner.seen.get("tensor", 0) >= 2 and runner.seen.get("none", 0) >= 1, runner.seen


@pytest.mark.parametrize("index", [1 << 24, 0x7FFFFFF0])
def test_memo_trick_in_the_child(runner, index):
    """The trick itself, under the child's bounds: a 256 MiB memo (over
    ``RSS_GROWTH``) for a C unpickler, 32 GiB (over ``RLIMIT_AS``)."""
    runner.check(cases.save_with(torch.randn(12, HIDDEN), cases.memo_trick(index)))


@hypothesis.given(data=st.binary(max_size=64),
                  edits=st.lists(st.tuples(st.integers(0, 200), st.sampled_from(b"=!A \n/+-")),
                                 max_size=3),
                  cut=st.integers(0, 3), step=st.sampled_from([4, 8, 12]))
@hypothesis.example(data=b"abcdef", edits=[(3, ord("="))], cut=0, step=4)  # "YWJ=ZGVm"
def test_valid_base64_is_vllms_strict_decode(monkeypatch, data, edits, cut, step):
    """``torch_save.valid_base64`` (checked ``step`` characters at a time)
    accepts exactly what vLLM's loader's ``pybase64.b64decode(validate=True)``
    accepts, padding at a step's edge included."""
    import base64

    import pybase64

    from vllm._shm_embeds.ext.json import torch_save

    monkeypatch.setattr(torch_save, "VALIDATE_CHARS", step)
    s = bytearray(base64.b64encode(data))
    for at, ch in edits:
        if s:
            s[at % len(s)] = ch
    s = bytes(s[:len(s) - cut])
    try:
        pybase64.b64decode(s, validate=True)
        want = True
    except ValueError:
        want = False
    assert torch_save.valid_base64(memoryview(s)) == want
