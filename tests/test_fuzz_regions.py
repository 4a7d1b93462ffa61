# SPDX-License-Identifier: Apache-2.0
# ruff: noqa: F811  (the env fixture, imported from test_regions)
"""Fuzz targets for registered regions (hypothesis).

* :class:`RegistryMachine`: ``RegionRegistry`` as a stateful machine
  (register, lease, release, unregister, expire, close) against a model:
  per-uid counts and bytes, leases, regions freed exactly once, and every
  region's fd open exactly while it is not freed.
* :func:`test_server_random_messages`: a ``RegionServer`` fed random messages
  with random fd sets (memfds with various seals and sizes, pipes, sockets):
  every message is answered or the peer closed, and the process ends with
  the fds it started with (the ``env`` fixture checks).

Under the "ci" profile each runs a few seconds; ``SHM_EMBEDS_FUZZ=long``
runs them longer (``SHM_EMBEDS_FUZZ_EXAMPLES``).
"""

import array
import fcntl
import json
import os
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)
from test_regions import ALL_SEALS, MAX_T, H, _limits, env, memfd  # noqa: F401

from vllm._shm_embeds import counters
from vllm._shm_embeds.ext.regions.registry import RegionError, RegionRegistry

CI = settings.default.max_examples <= 1000  # the "ci" profile: keep each target short
UIDS = (os.getuid(), os.getuid() + 1)
F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; not in Python 3.11's fcntl
SEALS = st.sampled_from([ALL_SEALS, 0, ALL_SEALS & ~fcntl.F_SEAL_WRITE,
                         ALL_SEALS & ~fcntl.F_SEAL_SEAL, ALL_SEALS | F_SEAL_FUTURE_WRITE])
DATATYPES = st.sampled_from(["FP32", "FP16", "BF16", "INT8", None])
ITEM = {"FP32": 4, "FP16": 2, "BF16": 2}
REGISTERED = []  # one item per successful registration (the run must make some)


def _fd_is(fd: int, inode: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:") and \
            os.fstat(fd).st_ino == inode
    except OSError:
        return False


class RegistryMachine(RuleBasedStateMachine):
    regions = Bundle("regions")
    leases = Bundle("leases")

    def __init__(self):
        super().__init__()
        counters._state = counters._Counters()
        self.registry = RegionRegistry(_limits(allowed_uids=frozenset({UIDS[0]}),
                                               max_leases=3))
        self.model = {}  # region -> {"registered", "leases", "freed"}
        self.open = []  # leases not released
        self.closed = False

    @rule(target=regions, uid=st.sampled_from(UIDS[:1] * 4 + UIDS[1:]),
          datatype=st.sampled_from(["FP32", "BF16"]) | DATATYPES,
          t=st.integers(1, 8) | st.integers(-1, MAX_T + 1),
          extra=st.sampled_from([0] * 7 + [4]),
          seals=st.just(ALL_SEALS) | SEALS)
    def register(self, uid, datatype, t, extra, seals):
        n = max(t, 0) * H * ITEM.get(datatype, 4) + extra
        fd = memfd(bytes(n), seals)
        try:
            region = self.registry.register(fd, uid, datatype, [t, H])
        except RegionError:
            return None
        assert not self.closed and uid == UIDS[0] and seals & ALL_SEALS == ALL_SEALS
        assert extra == 0 and 1 <= t <= MAX_T
        self.model[region] = {"registered": True, "leases": 0, "freed": False}
        REGISTERED.append(1)
        return region

    @rule(target=leases, region=regions, exact=st.booleans())
    def lease(self, region, exact):
        if region is None:
            return None
        m = self.model[region]
        shape = list(region.shape) if exact else [region.shape[0] + 1, H]
        try:
            lease = self.registry.lease(region.id, region.datatype, shape, region.nbytes, 0)
        except RegionError as e:
            assert not exact or not m["registered"] or e.reason == "leases"
            assert e.reason != "leases" or self._leases() == 3
            return None
        assert exact and m["registered"]
        m["leases"] += 1
        self.open.append(lease)
        return lease

    @rule(lease=consumes(leases))
    def release(self, lease):
        if lease is None:
            return
        m = self.model[lease.region]
        self.open.remove(lease)
        lease.release()
        lease.release()  # a second release is a no-op
        m["leases"] -= 1
        if not m["registered"] and not m["leases"]:
            m["freed"] = True

    @rule(region=regions)
    def unregister(self, region):
        if region is None:
            return
        m = self.model[region]
        try:
            self.registry.unregister(region.id, uid=region.uid)
        except RegionError:
            assert not m["registered"]
            return
        assert m["registered"]
        self._drop(m)

    @rule(late=st.booleans())
    def expire(self, late):
        n = self.registry.expire(now=1e12 if late else None)
        if late:  # far beyond the TTL: every registered region without a lease goes
            idle = [m for m in self.model.values() if m["registered"] and not m["leases"]]
            assert n == len(idle)
            for m in idle:
                self._drop(m)

    @rule()
    def close(self):
        self.registry.close()
        self.closed = True
        for m in self.model.values():
            if m["registered"]:
                self._drop(m)

    def _drop(self, m):
        m["registered"] = False
        if not m["leases"]:
            m["freed"] = True

    def _leases(self):
        return sum(m["leases"] for m in self.model.values())

    @invariant()
    def consistent(self):
        stats = self.registry.stats()
        live = [r for r, m in self.model.items() if not m["freed"]]
        want = {}
        for r in live:
            held = want.setdefault(r.uid, {"regions": 0, "bytes": 0})
            held["regions"] += 1
            held["bytes"] += r.nbytes
        assert stats["per_uid"] == want
        assert stats["regions"] == sum(m["registered"] for m in self.model.values())
        assert stats["leases"] == self._leases()
        freed = sum(m["freed"] for m in self.model.values())
        assert counters.stats().get("regions_freed", 0) == freed  # each freed once
        for r, m in self.model.items():  # no fd leaked, none closed early
            assert _fd_is(r.fd, r.inode) == (not m["freed"])

    def teardown(self):
        self.registry.close()
        for lease in self.open:  # leases the run left: then every fd must be closed
            lease.release()
        for r in self.model:
            assert not _fd_is(r.fd, r.inode)


def test_registry_state_machine(monkeypatch):
    monkeypatch.delenv("VLLM_SHM_EMBEDS_STATS_DIR", raising=False)
    REGISTERED.clear()
    saved = counters._state
    try:
        run_state_machine_as_test(RegistryMachine, settings=settings(
            settings.default, max_examples=150 if CI else settings.default.max_examples,
            stateful_step_count=25))
    finally:
        counters._state = saved
    assert len(REGISTERED) >= 10, len(REGISTERED)  # the machine really exercised regions


# ---------------------------------------------------------------- the socket server


def _make_fd(kind: str, t: int, seals: int) -> int:
    if kind == "memfd":
        return memfd(bytes(t * H * 4), seals)
    if kind == "pipe":
        r, w = os.pipe()
        os.close(w)
        return r
    a, b = socket.socketpair()
    b.close()
    return a.detach()


MESSAGES = st.one_of(
    st.fixed_dictionaries({"op": st.just("register"), "datatype": DATATYPES,
                           "shape": st.lists(st.integers(-2, MAX_T + 2), max_size=3)}),
    st.fixed_dictionaries({"op": st.sampled_from(["unregister", "lookup"]),
                           "region": st.one_of(st.text(max_size=30), st.integers())}),
    st.dictionaries(st.text(max_size=8), st.integers(), max_size=3),
).map(lambda m: json.dumps(m).encode()) | st.binary(max_size=64)
FDSETS = st.lists(st.tuples(st.sampled_from(["memfd", "memfd", "pipe", "socket"]),
                            st.integers(1, 4), SEALS), max_size=3)


@given(steps=st.lists(st.tuples(MESSAGES, FDSETS), min_size=1, max_size=6))
@settings(max_examples=60 if CI else settings.default.max_examples)
def test_server_random_messages(env, steps):
    if env.server is None:
        env.start()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(2)
        sock.connect(env.path)
        for data, fdset in steps:
            fds = [_make_fd(*spec) for spec in fdset]
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
            try:
                sock.sendmsg([data], anc if fds else [])
            except (BrokenPipeError, ConnectionResetError):
                return  # closed by the server after an earlier answer
            finally:
                for fd in fds:
                    os.close(fd)
            reply = sock.recv(1 << 17)  # answered, or closed: never silent
            if not reply:
                return
            answer = json.loads(reply)
            assert set(answer) in ({"error"}, {"region", "byte_size"}, {"ok"}), answer
            if any(kind != "memfd" for kind, _, _ in fdset):  # every fd is installed
                assert "error" in answer and sock.recv(10) == b""  # the peer is closed
                return
    finally:
        sock.close()


@pytest.fixture(autouse=True)
def _fresh_counters(monkeypatch):
    monkeypatch.setattr(counters, "_state", counters._Counters())
