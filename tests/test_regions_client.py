# SPDX-License-Identifier: Apache-2.0
"""The region client (``shm_embeds_client.RegionClient``) against an in-test
fake region server: a SOCK_SEQPACKET listener in a thread that receives each
message with its descriptors, checks the memfd's seals and size, maps it and
keeps a copy of its bytes, and answers. No vLLM, no engine; under a second."""

import array
import asyncio
import fcntl
import gc
import json
import mmap
import os
import socket
import threading

import httpx
import pytest
import torch

import shm_embeds_client as sec

ALL_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class FakeRegionServer:
    """Accepts connections on ``path``; ``mode`` decides the answer to a
    register: ``"ok"``, ``"refuse"`` (an ``{"error"}`` answer), ``"close"``
    (closes the connection), ``"silent"`` (no answer). ``unregister_mode``:
    ``"ok"`` or ``"refuse"``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.mode = "ok"
        self.unregister_mode = "ok"
        self.messages: list[dict] = []     # every message received, in order
        self.received: list[dict] = []     # per register: what its fd held
        self.errors: list[BaseException] = []
        self.closed = threading.Event()    # a connection reached EOF
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen()
        self.listener.settimeout(0.2)
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping:
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                if self.stopping:
                    return
                continue
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        n = 0
        try:
            with conn:
                while True:
                    msg, anc, _flags, _ = conn.recvmsg(sec.MAX_MESSAGE, socket.CMSG_SPACE(4 * 4))
                    if not msg:
                        self.closed.set()
                        return
                    fds = []
                    for level, kind, data in anc:
                        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                            a = array.array("i")
                            a.frombytes(data[: len(data) // 4 * 4])
                            fds += list(a)
                    m = json.loads(msg)
                    self.messages.append(m)
                    if m["op"] == "register":
                        n += 1
                        self._inspect(fds)
                        if self.mode == "ok":
                            rid = f"id-{len(self.received)}-{n}"
                            answer = {"region": rid, "byte_size": self.received[-1]["size"]}
                        elif self.mode == "refuse":
                            answer = {"error": "hidden size 8 is not the model's (16)"}
                        elif self.mode == "close":
                            return
                        else:  # silent
                            continue
                    else:
                        for fd in fds:
                            os.close(fd)
                        answer = ({"ok": True} if self.unregister_mode == "ok"
                                  else {"error": "unknown region"})
                    conn.send(json.dumps(answer).encode())
        except BaseException as e:  # noqa: BLE001 - reported by the fixture
            self.errors.append(e)

    def _inspect(self, fds: list[int]) -> None:
        """Record what the one descriptor holds, then close it (before the answer:
        after it, this process holds no descriptor of the memfd but the client's)."""
        info = {"nfds": len(fds)}
        try:
            fd = fds[0]
            info["seals"] = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            info["size"] = os.fstat(fd).st_size
            info["link"] = os.readlink(f"/proc/self/fd/{fd}")
            with mmap.mmap(fd, info["size"], mmap.MAP_SHARED, mmap.PROT_READ) as m:
                info["bytes"] = bytes(m)
        finally:
            for fd in fds:
                os.close(fd)
            self.received.append(info)

    def stop(self) -> None:
        self.stopping = True
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as wake:
            wake.connect(self.path)  # wakes accept() at once
        self.thread.join(5)
        self.listener.close()


@pytest.fixture
def server(tmp_path):
    s = FakeRegionServer(str(tmp_path / "regions.sock"))
    yield s
    s.stop()
    assert s.errors == []


@pytest.fixture
def rc(server):
    with sec.connect_regions(server.path, timeout=5) as client:
        yield client


def memfds() -> list[str]:
    """This process's descriptors of region memfds (the fake server closes its own)."""
    gc.collect()
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("/memfd:" + sec.MEMFD_NAME):
            out.append(link)
    return out


def mapping_of(addr: int) -> str | None:
    """The /proc/self/maps line of the mapping that starts at ``addr``."""
    with open("/proc/self/maps") as f:
        for line in f:
            if int(line.split("-", 1)[0], 16) == addr:
                return line.strip()
    return None


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# -- register --------------------------------------------------------------------


@pytest.mark.parametrize("make, datatype", [
    (lambda: torch.randn(5, 8), "FP32"),
    (lambda: torch.randn(3, 16).half(), "FP16"),
    (lambda: torch.randn(7, 4).bfloat16(), "BF16"),
    (lambda: torch.randn(8, 5).t(), "FP32"),                 # not contiguous
    (lambda: torch.randn(2, 8, dtype=torch.float64), "FP32"),  # sent as FP32
])
def test_register_sends_a_sealed_memfd_with_the_tensor_bytes(server, rc, make, datatype):
    t = make()
    region = rc.register(t)
    assert server.messages == [{"op": "register", "datatype": datatype,
                                "shape": list(t.shape)}]
    got = server.received[0]
    expect = raw(t if t.dtype != torch.float64 else t.float())
    assert got["nfds"] == 1
    assert got["seals"] == ALL_SEALS
    assert got["link"].startswith("/memfd:" + sec.MEMFD_NAME)
    assert got["size"] == len(expect) and got["bytes"] == expect
    assert region.id == "id-1-1" and region.byte_size == len(expect)
    assert region.datatype == datatype and region.shape == tuple(t.shape)
    assert region.tensor is None and region.registered
    assert memfds() == []  # the client closed its descriptor


@pytest.mark.parametrize("bad", [torch.ones(4), torch.ones(2, 3, dtype=torch.int32),
                                 torch.ones(0, 8), torch.ones(1, 2, 3)])
def test_register_rejects_what_is_not_a_2d_float_tensor(server, rc, bad):
    with pytest.raises(ValueError):
        rc.register(bad)
    assert server.messages == [] and memfds() == []


# -- empty() + seal(): filled in place ----------------------------------------------


def test_empty_filled_in_place_then_sealed_arrives_with_no_copy(server, rc):
    x = torch.randn(6, 16).bfloat16()
    e = rc.empty((6, 16), torch.bfloat16)
    addr = e.data_ptr()
    assert e.dtype == torch.bfloat16 and e.shape == (6, 16) and not e.any()
    assert " rw-s " in mapping_of(addr)  # writable, shared with the memfd
    e.copy_(x)
    region = rc.seal(e)
    got = server.received[0]
    assert server.messages == [{"op": "register", "datatype": "BF16", "shape": [6, 16]}]
    assert got["nfds"] == 1 and got["seals"] == ALL_SEALS
    assert got["size"] == x.nbytes and got["bytes"] == raw(x)
    # The same memory, now a read-only mapping of the sealed memfd.
    assert region.tensor is e and e.data_ptr() == addr and torch.equal(e, x)
    line = mapping_of(addr)
    assert " r--s " in line and sec.MEMFD_NAME in line
    assert memfds() == []
    with pytest.raises(ValueError):
        rc.seal(e)  # sealed already
    del e, region
    gc.collect()
    assert mapping_of(addr) is None  # unmapped with the last tensor over it


def test_seal_takes_only_a_whole_tensor_from_empty(server, rc):
    e = rc.empty((4, 8))
    for other in (torch.zeros(4, 8), e[1:], e.view(8, 4), e.view(torch.int32)):
        with pytest.raises(ValueError):
            rc.seal(other)
    assert server.messages == []
    assert len(memfds()) == 1
    rc.seal(e)
    assert server.received[0]["seals"] == ALL_SEALS


def test_an_unsealed_empty_tensor_is_freed_when_dropped(server, rc):
    e = rc.empty((2, 1024))
    addr = e.data_ptr()
    assert len(memfds()) == 1 and mapping_of(addr) is not None
    del e
    assert memfds() == [] and mapping_of(addr) is None


def test_empty_rejects_other_shapes_and_dtypes(rc):
    for shape, dtype in [((0, 8), torch.float32), ((2, 3, 4), torch.float32),
                         ((2, 8), torch.float64), ((2, 8), torch.int8)]:
        with pytest.raises(ValueError):
            rc.empty(shape, dtype)
    assert memfds() == []


# -- errors -------------------------------------------------------------------------


def test_an_error_answer_raises_region_refused(server, rc):
    server.mode = "refuse"
    with pytest.raises(sec.RegionRefused, match="hidden size 8") as e:
        rc.register(torch.ones(2, 8))
    assert e.value.message == "hidden size 8 is not the model's (16)"
    assert isinstance(e.value, RuntimeError)
    assert memfds() == []
    t = rc.empty((2, 8))
    with pytest.raises(sec.RegionRefused):
        rc.seal(t)
    assert memfds() == [] and " r--s " in mapping_of(t.data_ptr())  # read-only, not pending
    with pytest.raises(ValueError):
        rc.seal(t)
    server.mode = "ok"  # the connection is still usable
    assert rc.register(torch.ones(2, 8)).registered


def test_the_server_closing_the_connection_closes_the_client(server, rc):
    server.mode = "close"
    with pytest.raises(ConnectionError):
        rc.register(torch.ones(2, 8))
    assert rc.closed
    with pytest.raises(ConnectionError):
        rc.empty((2, 8))


def test_no_answer_in_time_closes_the_client(server):
    server.mode = "silent"
    rc = sec.RegionClient(server.path, timeout=0.2)
    with pytest.raises(TimeoutError):
        rc.register(torch.ones(2, 8))
    assert rc.closed
    assert server.closed.wait(5)  # the server saw the connection go (and unregisters)


def test_connect_errors_and_the_env_default(server, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError):
        sec.connect_regions(str(tmp_path / "nothing.sock"))
    monkeypatch.delenv("VLLM_SHM_EMBEDS_REGIONS", raising=False)
    with pytest.raises(ValueError):
        sec.connect_regions()
    monkeypatch.setenv("VLLM_SHM_EMBEDS_REGIONS", server.path)
    with sec.connect_regions() as rc:
        assert rc.register(torch.ones(1, 4)).registered


# -- Region ---------------------------------------------------------------------------


def test_region_to_json_is_the_triton_style_reference(server, rc):
    region = rc.register(torch.ones(3, 8, dtype=torch.float16))
    assert region.to_json() == {
        "datatype": "FP16", "shape": [3, 8],
        "parameters": {"shared_memory_region": region.id, "shared_memory_byte_size": 48,
                       "shared_memory_offset": 0}}
    json.dumps(region.to_json())  # plain JSON
    assert region.id not in repr(region)  # a capability: kept out of logs


def test_region_context_manager_unregisters(server, rc):
    with rc.register(torch.ones(2, 8)) as region:
        assert region.registered
        assert len(server.messages) == 1
    assert server.messages[-1] == {"op": "unregister", "region": region.id}
    assert not region.registered
    region.unregister()  # no-op now
    rc.unregister(region)
    assert len(server.messages) == 2
    # An id the server no longer knows: explicit unregister raises, the with block does not.
    server.unregister_mode = "refuse"
    other = rc.register(torch.ones(2, 8))
    with pytest.raises(sec.RegionRefused, match="unknown region"):
        other.unregister()
    assert not other.registered
    with rc.register(torch.ones(2, 8)):
        pass
    assert server.messages[-1]["op"] == "unregister"


def test_unregister_takes_only_its_own_regions(server, rc):
    region = rc.register(torch.ones(2, 8))
    with sec.connect_regions(server.path, timeout=5) as other, pytest.raises(ValueError):
        other.unregister(region)


def test_close_ends_every_registration(server):
    with sec.connect_regions(server.path, timeout=5) as rc:
        a, b = rc.register(torch.ones(2, 8)), rc.register(torch.ones(3, 8))
        assert a.registered and b.registered
    assert server.closed.wait(5)  # the server's cue to unregister them all
    assert not a.registered and not b.registered
    a.unregister()  # no-op, nothing sent
    assert [m["op"] for m in server.messages] == ["register", "register"]
    with pytest.raises(ConnectionError):
        rc.register(torch.ones(2, 8))
    rc.close()  # idempotent


# -- requests naming regions -----------------------------------------------------------


@pytest.fixture
def captured(monkeypatch):
    """Requests that ``complete``/``chat``/``acomplete``/``achat`` send."""
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        sent.append(request)
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    class Client(httpx.Client):
        def __init__(self, **kw):
            super().__init__(transport=httpx.MockTransport(handler), **kw)

    class AsyncClient(httpx.AsyncClient):
        def __init__(self, **kw):
            super().__init__(transport=httpx.MockTransport(handler), **kw)

    monkeypatch.setattr(httpx, "Client", Client)
    monkeypatch.setattr(httpx, "AsyncClient", AsyncClient)
    return sent


def test_complete_with_a_region_posts_a_plain_json_body(server, rc, captured):
    region = rc.register(torch.ones(2, 8))
    out = sec.complete("http://h:1/v1", "m", region, max_tokens=4)
    assert out == {"choices": [{"text": "ok"}]}
    (r,) = captured
    assert str(r.url) == "http://h:1/v1/completions"
    assert r.headers["content-type"] == "application/json"
    assert "inference-header-content-length" not in r.headers
    assert int(r.headers["content-length"]) == len(r.content)
    assert json.loads(r.content) == {"model": "m", "max_tokens": 4,
                                     "prompt_embeds": region.to_json()}
    # A list of them: one reference per item.
    other = rc.register(torch.ones(3, 8))
    sec.complete("http://h:1", "m", [region, other], max_tokens=4)
    assert json.loads(captured[-1].content)["prompt_embeds"] == [region.to_json(),
                                                                 other.to_json()]


def test_chat_with_regions_posts_references_in_content_parts(server, rc, captured):
    region = rc.register(torch.ones(2, 8))
    sec.chat("http://h:1", "m", region, max_tokens=4)
    body = json.loads(captured[-1].content)
    assert str(captured[-1].url) == "http://h:1/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": [
        {"type": "prompt_embeds", "data": region.to_json()}]}]
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "prompt_embeds", "data": region}]}]
    sec.chat("http://h:1", "m", messages=messages, max_tokens=4)
    body = json.loads(captured[-1].content)
    assert captured[-1].headers["content-type"] == "application/json"
    assert body["messages"][0] == messages[0]
    assert body["messages"][1]["content"] == [{"type": "text", "text": "a"},
                                              {"type": "prompt_embeds",
                                               "data": region.to_json()}]
    assert messages[1]["content"][1]["data"] is region  # the caller's body is untouched


def test_async_calls_with_regions(server, rc, captured):
    region = rc.register(torch.ones(2, 8))

    async def both():
        return await asyncio.gather(sec.acomplete("http://h:1", "m", region, max_tokens=2),
                                    sec.achat("http://h:1", "m", region, max_tokens=2))

    assert asyncio.run(both()) == [{"choices": [{"text": "ok"}]}] * 2
    by_path = {r.url.path: r for r in captured}
    assert set(by_path) == {"/v1/completions", "/v1/chat/completions"}
    for r in captured:
        assert r.headers["content-type"] == "application/json"
    assert json.loads(by_path["/v1/completions"].content)["prompt_embeds"] == region.to_json()
    assert json.loads(by_path["/v1/chat/completions"].content)["messages"][0]["content"][0][
        "data"] == region.to_json()


def test_tensors_still_go_binary_and_mixing_is_refused(server, rc, captured):
    t = torch.ones(2, 8)
    sec.complete("http://h:1", "m", t, max_tokens=4)
    assert captured[-1].headers["content-type"] == "application/octet-stream"
    assert captured[-1].content.endswith(raw(t))
    region = rc.register(t)
    with pytest.raises(ValueError, match="mixes"):
        sec.complete("http://h:1", "m", [region, t], max_tokens=4)
    with pytest.raises(ValueError, match="mixes"):
        sec.chat("http://h:1", "m", messages=[{"role": "user", "content": [
            {"type": "prompt_embeds", "data": t}, {"type": "prompt_embeds", "data": region}]}])
    assert len(captured) == 1
