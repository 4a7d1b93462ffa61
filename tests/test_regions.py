# SPDX-License-Identifier: Apache-2.0
"""Unit tests of registered regions (ext/regions/registry.py) and their socket (ext/regions/server.py).

No vLLM engine: a RegionRegistry and a RegionServer on a tmp path, and a tiny
producer in the test (memfd_create, seals, SCM_RIGHTS over SOCK_SEQPACKET).
Every test checks that the process ends with the file descriptors it started
with (server and producer both live in this process).
"""

import array
import errno
import fcntl
import grp
import json
import multiprocessing as mp
import os
import re
import socket
import stat
import tempfile
import threading
import time

import pytest
import torch
from helpers import open_fds, wait_until

from vllm._shm_embeds import counters
from vllm._shm_embeds.ext.regions import server as rs
from vllm._shm_embeds.ext.regions.registry import RegionError, RegionLimits, RegionRegistry

H, MAX_T = 64, 128
ALL_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MEMFD_NAME = "producer-secret-name"
FULL_FP32 = MAX_T * H * 4  # 32 KiB


def _fds() -> dict[int, str]:
    return open_fds()


def _is_memfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except OSError:
        return False


def _limits(**kw) -> RegionLimits:
    base = {"hidden_size": H, "max_tokens": MAX_T, "allowed_uids": frozenset({os.getuid()}),
            "max_regions_per_uid": 4, "max_bytes_per_uid": 2 * FULL_FP32, "idle_ttl_s": 600.0}
    return RegionLimits(**{**base, **kw})


class Env:
    """A registry, its server, producers, and every error message seen."""

    def __init__(self, tmp_path, monkeypatch):
        self.tmp_path = tmp_path
        self.monkeypatch = monkeypatch
        self.path = str(tmp_path / "regions.sock")
        self.socks = []
        self.errors = []
        self.registry = self.server = None

    def start(self, on_registered=None, max_connections=64, group=None, describe=None,
              **limits):
        self.registry = RegionRegistry(_limits(**limits), on_registered)
        self.server = rs.RegionServer(self.path, self.registry, group=group,
                                      max_connections=max_connections, describe=describe)
        self.server.start()
        return self

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        s.connect(self.path)
        self.socks.append(s)
        return s

    def send(self, sock, msg, fds=()):
        """Send ``msg`` (dict or raw bytes) with ``fds`` (closed here)."""
        data = msg if isinstance(msg, bytes) else json.dumps(msg).encode()
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] \
            if fds else []
        try:
            sock.sendmsg([data], anc)
        finally:
            for fd in fds:
                os.close(fd)

    def reply(self, sock):
        reply = json.loads(sock.recv(1 << 16))
        if "error" in reply:
            self.errors.append(reply["error"])
        return reply

    def request(self, sock, msg, fds=()):
        """Send ``msg`` (dict or raw bytes) with ``fds`` (closed here); the reply."""
        self.send(sock, msg, fds)
        return self.reply(sock)

    def register(self, sock, tensor, datatype=None, shape=None, seals=ALL_SEALS):
        datatype = datatype or {torch.float32: "FP32", torch.float16: "FP16",
                                torch.bfloat16: "BF16"}[tensor.dtype]
        shape = list(tensor.shape) if shape is None else shape
        fd = memfd(tensor_bytes(tensor), seals)
        return self.request(sock, {"op": "register", "datatype": datatype, "shape": shape},
                            [fd])

    def started_with_a_lease(self):
        """Start the server, register a random ``[2, H]`` FP32 tensor and lease
        it: ``(sock, tensor, region id, lease)``."""
        self.start()
        sock = self.connect()
        t = torch.randn(2, H)
        rid = self.register(sock, t)["region"]
        return sock, t, rid, self.registry.lease(rid, "FP32", [2, H], t.nbytes, 0)

    def refused(self, reply, *words):
        assert set(reply) == {"error"}, reply
        for w in words:
            assert w in reply["error"], (w, reply)
        return reply["error"]

    def check_good_registration(self, sock):
        t = torch.randn(3, H, dtype=torch.bfloat16)
        reply = self.register(sock, t)
        assert "region" in reply, reply
        lease = self.registry.lease(reply["region"], "BF16", [3, H], t.nbytes, 0)
        assert torch.equal(lease.tensor, t)
        lease.release()
        assert self.request(sock, {"op": "unregister", "region": reply["region"]}) == {
            "ok": True}


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def memfd(data: bytes, seals=ALL_SEALS, flags=os.MFD_ALLOW_SEALING) -> int:
    fd = os.memfd_create(MEMFD_NAME, flags)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_SHM_EMBEDS_STATS_DIR", raising=False)
    monkeypatch.setattr(counters, "_state", counters._Counters())
    before = _fds()
    e = Env(tmp_path, monkeypatch)
    yield e
    for s in e.socks:
        s.close()
    if e.server is not None:
        e.server.close()
        assert not os.path.exists(e.path)
    if e.registry is not None:
        e.registry.close()
    # Leaked: an fd that is open now and was not, or was another file, before.
    # (Fewer fds than before is fine: the garbage collector may close earlier
    # tests' sockets meanwhile.) Not memfds close on the closer thread: wait.
    def leaks():
        return {fd: link for fd, link in _fds().items() if before.get(fd) != link}

    wait_until(lambda: not leaks(), 2, lambda: f"no fd leaked: {leaks()}", interval=0.01)
    for msg in e.errors:  # client-safe: no path, no internal name
        for bad in (str(tmp_path), "/dev/shm", "memfd:", MEMFD_NAME, "/proc"):
            assert bad not in msg, (bad, msg)


# ---------------------------------------------------------------- happy path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_register_lease_find(env, dtype):
    seen = []
    env.start(on_registered=seen.append)
    sock = env.connect()
    t = torch.randn(5, H).to(dtype)
    reply = env.register(sock, t)
    assert set(reply) == {"region", "byte_size"} and reply["byte_size"] == t.nbytes
    rid = reply["region"]
    assert re.fullmatch(r"[A-Za-z0-9_-]{22,}", rid)
    assert MEMFD_NAME not in rid and str(os.getpid()) not in rid
    assert len(seen) == 1 and torch.equal(seen[0], t)
    other = env.register(sock, t)["region"]
    assert other != rid

    datatype = {torch.float32: "FP32", torch.float16: "FP16", torch.bfloat16: "BF16"}[dtype]
    lease = env.registry.lease(rid, datatype, [5, H], t.nbytes, 0)
    assert lease.tensor is lease.region.tensor and lease.region.id == rid
    assert lease.tensor.dtype == dtype and lease.tensor.shape == (5, H)
    assert torch.equal(lease.tensor, t)
    assert seen[0] is lease.tensor  # the callback saw the region's own tensor
    # zero-copy and read-only: the tensor's pages are a shared PROT_READ mapping
    addr = lease.tensor.data_ptr()
    with open("/proc/self/maps") as f:
        perms = [ln.split()[1] for ln in f
                 if int(ln.split("-")[0], 16) <= addr < int(ln.split()[0].split("-")[1], 16)]
    assert perms == ["r--s"]

    pid, fd, inode = env.registry.find(lease.tensor)
    assert pid == os.getpid() and fd == lease.region.fd and inode == lease.region.inode
    opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)  # what the EngineCore does
    try:
        assert os.fstat(opened).st_ino == inode
        assert os.pread(opened, t.nbytes, 0) == tensor_bytes(t)
    finally:
        os.close(opened)
    assert env.registry.is_held(lease.tensor)
    for not_it in (t, lease.tensor.clone(), lease.tensor[1:], lease.tensor[:4],
                   lease.tensor.view(-1), lease.tensor.view(torch.uint8), "x",
                   lease.tensor.as_strided((5, H), (1, 5))):
        assert env.registry.find(not_it) is None
        assert not env.registry.is_held(not_it)
    if dtype != torch.float32:
        assert env.registry.find(lease.tensor.view(torch.int16)) is None

    st = env.registry.stats()
    assert st["regions"] == 2 and st["bytes"] == 2 * t.nbytes and st["draining"] == 0
    assert st["per_uid"] == {os.getuid(): {"regions": 2, "bytes": 2 * t.nbytes}}
    lease.release()
    lease.release()  # idempotent
    assert env.registry.lease(rid, datatype, (5, H), t.nbytes, None).release() is None
    c = counters.stats()
    assert c["regions_registered"] == 2 and c["region_bytes"] == 2 * t.nbytes
    assert c["region_leases"] == 2


def test_unregister(env):
    sock, t, rid, region = env.started_with_a_lease()
    region.release()
    assert env.request(sock, {"op": "unregister", "region": rid}) == {"ok": True}
    assert env.registry.find(region.tensor) is None
    with pytest.raises(RegionError, match="^unknown shared_memory_region$"):
        env.registry.lease(rid, "FP32", [2, H], t.nbytes, 0)
    env.refused(env.request(sock, {"op": "unregister", "region": rid}), "unknown")
    env.refused(env.request(sock, {"op": "unregister", "region": ["x"]}), "unknown")
    env.refused(env.request(sock, {"op": "unregister"}), "unknown")
    with pytest.raises(RegionError, match="unknown"):
        env.registry.unregister(rid)
    # another uid's region is unknown to it
    rid = env.register(sock, t)["region"]
    with pytest.raises(RegionError, match="unknown"):
        env.registry.unregister(rid, uid=os.getuid() + 1)
    env.registry.unregister(rid, uid=os.getuid())
    assert env.registry.stats()["regions"] == 0
    assert counters.stats()["region_unregistered.op"] == 2
    env.check_good_registration(sock)


def test_connection_close_unregisters_and_leases_outlive_it(env):
    env.start()
    sock = env.connect()
    t = torch.randn(7, H, dtype=torch.float16)
    rid = env.register(sock, t)["region"]
    rid2 = env.register(sock, t)["region"]
    lease = env.registry.lease(rid, "FP16", [7, H], t.nbytes, 0)
    unleased = env.registry.lease(rid2, "FP16", [7, H], t.nbytes, 0)
    unleased.release()
    fd, fd2 = lease.region.fd, unleased.region.fd
    sock.close()
    # the server thread frees after dropping (outside the registry lock):
    # wait for the free, not only for the drop
    wait_until(lambda: env.registry.stats()["regions"] == 0
               and counters.stats().get("regions_freed") == 1, 5, "the region freed")
    for r in (rid, rid2):
        with pytest.raises(RegionError, match="unknown"):
            env.registry.lease(r, "FP16", [7, H], t.nbytes, 0)
    assert env.registry.stats()["draining"] == 1
    assert not _is_memfd(fd2)  # closed at once: nothing leased it
    # the request in flight keeps working
    assert torch.equal(lease.tensor, t)
    assert env.registry.find(lease.tensor) == (os.getpid(), fd, lease.region.inode)
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    held = env.registry.stats()["per_uid"][os.getuid()]
    assert held == {"regions": 1, "bytes": t.nbytes}  # a draining region still counts
    lease.release()
    with pytest.raises(OSError) as e:
        os.fstat(fd)
    assert e.value.errno == errno.EBADF
    assert env.registry.find(lease.tensor) is None
    assert env.registry.stats() == {"regions": 0, "bytes": 0, "draining": 0, "leases": 0,
                                      "per_uid": {}}
    # the API server's pages are gone: the tensor object stays valid, reads zeros
    assert not lease.tensor.any()
    c = counters.stats()
    assert c["region_unregistered.disconnect"] == 2 and c["regions_freed"] == 2
    env.check_good_registration(env.connect())


def test_a_settled_lease_leaves_the_cap_and_still_keeps_its_region(env):
    """Once a request's response has started its leases stop counting against
    ``max_leases`` (a slow reader of a streamed answer holds none of them) and
    still keep their region alive, unregistered or not, until released."""
    env.start(max_leases=1)
    sock = env.connect()
    t = torch.randn(7, H, dtype=torch.float16)
    rid = env.register(sock, t)["region"]
    lease = env.registry.lease(rid, "FP16", [7, H], t.nbytes, 0)
    with pytest.raises(RegionError, match="most allowed"):
        env.registry.lease(rid, "FP16", [7, H], t.nbytes, 0)
    lease.settle()
    lease.settle()  # idempotent
    assert env.registry.stats()["leases"] == 0
    second = env.registry.lease(rid, "FP16", [7, H], t.nbytes, 0)  # the slot is free
    second.release()
    sock.close()  # unregistered: the settled lease still holds the region
    wait_until(lambda: env.registry.stats()["regions"] == 0, 5, "the region unregistered")
    assert env.registry.stats()["draining"] == 1 and torch.equal(lease.tensor, t)
    lease.release()
    assert env.registry.stats() == {"regions": 0, "bytes": 0, "draining": 0, "leases": 0,
                                      "per_uid": {}}


def test_registry_close_waits_for_leases(env):
    sock, t, rid, lease = env.started_with_a_lease()
    env.registry.close()
    assert env.registry.stats()["regions"] == 0
    assert torch.equal(lease.tensor, t)
    env.refused(env.register(sock, t), "shutting down")
    lease.release()
    with pytest.raises(OSError):
        os.fstat(lease.region.fd)


# ---------------------------------------------------------------- refusals


def _regular_file(tmp_path):
    p = tmp_path / "embeds.bin"
    p.write_bytes(bytes(2 * H * 4))
    return os.open(p, os.O_RDONLY)


def _dev_shm_file(tmp_path):
    fd, name = tempfile.mkstemp(dir="/dev/shm", prefix="shm-embeds-test-")
    os.unlink(name)
    os.write(fd, bytes(2 * H * 4))
    return fd


def _pipe(tmp_path):
    r, w = os.pipe()
    os.close(w)
    return r


def _sparse(written: int):
    def make(tmp_path):  # a sealed memfd of [MAX_T, H] FP32 with only ``written`` bytes
        fd = os.memfd_create(MEMFD_NAME, os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, FULL_FP32)
        os.pwrite(fd, b"x" * written, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, ALL_SEALS)
        return fd
    return make


REG = {"op": "register", "datatype": "FP32", "shape": [2, H]}
GOOD = bytes(2 * H * 4)

REFUSALS = {
    "unsealed": (REG, lambda p: memfd(GOOD, 0), ["sealed with F_SEAL_WRITE"]),
    "sealing_not_allowed": (REG, lambda p: memfd(GOOD, 0, flags=0), ["sealed"]),
    "no_write_seal": (REG, lambda p: memfd(GOOD, ALL_SEALS & ~fcntl.F_SEAL_WRITE),
                      ["F_SEAL_WRITE", "has seals 0x7"]),
    "no_seal_seal": (REG, lambda p: memfd(GOOD, ALL_SEALS & ~fcntl.F_SEAL_SEAL),
                     ["F_SEAL_SEAL", "has seals 0xe"]),
    "regular_file": (REG, _regular_file, ["not a memfd"]),
    "dev_shm_file": (REG, _dev_shm_file, ["not a memfd"]),
    "pipe": (REG, _pipe, ["not a memfd"]),
    "too_small": (REG, lambda p: memfd(GOOD[:-4]), ["holds 508 bytes", "need 512"]),
    "too_big": (REG, lambda p: memfd(GOOD + bytes(4)), ["holds 516 bytes"]),
    "never_written": ({**REG, "shape": [MAX_T, H]}, _sparse(0),
                      ["must be written in full before it is sealed (it has holes)"]),
    "partly_written": ({**REG, "shape": [MAX_T, H]}, _sparse(4096), ["has holes"]),
    "hidden_size": ({**REG, "shape": [2, H + 1]}, lambda p: memfd(bytes(2 * 65 * 4)),
                    ["hidden size 64, got 65"]),
    "zero_tokens": ({**REG, "shape": [0, H]}, lambda p: memfd(b"", 0), ["T must be 1..128"]),
    "too_many_tokens": ({**REG, "shape": [MAX_T + 1, H]},
                        lambda p: memfd(bytes((MAX_T + 1) * H * 4)), ["got 129"]),
    "negative_tokens": ({**REG, "shape": [-2, H]}, lambda p: memfd(GOOD), ["T must be"]),
    "three_dims": ({**REG, "shape": [1, 2, H]}, lambda p: memfd(GOOD), ["two integers"]),
    "float_dims": ({**REG, "shape": [2.0, H]}, lambda p: memfd(GOOD), ["two integers"]),
    "bool_dims": ({**REG, "shape": [True, H]}, lambda p: memfd(GOOD), ["two integers"]),
    "no_shape": ({"op": "register", "datatype": "FP32"}, lambda p: memfd(GOOD),
                 ["shape must be"]),
    "bad_datatype": ({**REG, "datatype": "INT8"}, lambda p: memfd(GOOD),
                     ["datatype must be one of FP32, FP16, BF16"]),
    "lowercase_datatype": ({**REG, "datatype": "fp32"}, lambda p: memfd(GOOD),
                           ["datatype must be"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_register_refused(env, case):
    env.start()
    sock = env.connect()
    msg, make_fd, words = REFUSALS[case]
    env.refused(env.request(sock, msg, [make_fd(env.tmp_path)]), *words)
    assert env.registry.stats()["regions"] == 0
    assert sum(counters.stats().get(k, 0) for k in counters.stats()
               if k.startswith("region_refused.")) == 1
    if "not a memfd" in words:  # a peer that sends anything but a memfd is closed
        assert sock.recv(10) == b""
        sock = env.connect()
    env.check_good_registration(sock)


def test_protocol_refusals(env):
    env.start()
    sock = env.connect()
    t = torch.randn(2, H)
    good = {"op": "register", "datatype": "FP32", "shape": [2, H]}
    # longer than 64 KiB (cut short by the server), with an fd attached
    env.refused(env.request(sock, json.dumps({**good, "pad": "x" * 70000}).encode(),
                            [memfd(tensor_bytes(t))]), "longer than 65536 bytes")
    # exactly 64 KiB is fine (padding makes it valid JSON of that size)
    body = json.dumps({**good, "pad": ""})
    body = body.replace('"pad": ""', '"pad": "' + "x" * (65536 - len(body)) + '"')
    assert len(body) == 65536
    assert "region" in env.request(sock, body.encode(), [memfd(tensor_bytes(t))])
    env.refused(env.request(sock, b'{"op": "regis', [memfd(tensor_bytes(t))]), "malformed")
    env.refused(env.request(sock, b"not json"), "malformed")
    env.refused(env.request(sock, b"[1, 2]"), "malformed")
    env.refused(env.request(sock, b'{"op": "\xff"}'), "malformed")
    env.refused(env.request(sock, b"[" * 30000 + b"]" * 30000), "malformed")  # too deep
    env.refused(env.request(sock, {"op": "map"}), "unknown op")
    env.refused(env.request(sock, {"datatype": "FP32"}), "unknown op")
    env.refused(env.request(sock, good), "exactly one file descriptor", "got 0")
    # the server receives every fd and hands those it did not ask for to the closer
    env.refused(env.request(sock, good, [memfd(tensor_bytes(t)), memfd(tensor_bytes(t))]),
                "too many file descriptors")
    env.refused(env.request(sock, good, [memfd(tensor_bytes(t)) for _ in range(20)]),
                "too many file descriptors")
    env.refused(env.request(sock, {"op": "unregister", "region": "x"},
                            [memfd(tensor_bytes(t))]), "takes no file descriptor")
    assert env.registry.stats()["regions"] == 1
    c = counters.stats()
    assert c["region_refused.too_long"] == 1 and c["region_refused.malformed"] == 5
    assert c["region_refused.op"] == 2 and c["region_refused.fds"] == 4
    env.check_good_registration(sock)


def test_peer_uid_not_allowed(env):
    env.start(allowed_uids=frozenset({os.getuid() + 4242}))
    t = torch.randn(2, H)
    for _ in range(3):  # one answer at accept, then closed: it holds no slot
        sock = env.connect()
        sock.settimeout(2)
        env.refused(env.reply(sock), "may not register")
        assert sock.recv(10) == b""
    fd = memfd(tensor_bytes(t))
    with pytest.raises(RegionError, match="may not register"):
        env.registry.register(fd, os.getuid(), "FP32", [2, H])
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the registry
    assert env.registry.stats()["regions"] == 0
    assert counters.stats()["region_refused.uid"] == 4
    assert not env.server._conns


def test_per_uid_limits(env):
    env.start()
    sock = env.connect()
    small = torch.randn(1, H, dtype=torch.float16)
    ids = [env.register(sock, small)["region"] for _ in range(4)]
    env.refused(env.register(sock, small), "holds 4 regions")
    env.request(sock, {"op": "unregister", "region": ids.pop()})
    ids.append(env.register(sock, small)["region"])
    for rid in ids:
        assert env.request(sock, {"op": "unregister", "region": rid}) == {"ok": True}

    full = torch.randn(MAX_T, H)  # 32 KiB: two fill the 64 KiB per uid
    a = env.register(sock, full)["region"]
    env.register(sock, full)
    env.refused(env.register(sock, small), "128 more bytes", "over the limit of 65536")
    # an unregistered region still leased still counts
    lease = env.registry.lease(a, "FP32", [MAX_T, H], full.nbytes, 0)
    env.request(sock, {"op": "unregister", "region": a})
    env.refused(env.register(sock, small), "over the limit")
    lease.release()
    assert "region" in env.register(sock, small)
    c = counters.stats()
    assert c["region_refused.limit_count"] == 1 and c["region_refused.limit_bytes"] == 2


def test_on_registered_failure(env):
    calls = []

    def hook(tensor):
        calls.append(tensor.shape)
        if tensor.shape[0] == 2:
            raise RuntimeError("digest of /secret/path failed")
        if tensor.shape[0] == 3:
            raise RegionError("digests refused", "digest")

    env.start(on_registered=hook)
    sock = env.connect()
    env.refused(env.register(sock, torch.randn(2, H)), "could not be registered")
    assert "/secret" not in env.errors[-1]
    env.refused(env.register(sock, torch.randn(3, H)), "digests refused")
    assert "region" in env.register(sock, torch.randn(4, H))
    assert calls == [(2, H), (3, H), (4, H)]
    assert env.registry.stats()["per_uid"][os.getuid()]["regions"] == 1


def test_lease_mismatches(env):
    env.start()
    sock = env.connect()
    t = torch.randn(4, H, dtype=torch.bfloat16)
    rid = env.register(sock, t)["region"]
    n = t.nbytes
    cases = [
        ((rid, "BF16", [4, H], n + 2, 0), "shared_memory_byte_size does not match"),
        ((rid, "BF16", [4, H], str(n), 0), "shared_memory_byte_size"),
        ((rid, "BF16", [4, H], float(n), 0), "shared_memory_byte_size"),
        ((rid, "BF16", [4, H], n, 2), "shared_memory_offset must be 0"),
        ((rid, "BF16", [4, H], n, "0"), "shared_memory_offset must be 0"),
        ((rid, "BF16", [4, H], n, False), "shared_memory_offset must be 0"),
        ((rid, "BF16", [2, H], n, 0), "shape does not match"),
        ((rid, "BF16", [4, H, 1], n, 0), "shape does not match"),
        ((rid, "BF16", "4,64", n, 0), "shape does not match"),
        ((rid, "FP16", [4, H], n, 0), "datatype does not match the region's (BF16)"),
        ((rid + "x", "BF16", [4, H], n, 0), "unknown shared_memory_region"),
        ((None, "BF16", [4, H], n, 0), "unknown shared_memory_region"),
        ((["a"], "BF16", [4, H], n, 0), "unknown shared_memory_region"),
    ]
    for args, words in cases:
        with pytest.raises(RegionError) as e:
            env.registry.lease(*args)
        assert words in str(e.value) and rid not in str(e.value)
    assert env.registry._regions[rid].leases == 0
    c = counters.stats()
    assert c["region_lease_refused.mismatch"] == 7 and c["region_lease_refused.offset"] == 3
    assert c["region_lease_refused.unknown"] == 3
    env.registry.lease(rid, "BF16", (4, H), n, 0).release()


# ---------------------------------------------------------------- TTL


def test_idle_expiry(env):
    env.start(idle_ttl_s=30.0)
    sock = env.connect()
    t = torch.randn(2, H)
    a = env.register(sock, t)["region"]
    b = env.register(sock, t)["region"]
    lease = env.registry.lease(b, "FP32", [2, H], t.nbytes, 0)
    now = time.monotonic()
    assert env.registry.expire(now) == 0
    assert env.registry.expire(now + 31) == 1  # a; b is leased
    with pytest.raises(RegionError, match="unknown"):
        env.registry.lease(a, "FP32", [2, H], t.nbytes, 0)
    released_at = time.monotonic()
    lease.release()  # counts as a use
    assert lease.region.last_used >= released_at
    assert env.registry.expire(time.monotonic() + 20) == 0
    assert env.registry.expire(time.monotonic() + 31) == 1
    assert env.registry.stats()["regions"] == 0
    assert counters.stats()["region_unregistered.idle"] == 2
    env.refused(env.request(sock, {"op": "unregister", "region": a}), "unknown")


def test_server_thread_expires(env, monkeypatch):
    monkeypatch.setattr(rs, "EXPIRE_EVERY_S", 0.05)
    env.start(idle_ttl_s=0.1)
    sock = env.connect()
    env.register(sock, torch.randn(2, H))
    wait_until(lambda: env.registry.stats()["regions"] == 0, 5, "no region registered")


# ---------------------------------------------------------------- the socket file


def test_socket_file(env, tmp_path):
    env.start()
    st = os.stat(env.path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    # a second server on a live socket refuses to start
    other = rs.RegionServer(env.path, env.registry)
    with pytest.raises(OSError) as e:
        other.start()
    assert e.value.errno == errno.EADDRINUSE
    env.server.close()
    env.server.close()  # idempotent
    assert not os.path.exists(env.path)
    env.server = None

    # a stale socket (nobody listens) is replaced
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(env.path)
    stale.close()
    group = grp.getgrgid(os.getgid()).gr_name
    env.server = rs.RegionServer(env.path, env.registry, group=group)
    env.server.start()
    st = os.stat(env.path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()
    env.check_good_registration(env.connect())
    env.server.close()

    # a path that is not a socket is never replaced
    p = tmp_path / "not-a-socket"
    p.write_text("keep me")
    with pytest.raises(FileExistsError):
        rs.RegionServer(str(p), env.registry).start()
    assert p.read_text() == "keep me"
    with pytest.raises(ValueError, match="group"):
        rs.RegionServer(str(tmp_path / "g.sock"), env.registry,
                        group="no-such-group-shm-embeds").start()
    assert not os.path.exists(tmp_path / "g.sock")


def test_server_close_unregisters_connections(env):
    env.start()
    sock = env.connect()
    t = torch.randn(2, H)
    env.register(sock, t)
    env.server.close()
    assert env.registry.stats()["regions"] == 0
    assert counters.stats()["region_unregistered.close"] == 1
    assert sock.recv(10) == b""  # the server closed the connection


@pytest.mark.parametrize("cap", ["server", "producer"])
def test_max_connections(env, monkeypatch, cap):
    """At most ``max_connections`` producer connections at once, and one
    producer process (a pid) holds at most ``MAX_CONNECTIONS_PER_PRODUCER`` of
    them; a slot freed is taken again."""
    if cap == "producer":
        monkeypatch.setattr(rs, "MAX_CONNECTIONS_PER_PRODUCER", 2)
    env.start(max_connections=2 if cap == "server" else 64)
    a, b = env.connect(), env.connect()
    env.check_good_registration(a)
    c = env.connect()
    assert json.loads(c.recv(1 << 16)) == {"error": "too many connections" + (
        " from this process" if cap == "producer" else "")}
    assert c.recv(10) == b""
    assert counters.stats()["region_refused." + (
        "producer_connections" if cap == "producer" else "connections")] == 1
    env.check_good_registration(b)
    a.close()
    wait_until(lambda: len(env.server._conns) == 1, 5, "one connection open")
    env.check_good_registration(env.connect())


def test_lookup_only_for_sibling_api_servers(env):
    """The internal ``lookup`` op hands a region's fd to a sibling API server
    (same uid and parent) only: a producer asking for it is refused."""
    env.start()
    sock = env.connect()
    t = torch.randn(4, H)
    rid = env.register(sock, t)["region"]
    env.refused(env.request(sock, {"op": "lookup", "region": rid}), "unknown op")
    # two siblings (children of this process): one serves, the other mirrors
    ctx = mp.get_context("fork")
    env.server.close()
    env.server = None
    ready, done = ctx.Event(), ctx.Event()
    out = ctx.Queue()

    def serve():
        reg = RegionRegistry(_limits())
        srv = rs.RegionServer(env.path, reg)
        srv.start()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(env.path)
        s.sendmsg([json.dumps({"op": "register", "datatype": "FP32",
                               "shape": [4, H]}).encode()],
                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                    array.array("i", [memfd(tensor_bytes(t))]).tobytes())])
        out.put(json.loads(s.recv(1 << 16))["region"])
        ready.set()
        done.wait(60)
        s.close()
        srv.close()
        reg.close()

    def mirror(region_id):
        from vllm._shm_embeds.ext.regions.mirror import RegionMirror

        m = RegionMirror(env.path, _limits())
        try:
            lease = m.lease(region_id, "FP32", [4, H], t.nbytes, 0)
            holder = m.find(lease.tensor)
            same = torch.equal(lease.tensor, t)
            lease.release()
            try:
                m.lease("x" * 22, "FP32", [4, H], t.nbytes, 0)
                unknown = None
            except ValueError as e:
                unknown = str(e)
            out.put((same, holder is not None and holder[0] == os.getpid(), unknown))
        finally:
            m.close()

    server = ctx.Process(target=serve)
    server.start()
    try:
        assert ready.wait(30)
        region_id = out.get(timeout=10)
        client = ctx.Process(target=mirror, args=(region_id,))
        client.start()
        client.join(60)
        assert client.exitcode == 0
        same, holder_is_mirror, unknown = out.get(timeout=10)
        assert same and holder_is_mirror and unknown == "unknown shared_memory_region"
    finally:
        done.set()
        server.join(30)
    assert server.exitcode == 0


# ---------------------------------------------------------------- review fixes


def test_model_datatype_only(env):
    env.start(datatype="BF16")
    sock = env.connect()
    env.refused(env.register(sock, torch.randn(2, H)), "datatype must be the model's, BF16",
                "got FP32")
    env.refused(env.register(sock, torch.randn(2, H, dtype=torch.float16)), "BF16")
    assert counters.stats()["region_refused.datatype"] == 2
    env.check_good_registration(sock)  # BF16
    assert RegionLimits.from_config(H, MAX_T).datatype is None
    assert RegionLimits.from_config(H, MAX_T, "FP16").datatype == "FP16"
    with pytest.raises(ValueError):
        RegionLimits.from_config(H, MAX_T, "INT8")


def _blocking_hook():
    """An on_registered that waits for ``release``; ``calls`` counts its entries."""
    calls, release = [], threading.Event()

    def hook(tensor):
        calls.append(tensor.shape)
        assert release.wait(30)
    return hook, calls, release


def test_registration_runs_off_the_socket_thread(env):
    hook, calls, release = _blocking_hook()
    env.start(on_registered=hook)
    a, b = env.connect(), env.connect()
    t = torch.randn(2, H)
    try:
        # a: a registration, and at once a second message, answered after it
        env.send(a, {"op": "register", "datatype": "FP32", "shape": [2, H]},
                 [memfd(tensor_bytes(t))])
        env.send(a, {"op": "unregister", "region": "x"})
        wait_until(lambda: calls, 5, "a registration running")
        b.settimeout(2)  # b is answered while a's registration runs
        env.refused(env.request(b, b"not json"), "malformed")
        assert env.request(b, {"op": "unregister", "region": "x"})["error"].startswith(
            "unknown")
        assert threading.current_thread().name == "MainThread"
    finally:
        release.set()
    reply = env.reply(a)
    assert set(reply) == {"region", "byte_size"}
    env.refused(env.reply(a), "unknown")
    assert env.request(a, {"op": "unregister", "region": reply["region"]}) == {"ok": True}


def test_registration_of_a_connection_closed_meanwhile_is_unregistered(env):
    hook, calls, release = _blocking_hook()
    env.start(on_registered=hook)
    a = env.connect()
    env.send(a, REG, [memfd(GOOD)])
    wait_until(lambda: calls, 5, "a registration running")
    a.close()
    release.set()
    wait_until(lambda: counters.stats().get("region_unregistered.disconnect") == 1, 5,
               "the region unregistered at the disconnect")
    assert env.registry.stats()["regions"] == 0 and not env.server._conns
    env.check_good_registration(env.connect())


def test_server_close_waits_for_registrations(env):
    hook, calls, release = _blocking_hook()
    env.start(on_registered=hook)
    socks = [env.connect() for _ in range(rs.REGISTER_WORKERS + 1)]
    for s in socks:
        env.send(s, REG, [memfd(GOOD)])
    # every worker busy, one registration queued
    wait_until(lambda: len(calls) == rs.REGISTER_WORKERS
               and env.server._pool._work_queue.qsize() == 1, 5,
               "every registration worker busy and one registration queued")
    closing = threading.Thread(target=env.server.close)
    closing.start()
    wait_until(lambda: env.server._stop, 5, "the server stopping")
    time.sleep(0.2)
    assert closing.is_alive()  # waits for the registrations running
    release.set()
    closing.join(10)
    assert not closing.is_alive()
    replies = [env.reply(s) for s in socks]
    assert sum("region" in r for r in replies) == rs.REGISTER_WORKERS
    assert [r for r in replies if "error" in r] == [{"error": "the server is shutting down"}]
    for s in socks:
        assert s.recv(10) == b""
    assert len(calls) == rs.REGISTER_WORKERS  # the queued one never hashed
    assert env.registry.stats() == {"regions": 0, "bytes": 0, "draining": 0, "leases": 0,
                                    "per_uid": {}}
    c = counters.stats()
    assert c["region_unregistered.close"] == rs.REGISTER_WORKERS
    assert c["region_refused.closed"] == 1
    assert env.server._wake is None


@pytest.mark.parametrize("make_fd", [_regular_file, _dev_shm_file, _pipe])
@pytest.mark.parametrize("op", ["register", "unregister"])
def test_no_io_on_fds_that_are_not_memfds(env, monkeypatch, make_fd, op):
    """No ``fstat`` of a received fd before it is known to be a memfd, and no
    ``close`` of one that is not, but on the closer thread (FUSE: GETATTR and
    FLUSH may never be answered)."""
    env.start()
    sock = env.connect()
    fd = make_fd(env.tmp_path)
    target = os.readlink(f"/proc/self/fd/{fd}")
    seen = []
    real_fstat, real_close = os.fstat, os.close

    def record(call, fd):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except (OSError, TypeError):
            link = None
        if link == target and threading.current_thread().name != "MainThread":
            seen.append((call, threading.current_thread().name))

    def fstat(fd, *args, **kw):
        record("fstat", fd)
        return real_fstat(fd, *args, **kw)

    def close(fd):
        record("close", fd)
        return real_close(fd)

    monkeypatch.setattr(os, "fstat", fstat)
    monkeypatch.setattr(os, "close", close)
    msg = REG if op == "register" else {"op": "unregister", "region": "x"}
    env.refused(env.request(sock, msg, [fd]), "not a memfd")
    wait_until(lambda: seen, 2, "the fd closer's first call")
    assert seen == [("close", "shm-embeds-fd-closer")]
    monkeypatch.undo()
    assert sock.recv(10) == b""  # and the peer closed
    env.check_good_registration(env.connect())


def test_connection_slots(env, monkeypatch):
    env.start(max_connections=2, allowed_uids=frozenset({os.getuid() + 4242}))
    for _ in range(3):  # a uid not allowed: one answer, then closed: no slot held
        s = env.connect()
        s.settimeout(2)
        env.refused(env.reply(s), "may not register")
        assert s.recv(10) == b""
    env.registry.limits = _limits()  # this uid allowed from now on
    # sibling API servers take no slot
    monkeypatch.setattr(rs, "is_sibling", lambda pid, uid: True)
    for s in [env.connect() for _ in range(3)]:
        env.refused(env.request(s, b"x"), "malformed")
    monkeypatch.setattr(rs, "is_sibling", lambda pid, uid: False)
    a, b = env.connect(), env.connect()
    env.check_good_registration(a)
    env.check_good_registration(b)
    c = env.connect()
    assert json.loads(c.recv(1 << 16)) == {"error": "too many connections"}
    assert c.recv(10) == b""
    assert counters.stats()["region_refused.connections"] == 1


class _HookLock:
    """A lock that runs ``hook`` once, right after its first release."""

    def __init__(self, lock, hook):
        self.lock, self.hook = lock, hook

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()


def test_idle_expiry_never_drops_a_region_leased_meanwhile(env):
    env.start(idle_ttl_s=30.0)
    sock = env.connect()
    t = torch.randn(2, H)
    rid = env.register(sock, t)["region"]
    leases = []

    def lease_now():  # a request between expiry's lock acquisitions, if it had two
        try:
            leases.append(env.registry.lease(rid, "FP32", [2, H], t.nbytes, 0))
        except RegionError:
            pass

    lock = env.registry._lock
    env.registry._lock = _HookLock(lock, lease_now)
    try:
        expired = env.registry.expire(time.monotonic() + 31)
    finally:
        env.registry._lock = lock
    if leases:  # leased before the expiry decided: then it is not expired
        assert expired == 0 and leases[0].region.registered
        leases[0].release()
    else:
        assert expired == 1 and env.registry.stats()["regions"] == 0


def test_lookup_reply_drops_extras_over_128_kib(env, monkeypatch):
    extra = {}
    env.start(describe=lambda tensor: extra)
    monkeypatch.setattr(rs, "is_sibling", lambda pid, uid: True)
    sock = env.connect()
    t = torch.randn(2, H)
    rid = env.register(sock, t)["region"]
    for fields, sent in (({"digests": "ab"}, {"digests": "ab"}),
                         ({"digests": "x" * 300_000}, {})):
        extra.clear()
        extra.update(fields)
        sock.send(json.dumps({"op": "lookup", "region": rid}).encode())
        data, anc, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(4 * 4))
        fds = rs.received_fds(anc)
        try:
            assert len(fds) == 1 and _is_memfd(fds[0])
        finally:
            for fd in fds:
                os.close(fd)
        assert json.loads(data) == {"datatype": "FP32", "shape": [2, H],
                                    "byte_size": t.nbytes, **sent}
    assert counters.stats()["region_lookup_trimmed"] == 1
    lease = env.registry.lease(rid, "FP32", [2, H], t.nbytes, 0)
    try:  # the lookups' leases are released right after their answers were sent
        wait_until(lambda: lease.region.leases == 1, 5, "one lease of the region")
    finally:
        lease.release()


def test_peer_is_sibling(tmp_path):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        assert not rs.peer_is_sibling(a)  # this process itself
    ctx = mp.get_context("fork")

    def connect(path):  # stays connected until the listener closes
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path)
        s.settimeout(30)
        s.recv(10)

    # a child of this process is not its sibling
    path = str(tmp_path / "a.sock")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with lst:
        lst.bind(path)
        lst.listen(1)
        child = ctx.Process(target=connect, args=(path,))
        child.start()
        conn, _ = lst.accept()
        with conn:
            assert rs.peer_cred(conn) == (child.pid, os.getuid())
            assert not rs.peer_is_sibling(conn)
        child.join(30)
        assert child.exitcode == 0

    # two children of this process are siblings
    path = str(tmp_path / "b.sock")
    out, listening = ctx.Queue(), ctx.Event()

    def listen():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(path)
        s.listen(1)
        listening.set()
        peer, _ = s.accept()
        out.put((rs.peer_cred(peer)[0], rs.peer_is_sibling(peer)))
        peer.close()

    server = ctx.Process(target=listen)
    server.start()
    assert listening.wait(30)
    client = ctx.Process(target=connect, args=(path,))
    client.start()
    assert out.get(timeout=30) == (client.pid, True)
    for p in (server, client):
        p.join(30)
        assert p.exitcode == 0
