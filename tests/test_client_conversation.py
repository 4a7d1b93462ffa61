# SPDX-License-Identifier: Apache-2.0
"""The client's conversations (``shm_embeds_client.conversation``) against a
mock transport: the first turn sends the whole tensor with the keep header,
later turns only the new rows after the kept id; a ``PrefixNotFound`` costs
exactly one whole resend; any other error raises and resends nothing. No server."""

from __future__ import annotations

import asyncio
import functools
import json

import httpx
import pytest
import torch

import shm_embeds_client as sec
from shm_embeds_client import wire
from shm_embeds_client.conversation import prefix_missing

H = 8
OK = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "hi"}]}


def _parse(request: httpx.Request) -> tuple[dict, torch.Tensor]:
    """The JSON header and the one tensor of a binary completions body."""
    body = request.content
    n = int(request.headers[wire.HEADER_LENGTH])
    header = json.loads(body[:n])
    desc = header["prompt_embeds"]
    dtype = getattr(torch, wire.DATATYPES[desc["datatype"]].torch)
    data = body[n:]
    assert len(data) == desc["parameters"][wire.BINARY_DATA_SIZE]
    t = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return header, t.reshape(-1, desc["shape"][1])  # a continuation: its new rows only


class FakeServer:
    """A mock: records each request; answers from ``replies`` (status, json,
    kept id or None) in order, else 200 with a fresh kept id."""

    def __init__(self, replies=()):
        self.replies = list(replies)
        self.requests: list[tuple[httpx.Request, dict, torch.Tensor]] = []
        self.ids = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        header, t = _parse(request)
        self.requests.append((request, header, t))
        if self.replies:
            status, body, kept = self.replies.pop(0)
        else:
            self.ids += 1
            status, body, kept = 200, OK, f"kept-{self.ids}"
        headers = {wire.KEPT_HEADER: kept} if kept else {}
        return httpx.Response(status, json=body, headers=headers)

    def prefix(self, i: int):
        return self.requests[i][1]["prompt_embeds"]["parameters"].get(wire.PREFIX)


@pytest.fixture
def server(monkeypatch):
    srv = FakeServer()
    transport = httpx.MockTransport(srv)
    monkeypatch.setattr(httpx, "Client", functools.partial(httpx.Client, transport=transport))
    monkeypatch.setattr(httpx, "AsyncClient",
                        functools.partial(httpx.AsyncClient, transport=transport))
    return srv


def _rows(n: int, start: float = 0.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(n * H, dtype=torch.float32).reshape(n, H) + start).to(dtype)


MISS = (404, {"error": {"message": "kept prefix not found", "type": wire.PREFIX_NOT_FOUND,
                        "param": None, "code": 404}}, None)


def test_first_turn_whole_then_only_new_rows(server):
    conv = sec.Conversation("http://srv:8000/v1", "m", ttl_s=30)
    a, b = _rows(5), _rows(3, 100)
    assert conv.complete(a, max_tokens=4) == OK
    req, header, t = server.requests[0]
    assert req.headers[wire.KEEP_HEADER] == "30"
    assert torch.equal(t, a) and server.prefix(0) is None
    assert header["max_tokens"] == 4 and header["model"] == "m" and "cache_salt" not in header
    assert conv.kept_id == "kept-1" and conv.rows == 5 and conv.last_sent_rows == 5

    assert conv.complete(b, max_tokens=4) == OK
    req, header, t = server.requests[1]
    assert req.headers[wire.KEEP_HEADER] == "30"
    assert server.prefix(1) == "kept-1" and torch.equal(t, b)
    assert conv.kept_id == "kept-2" and conv.rows == 8 and conv.last_sent_rows == 3
    assert conv.misses == 0 and torch.equal(conv.history(), torch.cat([a, b]))


def test_prefix_not_found_resends_the_whole_history_once(server):
    conv = sec.Conversation("http://srv:8000", "m")
    pieces = [_rows(4), _rows(2, 50), _rows(3, 90)]
    conv.complete(pieces[0])
    conv.complete(pieces[1])
    server.replies = [MISS]
    assert conv.complete(pieces[2]) == OK
    assert len(server.requests) == 4
    assert server.prefix(2) == "kept-2" and torch.equal(server.requests[2][2], pieces[2])
    assert server.prefix(3) is None
    assert torch.equal(server.requests[3][2], torch.cat(pieces))
    assert server.requests[3][0].headers[wire.KEEP_HEADER] == "600"
    assert conv.misses == 1 and conv.kept_id == "kept-3" and conv.rows == 9
    assert conv.last_sent_rows == 3 + 9


def test_prefix_not_found_at_top_level_is_a_miss():
    top = httpx.Response(404, json={"object": "error", "message": "gone",
                                    "type": wire.PREFIX_NOT_FOUND, "code": 404})
    assert prefix_missing(top)
    assert prefix_missing(httpx.Response(404, json=MISS[1]))
    assert not prefix_missing(httpx.Response(404, json={"error": {"type": "NotFound"}}))
    assert not prefix_missing(httpx.Response(404, text="not json"))
    assert not prefix_missing(httpx.Response(400, json=MISS[1]))


def test_a_miss_on_the_resend_raises(server):
    conv = sec.Conversation("http://srv:8000", "m")
    conv.complete(_rows(2))
    server.replies = [MISS, MISS]
    with pytest.raises(httpx.HTTPStatusError):
        conv.complete(_rows(1))
    assert len(server.requests) == 3 and conv.misses == 1
    assert conv.kept_id is None and conv.rows == 2  # the failed turn is not in the history


@pytest.mark.parametrize("status", [400, 500, 503])
def test_other_errors_raise_and_do_not_resend(server, status):
    conv = sec.Conversation("http://srv:8000", "m")
    conv.complete(_rows(2))
    err = {"error": {"message": "unknown parameter shm_embeds_prefix",
                     "type": "BadRequestError", "code": status}}
    server.replies = [(status, err, None)]
    with pytest.raises(httpx.HTTPStatusError) as e:
        conv.complete(_rows(1))
    assert e.value.response.status_code == status
    assert len(server.requests) == 2 and conv.misses == 0
    assert conv.kept_id == "kept-1" and conv.rows == 2  # unchanged: the caller may retry
    # A 404 of another kind is not a miss either.
    server.replies = [(404, {"error": {"message": "no", "type": "NotFoundError"}}, None)]
    with pytest.raises(httpx.HTTPStatusError):
        conv.complete(_rows(1))
    assert len(server.requests) == 3 and conv.misses == 0


def test_no_kept_header_sends_the_whole_history_next(server):
    conv = sec.Conversation("http://srv:8000", "m")
    a, b, c = _rows(2), _rows(3, 10), _rows(1, 20)
    server.replies = [(200, OK, None)]
    conv.complete(a)
    assert conv.kept_id is None
    conv.complete(b)
    assert server.prefix(1) is None and torch.equal(server.requests[1][2], torch.cat([a, b]))
    assert conv.kept_id == "kept-1" and conv.last_sent_rows == 5
    conv.complete(c)
    assert server.prefix(2) == "kept-1" and torch.equal(server.requests[2][2], c)
    conv.reset()
    assert conv.kept_id is None
    conv.complete(a)
    assert server.prefix(3) is None
    assert torch.equal(server.requests[3][2], torch.cat([a, b, c, a]))


def test_cache_salt_in_every_body(server):
    conv = sec.Conversation("http://srv:8000", "m", cache_salt="salt-1")
    conv.complete(_rows(2))
    server.replies = [MISS]
    conv.complete(_rows(1))
    conv.fork().complete(_rows(1))
    assert len(server.requests) == 4
    assert all(h["cache_salt"] == "salt-1" for _, h, _ in server.requests)


def test_fork_shares_the_kept_prefix(server):
    conv = sec.Conversation("http://srv:8000", "m", headers={"X-Trace": "1"})
    a = _rows(4)
    conv.complete(a)
    branch = conv.fork()
    assert branch.kept_id == conv.kept_id == "kept-1" and branch.rows == 4
    assert branch.pieces[0] is conv.pieces[0]
    b1, b2 = _rows(2, 10), _rows(3, 20)
    conv.complete(b1)
    branch.complete(b2)
    assert server.prefix(1) == server.prefix(2) == "kept-1"
    assert server.requests[2][0].headers["X-Trace"] == "1"
    assert conv.rows == 6 and branch.rows == 7
    assert torch.equal(branch.history(), torch.cat([a, b2]))
    assert torch.equal(conv.history(), torch.cat([a, b1]))
    assert conv.kept_id == "kept-2" and branch.kept_id == "kept-3"


def test_bad_arguments(server):
    conv = sec.Conversation("http://srv:8000", "m")
    with pytest.raises(ValueError):
        conv.complete(_rows(1), stream=True)
    with pytest.raises(ValueError):
        conv.complete(_rows(1), cache_salt="x")
    with pytest.raises(ValueError):
        conv.complete(torch.zeros(H))
    conv.complete(_rows(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        conv.complete(_rows(1))  # float32 after bfloat16
    with pytest.raises(ValueError):
        conv.complete(torch.zeros(1, H + 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        sec.Conversation("http://srv:8000", "m", ttl_s=0)
    assert len(server.requests) == 1 and conv.rows == 2
    assert sec.Conversation("u", "m", ttl_s=2.5)._request_headers()[wire.KEEP_HEADER] == "2.5"


def test_continuation_framing():
    rows = _rows(3)
    headers, pieces, length = sec.frame({"model": "m",
                                         "prompt_embeds": sec.Continuation("k", rows, 5)})
    header = json.loads(pieces[0])
    assert header["prompt_embeds"] == {  # the whole shape; the bytes of the new rows only
        "datatype": "FP32", "shape": [8, H],
        "parameters": {wire.BINARY_DATA_SIZE: rows.nbytes, wire.PREFIX: "k"}}
    assert length == len(pieces[0]) + rows.nbytes
    with pytest.raises(ValueError):
        sec.Continuation("", rows, 5)
    with pytest.raises(ValueError):
        sec.Continuation("k", rows)  # the kept rows' count is needed
    with pytest.raises(ValueError):  # one tensor per request
        sec.frame({"model": "m", "prompt_embeds": [sec.Continuation("k", rows, 5), rows]})
    with pytest.raises(ValueError):  # completions only
        sec.frame({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "prompt_embeds", "data": sec.Continuation("k", rows, 5)}]}]}, "chat")


def test_continuation_through_complete(server):
    rows = _rows(2)
    out = sec.complete("http://srv:8000", "m", sec.Continuation("kept-0", rows, 4),
                       headers={wire.KEEP_HEADER: "5"})
    assert out == OK and server.prefix(0) == "kept-0"
    assert torch.equal(server.requests[0][2], rows)


def test_explicit_client_is_used_and_left_open():
    srv = FakeServer()
    with httpx.Client(transport=httpx.MockTransport(srv)) as client:
        conv = sec.Conversation("http://srv:8000", "m", client=client)
        conv.complete(_rows(2))
        conv.kept_id = "stale"
        srv.replies.append(MISS)
        conv.complete(_rows(2))
        conv.complete(_rows(1))
        assert not client.is_closed
    assert [srv.prefix(i) for i in range(4)] == [None, "stale", None, "kept-2"]


def test_async_conversation(server):
    a, b, c = _rows(3), _rows(2, 10), _rows(1, 20)

    async def main():
        conv = sec.AsyncConversation("http://srv:8000", "m", cache_salt="s", ttl_s=60)
        assert await conv.acomplete(a, max_tokens=2) == OK
        assert await conv.acomplete(b) == OK
        server.replies = [MISS]
        assert await conv.acomplete(c) == OK
        branch = conv.fork()
        await branch.acomplete(b)
        server.replies = [(400, {"error": {"message": "bad", "type": "BadRequestError"}},
                           None)]
        with pytest.raises(httpx.HTTPStatusError):
            await conv.acomplete(c)
        with pytest.raises(ValueError):
            await conv.acomplete(c, stream=True)
        return conv, branch

    conv, branch = asyncio.run(main())
    prefixes = [server.prefix(i) for i in range(len(server.requests))]
    assert prefixes == [None, "kept-1", "kept-2", None, "kept-3", "kept-3"]
    assert torch.equal(server.requests[3][2], torch.cat([a, b, c]))
    assert all(r.headers[wire.KEEP_HEADER] == "60" for r, _, _ in server.requests)
    assert all(h["cache_salt"] == "s" for _, h, _ in server.requests)
    assert conv.misses == 1 and conv.rows == 6 and conv.kept_id == "kept-3"
    assert branch.rows == 8 and branch.kept_id == "kept-4"


def test_a_json_conversation_sends_the_continuation_object(monkeypatch):
    """``body="json"``: base64 JSON bodies; a later turn's ``prompt_embeds`` is the
    continuation object (the kept id, the kept rows' count, the new rows' base64
    ``torch.save``); a miss resends the whole history as a plain base64 payload."""
    import base64
    import io

    seen, replies = [], [None, None, MISS, None]

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers[wire.KEEP_HEADER] == "30"
        seen.append(json.loads(request.content))
        reply = replies.pop(0)
        if reply is not None:
            return httpx.Response(reply[0], json=reply[1])
        return httpx.Response(200, json=OK, headers={wire.KEPT_HEADER: f"k{len(seen)}"})

    monkeypatch.setattr(httpx, "Client", functools.partial(
        httpx.Client, transport=httpx.MockTransport(answer)))

    def load(b64):
        return torch.load(io.BytesIO(base64.b64decode(b64)), weights_only=True)

    conv = sec.Conversation("http://x", "m", ttl_s=30, body="json")
    a, b, c = _rows(5), _rows(3, 100), _rows(2, 200)
    conv.complete(a)
    conv.complete(b)
    conv.complete(c)
    assert torch.equal(load(seen[0]["prompt_embeds"]), a)
    assert {k: v for k, v in seen[1]["prompt_embeds"].items() if k != wire.PREFIX_DATA} == \
        {wire.PREFIX: "k1", wire.PREFIX_ROWS: 5}
    assert torch.equal(load(seen[1]["prompt_embeds"][wire.PREFIX_DATA]), b)
    assert seen[2]["prompt_embeds"][wire.PREFIX] == "k2"  # missed: then the whole history
    assert torch.equal(load(seen[3]["prompt_embeds"]), torch.cat([a, b, c]))
    assert conv.misses == 1 and conv.kept_id == "k4" and conv.rows == 10
    with pytest.raises(ValueError):
        sec.Conversation("http://x", "m", body="xml")


# -- connection reuse (shm_embeds_client.pool)


@pytest.fixture
def made(monkeypatch):
    """Every httpx client the client makes (each through a mock transport that
    answers 200 with a fresh kept id)."""
    out = []

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=OK, headers={wire.KEPT_HEADER: f"k{len(out)}"})

    def counted(cls):
        def make(*a, **kw):
            out.append(cls(*a, transport=httpx.MockTransport(answer), **kw))
            return out[-1]
        return make

    monkeypatch.setattr(httpx, "Client", counted(httpx.Client))
    monkeypatch.setattr(httpx, "AsyncClient", counted(httpx.AsyncClient))
    return out


def test_a_conversation_keeps_one_client_for_its_turns_and_forks(made):
    with sec.Conversation("http://srv:8000", "m") as conv:
        for n in (3, 2, 1):
            conv.complete(_rows(n))
        branch = conv.fork()
        branch.complete(_rows(1))
        json_conv = sec.Conversation("http://srv:8000", "m", body="json")
        json_conv.complete(_rows(2))
        json_conv.complete(_rows(2))
        assert len(made) == 2 and not made[0].is_closed  # this one's, json_conv's
    assert not made[0].is_closed  # the branch still uses it
    branch.complete(_rows(1))
    branch.close()
    assert made[0].is_closed and len(made) == 2
    with pytest.raises(RuntimeError):
        conv.complete(_rows(1))
    conv.close()  # twice: nothing more
    with pytest.raises(RuntimeError):  # a fork of a closed conversation is closed too
        conv.fork().complete(_rows(1))
    json_conv.close()
    assert made[1].is_closed


def test_one_shot_helpers_share_the_process_client(made):
    from shm_embeds_client import pool

    for _ in range(3):
        sec.complete("http://srv:8000", "m", _rows(2))
    sec.complete_openai_json("http://srv:8000", "m", _rows(2))
    assert len(made) == 1
    pool.close()
    assert made[0].is_closed
    sec.complete("http://srv:8000", "m", _rows(2))
    assert len(made) == 2

    async def main():
        for _ in range(2):
            await sec.acomplete("http://srv:8000", "m", _rows(2))
        async with sec.AsyncConversation("http://srv:8000", "m") as conv:
            await conv.acomplete(_rows(2))
            await conv.acomplete(_rows(1))
        return conv

    conv = asyncio.run(main())
    assert len(made) == 4 and made[3].is_closed  # the loop's shared one, the conversation's
    with pytest.raises(RuntimeError):
        asyncio.run(conv.acomplete(_rows(1)))


def test_a_forked_child_makes_its_own_connections(made, monkeypatch):
    from shm_embeds_client import pool

    p = pool.Pool(httpx.Client)
    parent = p.get()
    monkeypatch.setattr(pool.os, "getpid", lambda: -1)  # as in a forked child
    child = p.get()
    assert child is not parent and p.release() is child
    monkeypatch.undo()
    assert not parent.is_closed
