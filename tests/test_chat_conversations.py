# SPDX-License-Identifier: Apache-2.0
"""Chat conversations (issue 54, ``ext/conversations/chat.py``, docs/conversations.md).

Unit: a chat prompt built into a tip equals vLLM's own ``_build_mixed_prompt_embeds``
(values and mask; vllm/renderers/hf.py 0.32), for a first turn and for a turn grown
after a kept one, whatever the template did to the earlier rows (a property test).
Online (the main server): kept parts are not sent again; every answer (greedy and
logprobs, ``n`` = 2 with a seed, two branches at once) equals the whole conversation
sent as data; a template that rewrites earlier turns is built whole, and answers the
same; the one 404 for every miss; stock vLLM refuses a reference.
"""

import asyncio
import concurrent.futures
import time

import pytest
import requests
import torch
from helpers import delta, embed_weights, ours_in, prefix_cache_hits, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shm_embeds_client as sec
from shm_embeds_client import wire

H, PLACEHOLDER, BLOCK = 8, 7, 4


def _prompt(draw_runs, g):
    """token ids, part tensors and positions from ``[(text ids, part rows)]``."""
    ids, tensors, positions = [], [], []
    for text, rows in draw_runs:
        ids += text
        if rows:
            positions.append((len(ids), rows))
            ids += [PLACEHOLDER] * rows
            tensors.append(torch.randn(rows, H, generator=g))
    return ids, tensors, positions


runs = st.lists(st.tuples(st.lists(st.integers(10, 99), max_size=4), st.integers(1, 5)),
                min_size=1, max_size=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=runs, more=runs, same_tokens=st.booleans(), caching=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_chat_prompt_in_a_tip_equals_vllms_first_and_grown(shm_env, first, more,
                                                             same_tokens, caching, seed):
    from vllm.renderers.hf import _build_mixed_prompt_embeds as stock

    from vllm._shm_embeds import counters
    from vllm._shm_embeds.ext.conversations import chat, keeps, local
    from vllm._shm_embeds.ext.digests import digests
    from vllm._shm_embeds.lifetime.transfer import release_streamed

    g = torch.Generator().manual_seed(seed)
    ids, tensors, positions = _prompt(first, g)
    turn = chat.ChatTurn(keeps.KeepRequest(60, None), {}, [], [], (None, torch.float32, H, 0, 1 << 20))
    made = []
    try:
        out, mask = turn.build(ids, tensors, positions)
        made.append(out)
        want = stock(ids, tensors, positions)
        assert torch.equal(out, want[0]) and mask == want[1]
        if caching:  # (prefix caching on: hash_prompt_embeds attaches the digests)
            digests.attach(out, digests.hash_tensor(out, BLOCK).result())
        turn.rendered({"prompt_embeds": out, "prompt_token_ids": ids})
        kid = turn.keep.kid
        assert kid is not None and local.holder().lookup(out) is not None  # in a tip
        # The next turn names every kept part, then adds its own rows.
        body = {"messages": [{"role": "user", "content": [
            {"type": "prompt_embeds", "data": f"{wire.PART}{kid}.{k}"}
            for k in range(len(positions))]}]}
        nxt = chat.HOOK.chat_turn({}, "/v1/chat/completions", body, torch.float32, H)
        nxt.wait()
        parts = [nxt.part(p["data"].encode()) for p in body["messages"][0]["content"]]
        ids2 = list(ids)
        text_at = [i for i, t in enumerate(ids) if t != PLACEHOLDER]
        if not same_tokens and text_at:
            ids2[text_at[0]] += 1  # a template that rewrote an earlier turn's text
        more_ids, more_tensors, more_pos = _prompt(more, g)
        ids2 += more_ids
        pos2 = [*positions, *[(s + len(ids), n) for s, n in more_pos]]
        tensors2 = [*parts, *more_tensors]
        before = counters.stats()
        grown = nxt.build(ids2, tensors2, pos2)
        if grown is not None:
            made.append(grown[0])
        after = counters.stats()
        want2 = stock(ids2, tensors2, pos2)
        assert grown is None or (torch.equal(grown[0], want2[0]) and grown[1] == want2[1])
        tokens_ok = same_tokens or not text_at
        assert (after.get("chat_grown", 0) - before.get("chat_grown", 0)) == int(tokens_ok)
        if tokens_ok:  # written after the kept rows, in the same file
            assert grown is not None
            assert local.holder().lookup(grown[0])[0] is local.holder().lookup(out)[0]
            # Its digests: the kept whole blocks' as kept, the rest hashed: as of the whole.
            found = asyncio.run(nxt.hash(grown[0], BLOCK))
            assert found.digests == digests.hash_tensor(grown[0], BLOCK).result().digests
        nxt.close()
    finally:
        turn.close()
        for t in made:
            release_streamed(t)
        local.store().clear()


def test_a_bad_reference_is_refused_and_pins_nothing(shm_env):
    from vllm._shm_embeds.ext.binary import gate
    from vllm._shm_embeds.ext.conversations import chat, local

    def ask(*refs, keep=None):
        body = {"messages": [{"role": "user", "content": [
            {"type": "prompt_embeds", "data": r} for r in refs]}]}
        return chat.HOOK.chat_turn({} if keep is None else {"shm-embeds-keep": keep},
                                   "/v1/chat/completions", body, torch.float32, H)

    for refs, status in [((wire.PART + "x",), 400), ((wire.PART + "A" * 43 + ".0",), 404),
                         ((wire.PART + "../../etc.0",), 404), ((wire.PART + "A" * 43 + ".²",), 400),
                         ((wire.PART + "A" * 43 + ".00",), 400)]:
        with pytest.raises(gate.Refused) as e:
            ask(*refs)
        assert e.value.status == status and "etc" not in str(e.value)
    with pytest.raises(gate.Refused) as e:
        ask(keep="-1")
    assert e.value.status == 400
    assert ask() is None and len(local.store()) == 0


def _kept_turn(salt, rows=6):
    """A chat turn kept under ``salt`` (tokens, one part of ``rows``, tokens): its id."""
    from vllm._shm_embeds.ext.conversations import chat, keeps

    ids = [11, 12, *[PLACEHOLDER] * rows, 13]
    turn = chat.ChatTurn(keeps.KeepRequest(60, salt), {}, [], [], (salt, torch.float32, H, 0, 1 << 20))
    out, _ = turn.build(ids, [torch.randn(rows, H)], [(2, rows)])
    turn.rendered({"prompt_embeds": out, "prompt_token_ids": ids})
    return turn.keep.kid, turn, out


def test_a_json_chat_body_finds_a_turn_kept_under_a_long_salt(shm_env):
    """A cache_salt of 1024 bytes or more is a long string to the JSON path: the turn
    is looked up under the salt as sent, not its placeholder."""
    import json

    from vllm._shm_embeds.ext.binary.common import ServerContext
    from vllm._shm_embeds.ext.conversations import local
    from vllm._shm_embeds.ext.json import json_body
    from vllm._shm_embeds.lifetime.transfer import release_streamed

    salt = "s" * 2000
    kid, turn, out = _kept_turn(salt)
    ctx = ServerContext(hidden_size=H, max_model_len=64, dtype=torch.float32,
                        enable_prompt_embeds=True, max_body_bytes=1 << 20)
    body = json.dumps({"model": "m", "cache_salt": salt, "messages": [{"role": "user", "content": [
        {"type": "prompt_embeds", "data": f"{wire.PART}{kid}.0"}]}]}).encode()
    try:
        prepared = json_body.prepare(body, "/v1/chat/completions", ctx, {"shm-embeds-keep": "5"})
        assert prepared.turn is not None and prepared.upload is not None
        assert prepared.turn.part(f"{wire.PART}{kid}.0".encode()).shape == (6, H)
        prepared.turn.close()
        prepared.upload.release()
    finally:
        turn.close()
        release_streamed(out)
        local.store().clear()


def test_no_memory_for_a_tip_leaves_the_prompt_to_the_caller_and_nothing_claimed(
        shm_env, monkeypatch):
    from vllm._shm_embeds.ext.conversations import chat, local, tips
    from vllm._shm_embeds.lifetime.transfer import release_streamed

    kid, first, out = _kept_turn(None)
    nxt = chat.HOOK.chat_turn({"shm-embeds-keep": "5"}, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "prompt_embeds", "data": f"{wire.PART}{kid}.0"}]}]},
        torch.float32, H)
    nxt.wait()
    tip = local.holder().lookup(out)[0]
    rows, refs, entries = tip.rows, tip.refs, len(local.store())

    def no_memory(self, rows):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tips.Tip, "ensure", no_memory)
    part = nxt.part(f"{wire.PART}{kid}.0")
    ids = [11, 12, *[PLACEHOLDER] * 6, 13, 14, 15]
    try:
        assert nxt.build(ids, [part], [(2, 6)]) is None  # (the caller assembles it)
        # Nothing claimed or used (the file's high-water mark stays charged, as for any
        # claim given back: store.unclaim).
        assert (tip.rows, tip.refs, len(local.store())) == (rows, refs, entries)
    finally:
        nxt.close()
        first.close()
        release_streamed(out)
        local.store().clear()


# -- online, on the main server (TP=2)

# Kept turns go at their TTL: the main server's later tests wait for every kept memfd
# to go (test_conversations.py's _no_kept_left).
TTL = 30  # (on a loaded host a turn and its check may take 15 s)
ZEPHYR = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
          "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# A template that writes the message count first: no turn's prompt begins with the
# last turn's (like templates that drop earlier reasoning or date the prompt).
COUNTED = ("{{ messages|length }} messages\n{% for message in messages %}"
           "<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}<|assistant|>\n")


def _whole(server, messages, **kw):
    """The conversation sent at once, every part as base64 data (no keep)."""
    return sec.chat_openai_json(server["url"], "tiny", None, messages=messages, **kw)


def _same(a, b):
    for x, y in zip(a["choices"], b["choices"], strict=True):
        assert x["message"]["content"] == y["message"]["content"]
        assert [t["logprob"] for t in x["logprobs"]["content"]] == \
            [t["logprob"] for t in y["logprobs"]["content"]]


def _parts(server, seed, *rows):
    w = embed_weights(server["model"])
    g = torch.Generator().manual_seed(seed)
    return [w[torch.randint(3, 1000, (n,), generator=g)].contiguous() for n in rows]


@pytest.mark.integration
@pytest.mark.online
@pytest.mark.parametrize("body", ["json", "binary"])
def test_a_chat_conversation_sends_only_its_new_parts_and_answers_as_the_whole(server, body):
    kw = {"max_tokens": 4, "temperature": 0.0, "logprobs": True, "chat_template": ZEPHYR}
    conv = sec.ChatConversation(server["url"], "tiny", ttl_s=TTL, body=body, cache_salt="chat-" + body)
    parts = _parts(server, 3, 150, 100, 120, 90)
    before, last = server.totals(), 0
    for t, p in enumerate(parts):
        hits = prefix_cache_hits(server)
        out = conv.send(p if t != 2 else ["a text part", p], **kw)
        assert conv.kept_id is not None and conv.last_sent_rows == p.shape[0]
        # The last turn's whole blocks (128 tokens on CPU) hit the prefix cache.
        assert prefix_cache_hits(server) - hits >= last // 128 * 128 > 0 or not t, t
        last = out["usage"]["prompt_tokens"]
        _same(out, _whole(server, conv.messages[:-1], cache_salt="chat-" + body, **kw))
    d = delta(before, server.totals())
    assert conv.misses == 0
    assert d.get("chat_grown") == 3 and not any(k.startswith("chat_rebuilt") for k in d), d
    assert d.get("chat_parts") == 0 + 1 + 2 + 3 and not d.get("kept_copied_bytes"), d
    assert d.get("prefix_rows") == sum(p.shape[0] for p in parts[:3]) + sum(
        p.shape[0] for p in parts[:2]) + parts[0].shape[0]
    assert not d.get("hash_engine_blocks") and d.get("hash_reused_blocks", 0) > 0, d
    # (hop 1's header of a tip is the EngineCore's to remove once it frees the request)
    wait_until(lambda: ours_in(server["seg_dir"]) == [], 30,
               lambda: f"left: {ours_in(server['seg_dir'])}", interval=0.2)


@pytest.mark.integration
@pytest.mark.online
def test_a_template_that_rewrites_earlier_turns_is_built_whole_and_answers_the_same(server):
    kw = {"max_tokens": 4, "temperature": 0.0, "logprobs": True, "chat_template": COUNTED}
    conv = sec.ChatConversation(server["url"], "tiny", ttl_s=TTL)
    before = server.totals()
    for p in _parts(server, 4, 30, 20, 25):
        _same(conv.send(p, **kw), _whole(server, conv.messages[:-1], **kw))
    d = delta(before, server.totals())
    assert not d.get("chat_grown") and d.get("chat_rebuilt.tokens") == 2, d
    assert d.get("kept_copied_bytes", 0) > 0 and conv.misses == 0, d


@pytest.mark.integration
@pytest.mark.online
def test_two_branches_of_one_kept_turn_at_once_with_n(server):
    kw = {"max_tokens": 4, "temperature": 1.0, "seed": 5, "n": 2, "logprobs": True,
          "chat_template": ZEPHYR}
    root = sec.ChatConversation(server["url"], "tiny", ttl_s=TTL)
    first, a, b = _parts(server, 5, 40, 30, 35)
    root.send(first, **kw)
    branches = []
    for p in (a, b):
        c = sec.ChatConversation(server["url"], "tiny", ttl_s=TTL)
        c.messages, c.kept_id, c._kept_parts = list(root.messages), root.kept_id, 1
        branches.append((c, p))
    before = server.totals()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda cp: cp[0].send(cp[1], **kw), branches))
    d = delta(before, server.totals())
    for (c, _), out in zip(branches, outs):
        _same(out, _whole(server, c.messages[:-1], **kw))
    assert d.get("chat_grown") == 1 and d.get("chat_rebuilt.taken") == 1, d  # one copies


@pytest.mark.integration
@pytest.mark.online
def test_every_miss_is_the_one_404_and_stock_refuses_a_reference(server):
    conv = sec.ChatConversation(server["url"], "tiny", ttl_s=TTL, cache_salt="one")
    (p,) = _parts(server, 6, 20)
    conv.send(p, max_tokens=2)
    kept = conv.kept_id
    done = sec.Conversation(server["url"], "tiny", ttl_s=TTL, body="json")
    done.complete(p, max_tokens=2)

    def ask(ref, salt="one"):
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "prompt_embeds", "data": ref}]}]}
        if salt is not None:
            body["cache_salt"] = salt
        return requests.post(server["url"] + "/v1/chat/completions", json=body,
                             headers={wire.KEEP_HEADER: "5"}, timeout=120)

    short = sec.ChatConversation(server["url"], "tiny", ttl_s=1, cache_salt="one")
    short.send(p, max_tokens=2)
    time.sleep(1.5)
    misses = [ask(f"{wire.PART}{kept}.0", "two"), ask(f"{wire.PART}{kept}.0", None),
              ask(f"{wire.PART}{'A' * 43}.0"), ask(f"{wire.PART}{done.kept_id}.0"),
              ask(f"{wire.PART}{short.kept_id}.0")]  # (expired)
    assert [r.status_code for r in misses] == [404] * 5
    assert len({r.json()["error"]["message"] for r in misses}) == 1
    assert kept not in misses[0].text
    # A completions continuation naming the chat turn misses too.
    body = sec.openai_json_body("tiny", sec.Continuation(kept, p, 3), max_tokens=2,
                                cache_salt="one")
    r = requests.post(server["url"] + "/v1/completions", data=bytes(body), timeout=120,
                      headers={wire.KEEP_HEADER: "5", "Content-Type": "application/json"})
    assert r.status_code == 404, r.text
    assert ask(f"{wire.PART}{kept}.0").status_code == 200  # (still held)
    assert ask(f"{wire.PART}{kept}.1").status_code == 400  # no such part


def test_stock_vllm_refuses_a_kept_part_reference():
    """vLLM's own part decode (vllm/renderers/embed_utils.py, 0.32) raises a ValueError
    (answered 400) on a reference: a server without the feature never serves another
    tensor in its place."""
    import types

    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    ref = sec.KeptPart("A" * 43, 0).ref
    assert ref.startswith(wire.PART)
    with pytest.raises(ValueError):
        safe_load_prompt_embeds(types.SimpleNamespace(enable_prompt_embeds=True), ref.encode())
