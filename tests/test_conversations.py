# SPDX-License-Identifier: Apache-2.0
"""Conversations (issue 37): kept ``prompt_embeds`` named as a later request's prefix.

Unit: the store (ids bound to ``cache_salt``, TTL, LRU, caps, pins; a
model-based hypothesis test that every kept tensor is let go exactly once and
never while pinned), and the binary parser refusing the prefix parameter when
no extension reads it (a reference is never served as its new rows alone).

Online, on the suite's main server (TP=2): a conversation's turns send only
their new rows, and every answer equals the answer for the whole tensor's
token ids; the kept rows are neither resent nor hashed again (counters), the
prefix cache hits them; a reference the server does not hold (unknown id,
another ``cache_salt``, expired) is a 404 ``PrefixNotFound``, the same for
each; two branches of one kept prefix at once, with ``n`` > 1; nothing left.
"""

import concurrent.futures
import json
import time

import pytest
import requests
import torch
from helpers import delta, ours_in, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from shm_embeds_client import wire

import shm_embeds_client as sec
from vllm._shm_embeds.ext.binary import binary_header
from vllm._shm_embeds.ext.binary.common import ServerContext
from vllm._shm_embeds.ext.conversations.store import Store

# -- the store


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _store():
    released = []
    clock = Clock()
    return Store(released.append, clock), released, clock


def _t(rows=4):
    return torch.zeros(rows, 8)


def test_an_id_finds_its_tensor_only_under_its_salt():
    store, released, _ = _store()
    t = _t()
    kid = store.put(t, None, "salt-a", 10, 1 << 20, 8)
    assert kid is not None and len(kid) == 43
    for wrong in [(kid, None), (kid, "salt-b"), (kid[:-1] + "x", "salt-a"), ("", "salt-a"),
                  (None, "salt-a"), (kid + "=", "salt-a"), ("../" * 14 + "a", "salt-a")]:
        assert store.pin(*wrong) is None, wrong
    kept = store.pin(kid, "salt-a")
    assert kept is not None and kept.tensor is t
    store.unpin(kept)
    none_salt = store.put(_t(), None, None, 10, 1 << 20, 8)
    assert store.pin(none_salt, "") is None and store.pin(none_salt, None) is not None
    assert released == []


def test_entries_expire_and_are_let_go_once():
    store, released, clock = _store()
    t = _t()
    kid = store.put(t, None, None, 5, 1 << 20, 8)
    clock.now += 4.9
    kept = store.pin(kid, None)
    assert kept is not None
    store.unpin(kept)
    clock.now += 0.2
    assert store.pin(kid, None) is None  # expired: as unknown, before any sweep
    assert store.sweep() == 1 and released == [t] and store.nbytes == 0
    assert store.sweep() == 0 and released == [t]


def test_least_recently_used_goes_first_and_never_a_pinned_one():
    store, released, _ = _store()
    a, b, c = _t(), _t(), _t()
    ka = store.put(a, None, None, 60, 3 * a.nbytes, 8)
    kb = store.put(b, None, None, 60, 3 * a.nbytes, 8)
    pinned = store.pin(ka, None)  # a is now the most recent, and pinned
    store.put(c, None, None, 60, 3 * a.nbytes, 8)
    assert released == []
    d = _t()
    kd = store.put(d, None, None, 60, 3 * a.nbytes, 8)  # b goes (least recent, unpinned)
    assert released == [b] and store.pin(kb, None) is None and kd is not None
    # Full of pinned and more recent ones: a new tensor is refused and let go itself.
    for k in (kd,):
        store.pin(k, None)
    big = _t(64)
    assert store.put(big, None, None, 60, 3 * a.nbytes, 8) is None and released[-1] is big
    store.unpin(pinned)


def test_a_tensor_dropped_while_pinned_goes_at_the_last_unpin():
    store, released, clock = _store()
    t = _t()
    kid = store.put(t, None, "s", 5, 1 << 20, 8)
    one, two = store.pin(kid, "s"), store.pin(kid, "s")
    store.drop(kid, "s", "failed")
    assert released == [] and store.pin(kid, "s") is None
    store.unpin(one)
    assert released == []
    store.unpin(two)
    assert released == [t]


def test_entry_cap_counts_entries():
    store, released, _ = _store()
    kids = [store.put(_t(), None, None, 60, 1 << 30, 2) for _ in range(3)]
    assert all(kids) and len(store) == 2 and len(released) == 1


_OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(1, 6), st.integers(1, 30)),
    st.tuples(st.just("pin"), st.integers(0, 20)),
    st.tuples(st.just("unpin"), st.integers(0, 20)),
    st.tuples(st.just("drop"), st.integers(0, 20)),
    st.tuples(st.just("tick"), st.integers(0, 20)),
    st.tuples(st.just("sweep"),),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_every_kept_tensor_is_let_go_once_and_never_while_pinned(ops):
    store, released, clock = _store()
    kids, pins, tensors = [], [], []
    for op in ops:
        if op[0] == "put":
            t = _t(op[1])
            tensors.append(t)
            kid = store.put(t, None, None, op[2], 16 * 8 * 4, 3)
            if kid:
                kids.append(kid)
        elif op[0] == "pin" and kids:
            kept = store.pin(kids[op[1] % len(kids)], None)
            if kept is not None:
                pins.append(kept)
        elif op[0] == "unpin" and pins:
            store.unpin(pins.pop(op[1] % len(pins)))
        elif op[0] == "drop" and kids:
            store.drop(kids[op[1] % len(kids)], None, "failed")
        elif op[0] == "tick":
            clock.now += op[1]
        elif op[0] == "sweep":
            store.sweep()
        held = {id(k.tensor) for k in pins}
        assert not held & {id(t) for t in released}, "let go while pinned"
        assert store.nbytes <= 16 * 8 * 4 and len(store) <= 3
    while pins:
        store.unpin(pins.pop())
    store.clear()
    assert sorted(map(id, released)) == sorted(map(id, tensors))  # each exactly once


def test_the_prefix_parameter_is_refused_where_no_extension_reads_it():
    """Without the conversations extension's hook the binary format refuses a
    descriptor naming a prefix: it is never served as its new rows alone."""
    limits = ServerContext(hidden_size=8, max_model_len=64, dtype=torch.float32,
                           enable_prompt_embeds=True, max_body_bytes=1 << 20)
    h, pieces, _ = sec.frame({"model": "m", "prompt_embeds": sec.Continuation(
        "x" * 43, torch.zeros(2, 8), 3)})
    raw = pieces[0]
    desc = json.loads(raw)["prompt_embeds"]
    # The sizes of a continuation disagree with its shape, so even a parser that
    # ignores the parameter (an older plugin) refuses it.
    assert desc["shape"] == [5, 8] and desc["parameters"][wire.BINARY_DATA_SIZE] == 64
    with pytest.raises(binary_header.BinaryBodyError) as e:
        binary_header.parse_header(raw, "/v1/completions", limits, None)
    assert e.value.status == 400 and wire.PREFIX in e.value.message
    spec = binary_header.parse_header(raw, "/v1/completions", limits, None,
                                      frozenset({wire.PREFIX})).specs[0]
    assert spec.extra == ((wire.PREFIX, "x" * 43),) and spec.nbytes == 64
    assert spec.shape == (5, 8)
    for size in (0, 5 * 32, 6 * 32, 33):  # a whole number of rows, fewer than the shape's
        desc["parameters"][wire.BINARY_DATA_SIZE] = size
        with pytest.raises(binary_header.BinaryBodyError):
            binary_header.parse_header(json.dumps({"model": "m", "prompt_embeds": desc}).encode(),
                                       "/v1/completions", limits, None, frozenset({wire.PREFIX}))


# -- online

KW = {"max_tokens": 6, "temperature": 0.0}


def _answer_of_ids(url, ids, **kw):
    return requests.post(url + "/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": ids.tolist(), **KW, **kw}).json()


def _turns(server, seed, sizes):
    ids = torch.randint(3, 1000, (sum(sizes),), generator=torch.Generator().manual_seed(seed))
    return ids, server["weights"][ids].contiguous()


def _prefix_cache_hits(url):
    """vLLM's ``vllm:prefix_cache_hits`` counter (tokens), summed over engines."""
    text = requests.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def _no_kept_left(server):
    wait_until(lambda: ours_in(server["seg_dir"]) == [], 30,
               lambda: f"kept segments left: {ours_in(server['seg_dir'])}", interval=0.2)


@pytest.mark.integration
@pytest.mark.online
def test_a_conversation_sends_only_its_new_rows_and_answers_as_the_whole(server):
    url = server["url"]
    sizes = [300, 140, 90]  # 300 rows: two whole blocks of 128 kept with their digests
    ids, embeds = _turns(server, 37, sizes)
    conv = sec.Conversation(url, "tiny", ttl_s=10)
    row_bytes = embeds.shape[1] * embeds.element_size()
    end = 0
    for turn, n in enumerate(sizes):
        new = embeds[end:end + n]
        end += n
        before, hits = server.totals(), _prefix_cache_hits(url)
        got = conv.complete(new, **KW)
        d, hits = delta(before, server.totals()), _prefix_cache_hits(url) - hits
        want = _answer_of_ids(url, ids[:end])
        assert got["choices"][0]["text"] == want["choices"][0]["text"], turn
        assert conv.last_sent_rows == n and conv.kept_id is not None and conv.misses == 0
        assert d.get("binary_bytes") == n * row_bytes  # only the new rows arrived
        assert d.get("kept_tensors") == 1 and d.get("kept_bytes") == end * row_bytes
        assert d.get("hop1_handover_tensors") == 1 and "hop1_stock_tensors" not in d
        if turn:
            kept_rows = end - n
            assert d.get("prefix_hits") == 1 and d.get("prefix_rows") == kept_rows
            # The kept rows' whole blocks are not hashed again: only the rest is.
            assert d.get("hash_api_blocks") == -(-end // 128) - kept_rows // 128, d
            assert d.get("hash_engine_blocks", 0) == 0, d
            assert hits >= kept_rows // 128 * 128, hits  # the kept rows' KV is reused
    # The whole tensor sent at once answers the same, and hits the prefix cache.
    assert sec.complete(url, "tiny", embeds, **KW)["choices"][0]["text"] == \
        _answer_of_ids(url, ids)["choices"][0]["text"]
    _no_kept_left(server)  # the TTL (10 s) ran out: every kept segment unlinked


@pytest.mark.integration
@pytest.mark.online
def test_a_reference_not_held_is_a_404_the_same_for_every_cause(server):
    url = server["url"]
    ids, embeds = _turns(server, 38, [200, 40])
    conv = sec.Conversation(url, "tiny", ttl_s=6, cache_salt="alice")
    t0 = time.monotonic()
    conv.complete(embeds[:200], **KW)
    kid = conv.kept_id
    assert kid is not None

    def refer(ref, kept_rows=200, **body):
        h, pieces, _ = sec.frame({"model": "tiny", "prompt_embeds": sec.Continuation(
            ref, embeds[200:], kept_rows), **KW, **body})
        return requests.post(url + "/v1/completions", data=b"".join(map(bytes, pieces)),
                             headers=h, timeout=60)

    answers = [refer(kid), refer(kid, cache_salt="bob"), refer("A" * 43, cache_salt="alice"),
               refer("not an id", cache_salt="alice")]
    for r in answers:
        assert r.status_code == 404, r.text
        assert r.json()["error"]["type"] == wire.PREFIX_NOT_FOUND
        assert kid not in r.text
    assert len({r.text for r in answers}) == 1  # nothing tells one cause from another
    wrong = refer(kid, kept_rows=199, cache_salt="alice")  # the shape must count them
    assert wrong.status_code == 400 and "kept rows" in wrong.json()["error"]["message"]
    ok = refer(kid, cache_salt="alice")
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == \
        _answer_of_ids(url, ids, cache_salt="alice")["choices"][0]["text"]
    time.sleep(max(0.0, t0 + 6.7 - time.monotonic()))  # expired
    r = refer(kid, cache_salt="alice")
    assert r.status_code == 404 and r.text == answers[0].text
    # The client resends the whole history by itself on a miss.
    got = conv.complete(embeds[200:], **KW)
    assert conv.misses == 1 and conv.last_sent_rows == 40 + 240  # the reference, then all
    assert got["choices"][0]["text"] == ok.json()["choices"][0]["text"]
    _no_kept_left(server)


@pytest.mark.integration
@pytest.mark.online
def test_two_branches_of_one_kept_prefix_at_once_with_n(server):
    url = server["url"]
    ids, embeds = _turns(server, 39, [260, 70])
    other = server["weights"][torch.randint(3, 1000, (50,),
                                            generator=torch.Generator().manual_seed(40))]
    root = sec.Conversation(url, "tiny", ttl_s=10)
    root.complete(embeds[:260], **KW)
    a, b = root.fork(), root.fork()
    kw = {**KW, "n": 2, "temperature": 1.0, "seed": 1234}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fa = pool.submit(a.complete, embeds[260:], **kw)
        fb = pool.submit(b.complete, other.contiguous(), **kw)
        got_a, got_b = fa.result(), fb.result()
    for got, rest in ((got_a, embeds[260:]), (got_b, other)):
        whole = sec.complete(url, "tiny", torch.cat([embeds[:260], rest]).contiguous(), **kw)
        assert [c["text"] for c in got["choices"]] == [c["text"] for c in whole["choices"]]
    assert a.last_sent_rows == 70 and b.last_sent_rows == 50
    _no_kept_left(server)


@pytest.mark.integration
@pytest.mark.online
def test_a_bad_keep_or_a_failed_request_keeps_nothing(server):
    url = server["url"]
    _, embeds = _turns(server, 41, [64])
    for bad in ("0", "-1", "nan", "inf", "soon"):
        h, pieces, _ = sec.frame({"model": "tiny", "prompt_embeds": embeds, **KW})
        r = requests.post(url + "/v1/completions", data=b"".join(map(bytes, pieces)),
                          headers={**h, wire.KEEP_HEADER: bad}, timeout=60)
        assert r.status_code == 400 and wire.KEEP_HEADER in r.json()["error"]["message"]
    before = server.totals()
    h, pieces, _ = sec.frame({"model": "tiny", "prompt_embeds": embeds, "max_tokens": -1})
    r = requests.post(url + "/v1/completions", data=b"".join(map(bytes, pieces)),
                      headers={**h, wire.KEEP_HEADER: "30"}, timeout=60)
    assert r.status_code == 400 and wire.KEPT_HEADER.lower() not in r.headers
    d = wait_until(lambda: (x := delta(before, server.totals())).get("kept_dropped.failed")
                   and x, 10, "the failed request's kept tensor dropped")
    assert d.get("kept_tensors") == 1
    _no_kept_left(server)
