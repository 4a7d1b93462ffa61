# SPDX-License-Identifier: Apache-2.0
# ruff: noqa: F811  (the env fixture, imported from test_regions)
"""The region socket and region references, tried as an attacker would.

What each test rules out: too many fds installed per message, a peer that
sends a pipe kept, the closer backlog unbounded, a disallowed peer holding
its connection, no idle timeout, chmod through a link, a squatted start-up
lock that blocks start-up for 30 s, regions on without
``--enable-prompt-embeds``, no cap on references per request or leases per
process, a producer that hands its memfd to whoever serves the socket, and a
peer's fds released by the kernel on the regions thread (the extras of a
message, the unread messages of a closed connection), where a lingering
socket's close would block everyone. No vLLM engine.
"""

import asyncio
import errno
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch
from helpers import LingeringSockets, new_fds, open_fds, set_limits, wait_until
from test_regions import GOOD, MAX_T, REG, H, _limits, env, memfd  # noqa: F401

import shm_embeds_client as sec
from vllm._shm_embeds import counters
from vllm._shm_embeds.ext.binary import gate
from vllm._shm_embeds.ext.regions import region_refs
from vllm._shm_embeds.ext.binary.common import COMPLETIONS, ServerContext
from vllm._shm_embeds.lifetime import process
from vllm._shm_embeds.ext.regions import server as rs
from vllm._shm_embeds.ext.regions import service
from vllm._shm_embeds.files import sockets as rsock
from vllm._shm_embeds.ext.regions.registry import RegionError, RegionRegistry

NOBODY = 65534


def _pipe_fd():
    r, w = os.pipe()
    os.close(w)
    return r


@pytest.mark.parametrize("n", [2, 40, rsock.SCM_MAX_FD])
def test_every_fd_of_a_message_installed_and_closed_off_thread(env, monkeypatch, n):
    """Room for every fd a message can carry (with room for one, the kernel
    would close the others on the regions thread); those not asked for are
    closed on the closer thread, memfds too, and none leaks."""
    got, closed_later = [], []
    real, real_later = rs.received_fds, rsock.close_fd_later
    monkeypatch.setattr(rs, "received_fds", lambda anc: got.append(real(anc)) or got[-1])
    monkeypatch.setattr(rsock, "close_fd_later",
                        lambda fd: closed_later.append(fd) or real_later(fd))
    env.start()
    sock = env.connect()
    env.refused(env.request(sock, {"op": "unregister", "region": "x"}), "unknown")
    before = open_fds()  # the server's own: selector, this connection
    got.clear()
    env.refused(env.request(sock, REG, [memfd(GOOD) for _ in range(n)]),
                "too many file descriptors", f"got {n}")
    assert [len(fds) for fds in got] == [n]  # all installed here
    assert sorted(closed_later) == sorted(got[0])  # and closed there
    wait_until(lambda: not new_fds(before), 2, lambda: f"every fd closed: {new_fds(before)}")
    env.check_good_registration(sock)  # a plain refusal: the connection stays


def test_more_fds_than_a_message_can_carry(env):
    """254 fds: the producer's ``sendmsg`` fails (EINVAL), nothing is sent."""
    env.start()
    sock = env.connect()
    with pytest.raises(OSError) as e:
        env.send(sock, REG, [memfd(GOOD) for _ in range(rsock.SCM_MAX_FD + 1)])
    assert e.value.errno == errno.EINVAL
    env.check_good_registration(sock)


@pytest.mark.parametrize("op", [REG, {"op": "unregister", "region": "x"}, {"op": "x"}])
def test_peer_sending_a_non_memfd_is_closed(env, op):
    env.start()
    sock = env.connect()
    sock.settimeout(3)
    env.refused(env.request(sock, op, [_pipe_fd()]), "not a memfd")
    assert sock.recv(10) == b""  # closed: each such fd costs the closer thread a close
    assert counters.stats()["region_refused.not_memfd"] == 1
    env.check_good_registration(env.connect())


def test_closer_backlog_is_bounded(env, monkeypatch):
    """A closer stuck on a FUSE close: once its backlog is full, no fd is
    installed and the peer that sent one is answered and closed; its message
    stays unread (the kernel would release its fds here) and its socket waits,
    shut down, until the closer takes it (here: when the server closes)."""
    stuck = queue.Queue()  # nobody takes from it: a closer blocked forever
    held = [_pipe_fd() for _ in range(2)]
    for fd in held:
        stuck.put(fd)
    monkeypatch.setattr(rsock, "CLOSER_BACKLOG", 2, raising=False)
    monkeypatch.setattr(rsock, "_closer", stuck)
    try:
        env.start()
        for _ in range(3):
            sock = env.connect()
            sock.settimeout(3)
            reply = env.request(sock, REG, [_pipe_fd()])
            assert "error" in reply and "region" not in reply
            assert sock.recv(10) == b""
        assert stuck.qsize() == 2  # nothing more queued: the backlog stays bounded
        wait_until(lambda: len(env.server._unread) == 3, 2, "three connections unread")
        assert counters.stats()["region_refused.closer_busy"] == 3
        sock = env.connect()  # messages without fds are still served
        env.refused(env.request(sock, {"op": "unregister", "region": "x"}), "unknown")
        env.server.close()
        assert stuck.qsize() == 2 + 3  # the three connections, closed by the closer
    finally:
        if env.server is not None:
            env.server.close()
        while not stuck.empty():
            os.close(stuck.get())


def test_disallowed_peer_closed_at_accept(env):
    env.start(allowed_uids=frozenset({os.getuid() + 4242}))
    sock = env.connect()
    sock.settimeout(3)  # it sends nothing: still answered and closed at once
    env.refused(env.reply(sock), "may not register")
    assert sock.recv(10) == b""
    assert not env.server._conns
    assert counters.stats()["region_refused.uid"] == 1


def test_idle_connection_closed(env, monkeypatch):
    set_limits(monkeypatch, REGIONS_IDLE_S=0.3)
    monkeypatch.setattr(rs, "EXPIRE_EVERY_S", 0.1)
    env.start()
    idle, producer = env.connect(), env.connect()
    reply = env.register(producer, torch.randn(2, H))
    idle.settimeout(5)
    assert idle.recv(10) == b""  # held no region, sent nothing: closed
    time.sleep(0.5)  # a connection that holds a region stays (its TTL governs it)
    env.registry.lease(reply["region"], "FP32", [2, H], 2 * H * 4, 0).release()
    assert producer in env.socks and len(env.server._conns) == 1
    assert counters.stats()["region_refused.idle_connection"] == 1


def test_chmod_and_chown_never_follow_a_link(env, monkeypatch, tmp_path):
    """Between ``bind`` and the mode change, the path is swapped for a link to
    a file of the server's user (a group-writable socket directory)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"x")
    os.chmod(victim, 0o644)
    real_socket = socket.socket

    class Swapping(real_socket):
        def bind(self, address):
            super().bind(address)
            if address == env.path:
                os.rename(env.path, env.path + ".moved")
                os.symlink(victim, env.path)

    monkeypatch.setattr(socket, "socket", Swapping)
    try:
        with pytest.raises(OSError):
            env.start(group=str(os.getgid()))
        env.server = None
    finally:
        monkeypatch.setattr(socket, "socket", real_socket)
        for p in (env.path, env.path + ".moved"):
            if os.path.lexists(p):
                os.unlink(p)
    assert os.stat(victim).st_mode & 0o777 == 0o644


def _ctx(enable=True):
    return ServerContext(H, MAX_T, torch.float32, enable, 1 << 20)


def _squat_listening_as_nobody(name: str) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import os, socket, sys, time
        os.setgid({NOBODY}); os.setuid({NOBODY})
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind({name!r}); s.listen(4)
        print("ready", flush=True); time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.parametrize("squatter", ["bound", "listening_other_uid"])
def test_squatted_start_up_lock_neither_blocks_nor_stops_regions(env, monkeypatch, squatter):
    if squatter == "listening_other_uid" and os.getuid() != 0:
        pytest.skip("needs root to run a squatter as another uid")
    import hashlib
    key = hashlib.sha256(os.path.realpath(env.path).encode()).hexdigest()[:32]
    names = [f"\0vllm-shm-embeds-regions.{key}",  # the lock's name without uid and try
             f"\0vllm-shm-embeds-regions.{os.getuid()}.{key}.0"]
    squats, procs = [], []
    for name in names:
        if squatter == "bound":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.bind(name)
            squats.append(s)
        else:
            procs.append(_squat_listening_as_nobody(name))
    monkeypatch.setattr(process.current(), "holders", [])
    server = None
    try:
        start = time.monotonic()
        server = service.start_regions(env.path, _ctx())
        assert time.monotonic() - start < 3
        assert server is not None and service.current() is not None
        assert "region" in env.register(env.connect(), torch.randn(2, H))
    finally:
        service.stop_regions(server)
        for s in squats:
            s.close()
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()


def test_regions_off_without_enable_prompt_embeds(env, monkeypatch):
    monkeypatch.setenv("VLLM_SHM_EMBEDS_REGIONS", env.path)
    monkeypatch.setattr(ServerContext, "of_app", classmethod(lambda cls, scope: _ctx(False)))
    monkeypatch.setattr(process.current(), "holders", [])
    fmt = region_refs.RegionRefsFormat()
    fmt.startup({"type": "lifespan"})
    try:
        assert fmt.server is None and service.current() is None
        assert not os.path.exists(env.path)
    finally:
        fmt.shutdown()


def _ref(rid, t=2):
    return {"datatype": "FP32", "shape": [t, H],
            "parameters": {"shared_memory_region": rid, "shared_memory_byte_size": t * H * 4}}


def test_region_references_per_request_capped(env, monkeypatch):
    set_limits(monkeypatch, REGIONS_REFS_MAX=3)
    env.start()
    rid = env.register(env.connect(), torch.randn(2, H))["region"]
    upload = region_refs.lease_refs(COMPLETIONS, {"prompt_embeds": [_ref(rid)] * 3},
                                    env.registry)
    upload.release()
    with pytest.raises(RegionError, match="at most 3 per request") as e:
        region_refs.lease_refs(COMPLETIONS, {"prompt_embeds": [_ref(rid)] * 4}, env.registry)
    assert e.value.reason == "refs"
    assert env.registry.stats()["leases"] == 0


def test_live_leases_per_process_capped(tmp_path):
    registry = RegionRegistry(_limits(max_leases=2))
    try:
        fd = memfd(GOOD)
        region = registry.register(fd, os.getuid(), "FP32", [2, H])
        leases = [registry.lease(region.id, "FP32", [2, H], len(GOOD), 0) for _ in range(2)]
        with pytest.raises(RegionError, match="most allowed") as e:
            registry.lease(region.id, "FP32", [2, H], len(GOOD), 0)
        assert e.value.reason == "leases"
        leases.pop().release()
        leases.append(registry.lease(region.id, "FP32", [2, H], len(GOOD), 0))
        for lease in leases:
            lease.release()
        assert registry.stats()["leases"] == 0
    finally:
        registry.close()


def test_leases_cap_is_429_at_the_http_layer(env, monkeypatch):
    env.start(max_leases=1)
    rid = env.register(env.connect(), torch.randn(2, H))["region"]
    held = env.registry.lease(rid, "FP32", [2, H], 2 * H * 4, 0)
    monkeypatch.setattr(process.current(), "holders", [env.registry])
    body = json.dumps({"model": "m", "prompt_embeds": _ref(rid)}).encode()
    scope = {"type": "http", "method": "POST", "path": COMPLETIONS, "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    sent, called = [], []

    async def app(scope, receive, send):
        called.append(1)

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    try:
        asyncio.run(gate.BodyGate(app, [region_refs.RegionRefsFormat()])(scope, receive, send))
    finally:
        held.release()
    assert not called and sent[0]["status"] == 429
    assert env.registry.stats()["leases"] == 0


def test_producer_checks_the_servers_uid(tmp_path):
    """A socket served by another uid gets no memfd from a producer."""
    if os.getuid() != 0:
        pytest.skip("needs root to serve as another uid")
    d = tempfile.mkdtemp(prefix="shm-embeds-test-")  # nobody can reach it
    os.chmod(d, 0o777)
    path = os.path.join(d, "regions.sock")
    code = textwrap.dedent(f"""
        import os, socket, time
        os.setgid({NOBODY}); os.setuid({NOBODY})
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind({path!r}); os.chmod({path!r}, 0o666); s.listen(1)
        print("ready", flush=True)
        c, _ = s.accept(); c.settimeout(3)
        try:
            _, anc, _, _ = c.recvmsg(1 << 16, socket.CMSG_SPACE(64))
        except OSError:
            anc = []
        print("fds", sum(len(a[2]) // 4 for a in anc), flush=True)
        time.sleep(60)  # still listening for the second client (killed below)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        with pytest.raises(PermissionError, match="served by uid 65534"):
            client = sec.RegionClient(path, timeout=5)
            client.register(torch.randn(2, 4))  # must refuse before the memfd is sent
        assert p.stdout.readline().split() == ["fds", "0"]
        client = sec.RegionClient(path, timeout=5, server_uid=NOBODY)  # as asked
        client.close()
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
        shutil.rmtree(d)


# ------------------------------- no peer's fd closed on the regions thread

def _close_blocks(linger_s: int) -> float:
    """Seconds the last ``close`` of a :class:`LingeringSockets` socket took."""
    lingering = LingeringSockets(1, linger_s)
    start = time.monotonic()
    os.close(lingering.fds[0])
    took = time.monotonic() - start
    lingering.release()
    return took


def test_lingering_sockets_block_their_close():
    """The attack's premise: such a close blocks for its linger time."""
    assert _close_blocks(1) > 0.8


def test_extra_fds_never_closed_on_the_regions_thread(env):
    """A producer sends one memfd and two lingering TCP sockets with a
    registration: were they closed on the regions thread (2 x 8 s, as the
    kernel does with a message's fds there is no room for), another
    producer's registration would get no answer within 2 s."""
    env.start()
    victim = env.connect()
    lingering = LingeringSockets(2)
    try:
        attacker = env.connect()
        attacker.settimeout(20)
        env.send(attacker, REG, [memfd(GOOD), *lingering.fds])
        time.sleep(0.3)  # the server has read it (a close on its thread would block it now)
        victim.settimeout(2)
        start = time.monotonic()
        reply = env.register(victim, torch.randn(2, H))
        assert "region" in reply and time.monotonic() - start < 2, reply
        env.refused(env.reply(attacker), "not a memfd")  # answered, then closed
        assert attacker.recv(10) == b""
    finally:
        lingering.release()  # the closer's waits end


def test_connection_closed_with_unread_fds_stalls_nobody(env, monkeypatch):
    """A disallowed peer queues messages with lingering sockets before it is
    accepted: the server closes its connection unread (at accept), and the
    kernel releases those sockets in that ``close``, which runs on the closer
    thread, not the regions thread (2 x 8 s there)."""
    import threading
    queued, real_cred = threading.Event(), rs.peer_cred
    monkeypatch.setattr(rs, "peer_cred", lambda s: (queued.wait(5), real_cred(s))[1])
    env.start(allowed_uids=frozenset({os.getuid() + 4242}))
    lingering = LingeringSockets(2)
    try:
        attacker = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env.socks.append(attacker)
        attacker.connect(env.path)
        for fd in lingering.fds:
            env.send(attacker, REG, [fd])
        queued.set()  # now the server accepts it
        attacker.settimeout(20)
        try:  # answered, then closed with what it sent unread: maybe reset
            env.refused(env.reply(attacker), "may not register")
            assert attacker.recv(10) == b""
        except ConnectionResetError:
            pass
        env.registry.limits = _limits()  # this uid allowed from now on
        victim = env.connect()
        victim.settimeout(2)
        start = time.monotonic()
        assert "region" in env.register(victim, torch.randn(2, H))
        assert time.monotonic() - start < 2
    finally:
        lingering.release()


def test_a_forked_child_has_no_fd_closer_of_its_parent():
    """The closer thread is the parent's: a forked child starts none until it closes an fd
    later itself, and that close happens (its own thread)."""
    r, w = os.pipe()
    rsock.close_fd_later(os.dup(r))  # the parent's closer thread runs
    pid = os.fork()
    if pid == 0:  # child: exits 0 only if it starts without a closer and closes by its own
        if rsock._closer is not None:  # the parent's queue: no thread here would drain it
            os._exit(1)
        fd = os.dup(w)
        rsock.close_fd_later(fd)
        rsock._closer.join()
        try:
            os.fstat(fd)
        except OSError:
            os._exit(0)
        os._exit(2)
    os.close(w)
    os.close(r)
    reaped: list[int] = []

    def exited() -> bool:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            reaped.append(status)
        return bool(done)

    try:
        wait_until(exited, 20, "the forked child to exit")
    finally:
        if not reaped:  # it hung: never left behind
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(reaped[0]) == 0
