# SPDX-License-Identifier: Apache-2.0
"""Kept ids across API servers (``ext/conversations/siblings.py``, ``remote.py``),
in-process: children forked from this process are siblings (same uid and parent),
as the API servers of one ``vllm serve`` are; this process is not one of theirs.

The owner keeps 40 rows; a sibling continues them with 10 rows written after
them in the owner's own memfd (the same inode, charged once, nothing copied) and
keeps the whole under the owner's new id. Another salt, an unknown id, a
non-sibling and an owner that exited all miss the same way; a sibling that dies
mid-request leaves no pin or use behind.
"""

import asyncio
import multiprocessing
import time

import pytest
import torch

ROWS, NEW, HIDDEN, SALT = 40, 10, 8, "salt-a"


def _several() -> None:
    """This process is one of several API servers (vLLM's ``_api_process_count``)."""
    from vllm._shm_embeds.ext.binary import common

    common._api_servers = 2


CHAT_IDS = [11, 12, *[7] * (ROWS - 3), 13]  # a kept chat turn: one embeds part
CHAT_PART = (2, ROWS - 3)


def _owner(conn, chat: bool = False) -> None:
    """The owner of one kept tensor of ROWS rows (``chat``: a kept chat turn's,
    ``rendered.Rendered``); answers each "stats" with its store's books: per entry
    ``(rows, inode, pins, tip refs)``, or for a chat turn ``(rows, inode, pins,
    token ids, parts)``."""
    import array

    from vllm._shm_embeds.ext.conversations import prefixes
    from vllm._shm_embeds.ext.conversations.rendered import Rendered

    _several()
    try:
        tensor = torch.arange(ROWS * HIDDEN, dtype=torch.float32).view(ROWS, HIDDEN)
        tip = prefixes.new_tip(tensor.dtype, ROWS, HIDDEN)
        tip.ensure(ROWS)
        tip.write(memoryview(tensor.view(-1).view(torch.uint8).numpy()), 0)
        turn = Rendered(array.array("i", CHAT_IDS), (CHAT_PART,), ROWS) if chat else None
        kid = prefixes.store().put(tip, ROWS, None, SALT, 60, 16, turn)
        prefixes.store().let_go(tip)
        conn.send(kid)
        while conn.recv() != "exit":
            store = prefixes.store()
            with store._lock:
                entries = [(k.shape[0], k.tip.inode, k.pins, *(
                    (list(k.chat.token_ids[:k.shape[0]]), k.chat.positions) if chat
                    else (k.tip.refs,))) for k in store._entries.values()]
            conn.send((entries, store.nbytes, tip.rows))
    except BaseException as e:  # the test reads it
        conn.send(repr(e))


def _continue(conn, kid: str, die: bool) -> None:
    from vllm._shm_embeds.ext.conversations import prefixes

    _several()
    try:
        prefix = prefixes.HOOK.resolve(kid, {"cache_salt": SALT}, torch.float32, HIDDEN)
        got = prefix.tensor.clone()
        sink = prefixes.HOOK.open_sink(prefix, torch.float32, (ROWS + NEW, HIDDEN), True)
        new = -torch.ones(NEW, HIDDEN)
        sink.write(memoryview(new.view(-1).view(torch.uint8).numpy()))
        whole = sink.finish()
        if die:  # a crash mid-request: the owner must end its pin and claim
            conn.send("pinned")
            time.sleep(60)
        keep = prefixes.KeepRequest(60, SALT)
        keep.start(whole)
        headers = asyncio.run(keep.response_headers(200))
        keep.close()
        prefix.release()
        conn.send((got.tolist(), whole.tolist(), sink.has_prefix, dict(headers),
                   prefixes.holder().release(whole)))
    except BaseException as e:
        conn.send(repr(e))


def _miss(conn, kid: str, salt: str | None) -> None:
    from vllm._shm_embeds.ext.conversations import prefixes

    _several()
    try:
        prefixes.HOOK.resolve(kid, {"cache_salt": salt}, torch.float32, HIDDEN)
        conn.send("hit")
    except prefixes.PrefixNotFound as e:
        conn.send((e.status, e.message))
    except BaseException as e:
        conn.send(repr(e))


def _starved(conn, kid: str) -> None:
    """A continuation's pin while the event loop's default executor is busy (one
    thread, blocked): it runs on the sibling round trips' own threads."""
    import threading
    import types
    from concurrent.futures import ThreadPoolExecutor

    from vllm._shm_embeds.ext.binary import binary
    from vllm._shm_embeds.ext.conversations import prefixes

    _several()

    async def main():
        loop, gate = asyncio.get_running_loop(), threading.Event()
        loop.set_default_executor(ThreadPoolExecutor(1))
        blocker = loop.run_in_executor(None, gate.wait)
        spec = types.SimpleNamespace(dtype=torch.float32, shape=(ROWS + NEW, HIDDEN))
        try:
            prefix = await asyncio.wait_for(
                binary._resolve(prefixes.HOOK, kid, {"cache_salt": SALT}, spec), 30)
        finally:
            gate.set()
        await blocker
        rows = prefix.tensor.shape[0]
        prefix.release()
        return rows

    try:
        conn.send(asyncio.run(main()))
    except BaseException as e:
        conn.send(repr(e))


def _chat_continue(conn, kid: str, max_rows: int, rewrite: bool = False) -> None:
    """A sibling's chat turn: the kept turn's part, then 3 token rows and NEW rows
    (``rewrite``: its first token other than the kept turn's, as a template that
    rewrites earlier turns)."""
    from shm_embeds_client import wire

    from vllm._shm_embeds import counters
    from vllm._shm_embeds.ext.conversations import chat, local
    from vllm._shm_embeds.lifetime.transfer import release_streamed

    _several()
    try:
        ref = f"{wire.PART}{kid}.0"
        body = {"cache_salt": SALT, "messages": [
            {"role": "user", "content": [{"type": "prompt_embeds", "data": ref}]},
            {"role": "user", "content": [{"type": "prompt_embeds", "data": "new"}]}]}
        turn = chat.HOOK.chat_turn({"shm-embeds-keep": "60"}, "/v1/chat/completions", body,
                                   torch.float32, HIDDEN, NEW, max_rows)
        turn.wait()
        ids = [*CHAT_IDS, 14, 15, *[7] * NEW, 16]
        if rewrite:
            ids[0] += 1
        new = -torch.ones(NEW, HIDDEN)
        out, _ = turn.build(ids, [turn.part(ref), new], [CHAT_PART, (ROWS + 2, NEW)])
        turn.rendered({"prompt_embeds": out, "prompt_token_ids": ids})
        headers = asyncio.run(turn.response_headers(200))
        asyncio.run(turn.settled())
        grown = local.holder().lookup(out) is not None and local.holder().lookup(
            out)[0].remote is not None
        values = out.tolist()
        turn.close()
        release_streamed(out)
        conn.send((values, dict(headers), grown, counters.stats()))
    except BaseException as e:
        conn.send(repr(e))


def _owned(chat: bool):
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(there, chat), daemon=True)
    proc.start()
    kid = here.recv()
    assert isinstance(kid, str) and len(kid) == 43, kid
    yield kid, here, proc
    if proc.is_alive():
        here.send("exit")
        proc.join(30)


@pytest.fixture
def owner():
    yield from _owned(False)


@pytest.fixture
def chat_owner():
    yield from _owned(True)


def _run(target, *args, timeout: float = 60):
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(there, *args), daemon=True)
    proc.start()
    assert here.poll(timeout), "the sibling did not answer"
    return here.recv(), here, proc


def _stats(conn):
    conn.send("stats")
    return conn.recv()


def test_a_sibling_grows_the_owners_tip_in_place(owner):
    kid, conn, _ = owner
    (got, whole, has_prefix, headers, released), _, proc = _run(_continue, kid, False)
    proc.join(30)
    want = torch.arange(ROWS * HIDDEN, dtype=torch.float32).view(ROWS, HIDDEN)
    assert got == want.tolist()
    assert has_prefix, "the new rows were not written after the kept ones"
    assert whole == torch.cat([want, -torch.ones(NEW, HIDDEN)]).tolist()
    assert released
    new_id = headers[b"shm-embeds-kept"].decode()
    assert new_id[:8] == kid[:8] and new_id != kid  # the owner's id: turns stay there
    entries, nbytes, tip_rows = _stats(conn)
    assert sorted(e[0] for e in entries) == [ROWS, ROWS + NEW]
    assert len({e[1] for e in entries}) == 1, "a second file: the rows were copied"
    assert nbytes == (ROWS + NEW) * HIDDEN * 4 and tip_rows == ROWS + NEW  # once
    assert all(e[2] == 0 for e in entries), "a pin outlived the sibling's request"
    # the next turn continues the owner's new id from another sibling
    got2, _, proc = _run(_miss, new_id, SALT)
    assert got2 == "hit", got2


def test_a_siblings_chat_turn_grows_the_owners_tip_and_is_kept_there(chat_owner):
    """The turn's rows are claimed at the owner before the prompt is rendered (an
    upper bound), trimmed to the rendered size (charged once, exactly), written in
    the owner's memfd, and kept there with the grown prompt's token ids and parts."""
    kid, conn, _ = chat_owner
    (out, headers, grown, stats), _, proc = _run(_chat_continue, kid, 4096)
    proc.join(30)
    total = ROWS + 3 + NEW
    kept = torch.arange(ROWS * HIDDEN, dtype=torch.float32).view(ROWS, HIDDEN)
    want = torch.cat([kept, torch.zeros(2, HIDDEN), -torch.ones(NEW, HIDDEN),
                      torch.zeros(1, HIDDEN)])
    assert grown and out == want.tolist(), stats
    assert stats.get("chat_grown") == 1 and stats.get("sibling_hits") == 1, stats
    assert not any(k.startswith("chat_rebuilt") for k in stats) and not stats.get(
        "kept_copied_bytes"), stats
    new_id = headers[b"shm-embeds-kept"].decode()
    assert new_id[:8] == kid[:8]
    entries, nbytes, tip_rows = _stats(conn)
    assert nbytes == total * HIDDEN * 4 and tip_rows == total  # the bound given back
    assert len({e[1] for e in entries}) == 1 and all(e[2] == 0 for e in entries)
    (_, _, _, ids, parts), = [e for e in entries if e[0] == total]
    assert ids == [*CHAT_IDS, 14, 15, *[7] * NEW, 16]
    assert parts == (CHAT_PART, (ROWS + 2, NEW))
    # the next turn, from another sibling, names the owner's new id
    (_, headers2, _, stats2), _, proc = _run(_chat_continue, new_id, 4096)
    proc.join(30)
    assert stats2.get("sibling_hits") == 1 and b"shm-embeds-kept" in headers2, stats2


@pytest.mark.parametrize("why", ["bound", "tokens"])
def test_a_chat_turn_built_whole_gives_the_claim_back(chat_owner, why):
    """A prompt rendered longer than the claim made before it, or one whose tokens
    do not begin with the kept turn's: built whole here (``chat_rebuilt.<why>``), the
    rows claimed at the owner, and their charge, given back."""
    kid, conn, _ = chat_owner
    (out, headers, grown, stats), _, proc = _run(
        _chat_continue, kid, ROWS + 2 if why == "bound" else 4096, why == "tokens")
    proc.join(30)
    assert stats.get(f"chat_rebuilt.{why}") == 1 and not grown, stats
    kept = torch.arange(ROWS * HIDDEN, dtype=torch.float32).view(ROWS, HIDDEN)
    a, n = CHAT_PART
    assert out[a:a + n] == kept[a:a + n].tolist() and out[ROWS + 2:ROWS + 2 + NEW] == (
        -torch.ones(NEW, HIDDEN)).tolist()
    assert headers[b"shm-embeds-kept"][:8] != kid[:8].encode()  # kept here: a new tip
    entries, nbytes, tip_rows = _stats(conn)
    assert tip_rows == ROWS and [e[0] for e in entries] == [ROWS]
    assert nbytes == ROWS * HIDDEN * 4  # (never written: its charge given back too)


def test_a_pin_never_waits_for_the_default_executor(owner):
    """Sibling round trips have threads of their own (``remote.round_trips``): a
    pin is served while every thread of the loop's default executor is busy."""
    kid, _, _ = owner
    got, _, proc = _run(_starved, kid)
    proc.join(30)
    assert got == ROWS, got


def test_misses_are_one_404(owner):
    from vllm._shm_embeds.ext.conversations import prefixes, remote, store

    kid, conn, proc = owner
    answers = [_run(_miss, *case)[0] for case in (
        (kid, "other-salt"), (kid, None), (kid[:8] + "A" * 35, SALT), ("B" * 43, SALT))]
    assert all(a == answers[0] for a in answers), answers
    assert answers[0][0] == 404
    assert "another" in answers[0][1] and kid not in answers[0][1]
    # this process is the owner's parent, not its sibling: never served
    assert remote.pin(kid, SALT, store.tag_of) is None
    from vllm._shm_embeds.ext.binary import common

    was, common._api_servers = common._api_servers, 2
    try:
        with pytest.raises(prefixes.PrefixNotFound):
            prefixes.HOOK.resolve(kid, {"cache_salt": SALT}, torch.float32, HIDDEN)
    finally:
        common._api_servers = was
    conn.send("exit")
    proc.join(30)
    assert _run(_miss, kid, SALT)[0] == answers[0]  # the owner exited: the same 404


def test_a_sibling_that_dies_mid_request_leaves_nothing_held(owner):
    kid, conn, _ = owner
    said, _, proc = _run(_continue, kid, True)
    assert said == "pinned"
    entries, _, _ = _stats(conn)
    assert entries[0][2] == 0 and entries[0][3] == 2  # unpinned at the claim; its use
    proc.kill()
    proc.join(30)
    deadline = time.monotonic() + 10
    while (entries := _stats(conn)[0])[0][2:] != (0, 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert entries[0][2:] == (0, 1), entries  # the entry's own use only


@pytest.mark.integration
@pytest.mark.online
@pytest.mark.parametrize("body", ["binary", "json"])
def test_turns_that_reach_either_api_server_never_miss(dp_server, body):
    """``--data-parallel-size 2``: two API servers. Each turn opens a new connection
    (``Connection: close``), so turns land on either; every continuation is served
    (no 404, no resend), answers as the whole conversation's token ids, and a turn
    on the API server that did not keep the id grows the owner's memfd in place
    (``sibling_hits``, ``tip_grown``; nothing copied but a JSON first turn's keep)."""
    import requests
    from helpers import delta, embed_weights

    import shm_embeds_client as sec

    url, server = dp_server["url"], dp_server
    kw = {"max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
    w = embed_weights(server.model)
    ids = torch.randint(3, 1000, (12 * 64,), generator=torch.Generator().manual_seed(5))
    embeds = w[ids].contiguous()
    before = server.totals()
    with sec.Conversation(url, "tiny", ttl_s=30, cache_salt=f"dp-{body}", body=body,
                          headers={"Connection": "close"}) as conv:
        for turn in range(12):
            end = (turn + 1) * 64
            got = conv.complete(embeds[end - 64:end], **kw)["choices"][0]["token_ids"]
            want = requests.post(url + "/v1/completions", timeout=300, json={
                "model": "tiny", "prompt": ids[:end].tolist(), "cache_salt": f"dp-{body}",
                **kw}).json()
            assert got == want["choices"][0]["token_ids"] and len(got) == 4, turn
            assert conv.misses == 0 and conv.last_sent_rows == 64, turn
            d = delta(before, server.totals())
            if turn >= 3 and d.get("sibling_hits", 0) >= 2:
                break
    assert d.get("sibling_hits", 0) >= 1, f"no turn reached the other API server: {d}"
    assert d.get("sibling_kept") == d.get("sibling_hits"), d  # each kept at its owner
    assert d.get("sibling_served") == d.get("sibling_hits"), d
    assert "prefix_misses" not in d, d
    copied = 64 * embeds.shape[1] * embeds.element_size() if body == "json" else 0
    assert d.get("kept_copied_bytes", 0) == copied, d  # the history: never
    assert d.get("tip_grown") == turn, d  # every continuation grew the one memfd
    assert d.get("prefix_hits") == turn, d
    # ``vllm serve``'s EngineCore (not forked from an API server) uses the API
    # servers' digests: it hashes no block itself (the site's group is "digests")
    assert d.get("hash_reused_blocks", 0) > 0 and "hash_engine_blocks" not in d, d


@pytest.mark.integration
@pytest.mark.online
@pytest.mark.parametrize("body", ["binary", "json"])
def test_chat_turns_that_reach_either_api_server_never_miss(dp_server, body):
    """A chat conversation whose turns land on either API server (``Connection:
    close``): every turn's kept parts are served (no 404, no resend), the answer
    (greedy, logprobs) is the whole conversation's, and a turn on the API server
    that did not keep them grows the owner's memfd in place: its rows claimed
    there up front and trimmed to the rendered prompt (``chat_grown`` every
    continuation, nothing rebuilt or copied)."""
    from helpers import delta, embed_weights
    from test_chat_conversations import ZEPHYR, _same

    import shm_embeds_client as sec

    url, server = dp_server["url"], dp_server
    kw = {"max_tokens": 4, "temperature": 0.0, "logprobs": True, "chat_template": ZEPHYR}
    salt = f"dp-chat-{body}"
    w = embed_weights(server.model)
    g = torch.Generator().manual_seed(6)
    before = server.totals()
    conv = sec.ChatConversation(url, "tiny", ttl_s=30, cache_salt=salt, body=body,
                                headers={"Connection": "close"})
    for turn in range(12):
        part = w[torch.randint(3, 1000, (40 + turn,), generator=g)].contiguous()
        out = conv.send(part if turn % 3 else ["a text part", part], **kw)
        assert conv.misses == 0 and conv.last_sent_rows == part.shape[0], turn
        whole = sec.chat_openai_json(url, "tiny", None, messages=conv.messages[:-1],
                                     cache_salt=salt, **kw)
        _same(out, whole)
        d = delta(before, server.totals())
        if turn >= 3 and d.get("sibling_hits", 0) >= 1:  # (a text part at turns 0 and 3)
            break
    assert d.get("sibling_hits", 0) >= 1, f"no turn reached the other API server: {d}"
    assert d.get("sibling_kept") == d.get("sibling_hits") == d.get("sibling_served"), d
    assert "prefix_misses" not in d and not d.get("kept_copied_bytes"), d
    assert d.get("chat_grown") == turn and not any(k.startswith("chat_rebuilt") for k in d), d


def _replay(conn, kid: str) -> None:
    """A sibling that gives back a claim it already kept (and keeps one it gave back)."""
    from vllm._shm_embeds.ext.conversations import remote, store

    try:
        pinned = remote.pin(kid, SALT, store.tag_of)
        assert pinned is not None, "the first pin"
        lease, rows = pinned.remote, pinned.rows
        assert lease.claim(rows + 20) == "ok"
        lease.tip.ensure(rows + 20)  # (the rows' bytes: zeros here)
        new = lease.commit(rows + 20, None, SALT, 60)
        lease.unclaim(rows + 20)  # refused: those rows are kept now
        assert new is not None, "the commit"
        pinned = remote.pin(new, SALT, store.tag_of)
        assert pinned is not None, "the second pin"
        lease2, rows2 = pinned.remote, pinned.rows
        assert lease2.claim(rows2 + 5) == "ok"
        lease2.unclaim(rows2 + 5)
        late = lease2.commit(rows2 + 5, None, SALT, 60)  # refused: given back
        conn.send((new is not None, rows2, late))
    except BaseException as e:
        conn.send(repr(e))


def test_the_owner_never_rewinds_kept_rows(owner):
    """Rows once kept never change: an unclaim after a commit, or a commit after an
    unclaim, is refused by the owner (whatever a sibling sends)."""
    kid, conn, _ = owner
    said, _, proc = _run(_replay, kid)
    assert isinstance(said, tuple), said
    made, rows2, late = said
    proc.join(30)
    assert made and rows2 == ROWS + 20 and late is None
    entries, _, tip_rows = _stats(conn)
    assert tip_rows == ROWS + 20, "the kept rows were given back"
    assert sorted(e[0] for e in entries) == [ROWS, ROWS + 20]


def test_the_last_let_go_never_waits_for_a_round_trip_in_flight():
    """The event loop lets go of a lease (a request cancelled) while a sibling round
    trip runs on another thread and the sibling does not answer: ``let_go`` returns
    at once, the round trip ends as a miss, and the socket is closed."""
    import socket
    import threading

    from vllm._shm_embeds.ext.conversations import remote

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lease = remote.Remote(mine)
    lease.hold()  # (the claim's use; the pin's is the first)
    got = []
    asking = threading.Thread(target=lambda: got.append(lease.claim(10)))
    asking.start()
    assert theirs.recv(1 << 16), "the claim was not sent"
    lease.let_go()
    t = time.monotonic()
    lease.let_go()  # the last use, with the claim's round trip unanswered
    assert time.monotonic() - t < 1.0
    asking.join(5)
    assert not asking.is_alive() and got == ["full"]
    assert mine.fileno() == -1
    theirs.close()
