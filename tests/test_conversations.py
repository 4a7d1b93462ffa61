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

import asyncio
import base64
import concurrent.futures
import io
import json
import os
import socket
import time
import types

import pytest
import requests
import torch
from helpers import asgi_peer, delta, encode_embeds, kept_memfds, ours_in, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from shm_embeds_client import wire

from starlette.datastructures import Headers

import shm_embeds_client as sec
from vllm._shm_embeds.ext.binary import binary, binary_header, gate
from vllm._shm_embeds.ext.binary.common import ServerContext
from vllm._shm_embeds.ext.conversations.store import Store
from vllm._shm_embeds.ext.digests import digests

# -- the store


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Tip:
    """A stand-in for ``tips.Tip``: the store's books only (8 fp32 columns)."""

    dtype, hidden, row_bytes = torch.float32, 8, 32

    def __init__(self):
        self.rows = self.refs = self.charged = 0

    def file_bytes(self):  # (as a real tip's file: ensured to the rows claimed)
        return self.charged


def _store():
    closed = []
    clock = Clock()
    return Store(closed.append, clock), closed, clock


def _keep(store, rows=4, salt=None, ttl=60, max_bytes=1 << 20, max_entries=8):
    """A new tip of ``rows`` kept under a new id: ``(kid or None, tip)``."""
    tip = Tip()
    if store.claim(tip, 0, rows, max_bytes) is not None:
        return None, tip
    kid = store.put(tip, rows, None, salt, ttl, max_entries)
    store.let_go(tip)  # the writer's use ends; the entry's holds it
    return kid, tip


def test_an_id_finds_its_tensor_only_under_its_salt():
    store, closed, _ = _store()
    kid, tip = _keep(store, salt="salt-a", ttl=10)
    assert kid is not None and len(kid) == 43
    for wrong in [(kid, None), (kid, "salt-b"), (kid[:-1] + "x", "salt-a"), ("", "salt-a"),
                  (None, "salt-a"), (kid + "=", "salt-a"), ("../" * 14 + "a", "salt-a")]:
        assert store.pin(*wrong) is None, wrong
    kept = store.pin(kid, "salt-a")
    assert kept is not None and kept.tip is tip and kept.shape == (4, 8)
    store.unpin(kept)
    none_salt, _ = _keep(store, ttl=10)
    assert store.pin(none_salt, "") is None and store.pin(none_salt, None) is not None
    assert closed == []


def test_entries_expire_and_are_let_go_once():
    store, closed, clock = _store()
    kid, tip = _keep(store, ttl=5)
    clock.now += 4.9
    kept = store.pin(kid, None)
    assert kept is not None
    store.unpin(kept)
    clock.now += 0.2
    assert store.pin(kid, None) is None  # expired: as unknown, before any sweep
    assert store.sweep() == 1 and closed == [tip] and store.nbytes == 0
    assert store.sweep() == 0 and closed == [tip]


def test_least_recently_used_goes_first_and_never_a_pinned_one():
    store, closed, _ = _store()
    cap = 3 * 4 * Tip.row_bytes
    ka, a = _keep(store, max_bytes=cap)
    kb, b = _keep(store, max_bytes=cap)
    pinned = store.pin(ka, None)  # a is now the most recent, and pinned
    _keep(store, max_bytes=cap)
    assert closed == []
    kd, d = _keep(store, max_bytes=cap)  # b goes (least recent, unpinned)
    assert closed == [b] and store.pin(kb, None) is None and kd is not None
    # Full of pinned and more recent ones: a bigger tensor is refused, and nothing
    # is evicted for it.
    for k in (kd,):
        store.pin(k, None)
    assert _keep(store, rows=9, max_bytes=cap)[0] is None and closed == [b]
    assert store.nbytes == cap
    store.unpin(pinned)


def test_a_tensor_dropped_while_pinned_goes_at_the_last_unpin():
    store, closed, clock = _store()
    kid, tip = _keep(store, salt="s", ttl=5)
    one, two = store.pin(kid, "s"), store.pin(kid, "s")
    store.drop(kid, "s", "failed")
    assert closed == [] and store.pin(kid, "s") is None
    store.unpin(one)
    assert closed == []
    store.unpin(two)
    assert closed == [tip]


def test_entry_cap_counts_entries():
    store, closed, _ = _store()
    kids = [_keep(store, max_entries=2)[0] for _ in range(3)]
    assert all(kids) and len(store) == 2 and len(closed) == 1


def test_eviction_for_bytes_skips_an_entry_whose_tip_a_request_still_uses():
    """An older entry whose tip a running request still uses frees nothing: a claim
    that needs room evicts the newer entry that frees bytes, and keeps the older id."""
    store, closed, _ = _store()
    cap = 8 * Tip.row_bytes
    old_kid, old_tip = _keep(store, max_bytes=cap)
    assert store.claim(old_tip, 4, 4, cap) is None  # a request uses the tip (no new rows)
    new_kid, new_tip = _keep(store, max_bytes=cap)
    assert store.nbytes == cap
    assert _keep(store, max_bytes=cap)[0] is not None
    assert closed == [new_tip] and store.pin(old_kid, None) is not None
    assert store.pin(new_kid, None) is None


def test_a_tip_grows_in_place_once_then_branches():
    """A continuation claims the rows after its kept ones in the same tip; a second
    continuation of the same kept rows finds them taken (it copies into a new tip);
    the tip is charged for every row claimed and goes with its last use."""
    store, closed, _ = _store()
    kid, tip = _keep(store)
    pre = store.pin(kid, None)
    assert store.claim(tip, 4, 5, 1 << 20) is None
    store.unclaim(tip, 4, 5)  # its body was cut short: no one read row 4
    store.let_go(tip)
    assert tip.rows == 4 and store.nbytes == 5 * Tip.row_bytes
    assert store.claim(tip, 4, 6, 1 << 20) is None  # in place: rows 4..6
    assert store.claim(tip, 4, 7, 1 << 20) == "taken" and tip.rows == 6
    assert store.nbytes == 6 * Tip.row_bytes
    kid2 = store.put(tip, 6, None, None, 60, 8)
    store.let_go(tip)  # the continuation's request ended
    store.unpin(pre)
    store.drop(kid, None, "failed")
    again = store.pin(kid2, None)
    assert closed == [] and again.tip is tip
    assert store.claim(tip, 6, 10 ** 6, 1 << 20) == "full" and tip.rows == 6
    store.clear()
    assert closed == []  # pinned
    store.unpin(again)
    assert closed == [tip] and store.nbytes == 0


_OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(1, 6), st.integers(1, 30)),
    st.tuples(st.just("grow"), st.integers(0, 20), st.integers(1, 6)),
    st.tuples(st.just("cut"), st.integers(0, 20), st.integers(1, 6)),
    st.tuples(st.just("pin"), st.integers(0, 20)),
    st.tuples(st.just("unpin"), st.integers(0, 20)),
    st.tuples(st.just("drop"), st.integers(0, 20)),
    st.tuples(st.just("tick"), st.integers(0, 20)),
    st.tuples(st.just("sweep"),),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_every_tip_is_closed_once_and_never_while_in_use(ops):
    """A model of the store: tips kept, grown in place by a continuation of a pinned
    entry (then kept again) or claimed and given back (a body cut short), pinned,
    dropped, expired; a tip is never closed while
    an entry in the store or a pin uses it, the books never pass the caps, and at
    the end every tip is closed exactly once."""
    store, closed, clock = _store()
    cap = 16 * Tip.row_bytes
    kids, pins, tips = [], [], []
    for op in ops:
        if op[0] == "put":
            kid, tip = _keep(store, op[1], ttl=op[2], max_bytes=cap, max_entries=3)
            tips.append(tip)
            if kid:
                kids.append(kid)
        elif op[0] == "grow" and pins:
            pre = pins[op[1] % len(pins)]
            tip, rows = pre.tip, pre.shape[0]
            if store.claim(tip, rows, rows + op[2], cap) is None:
                if kid := store.put(tip, rows + op[2], None, None, 30, 3):
                    kids.append(kid)
                store.let_go(tip)
        elif op[0] == "cut" and pins:  # a continuation whose body was cut short
            pre = pins[op[1] % len(pins)]
            tip, rows = pre.tip, pre.shape[0]
            if store.claim(tip, rows, rows + op[2], cap) is None:
                store.unclaim(tip, rows, rows + op[2])
                store.let_go(tip)
                assert tip.rows == rows
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
        assert not {id(k.tip) for k in pins} & {id(t) for t in closed}, "closed while pinned"
        assert len(closed) == len(set(map(id, closed))), "closed twice"
        assert store.nbytes <= cap and len(store) <= 3
        assert store.nbytes == sum(t.charged for t in tips if t not in closed)
    while pins:
        store.unpin(pins.pop())
    store.clear()
    registered = [t for t in tips if t.charged]
    assert sorted(map(id, closed)) == sorted(map(id, registered))  # each exactly once
    assert store.nbytes == 0


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


@pytest.mark.parametrize("ref, kept_rows, new, status", [
    ("B" * 43, 3, (40, 8), 404), ("not an id", 3, (40, 8), 404),
    ("B" * 43, 30, (40, 8), 400),  # past --max-model-len (the header's shape)
    ("B" * 43, 3, (40, 7), 400),  # another hidden size
    ("B" * 43, 100, (4096, 1024), 400),  # 16 MiB of new rows past --max-model-len
])
def test_a_refused_continuation_is_answered_once_its_body_is_in(ref, kept_rows, new, status):
    """A miss, or any refusal of the header, reads the rest of the body (within the
    body cap) and drops it: an HTTP/1.1 client that sends its whole body before it
    reads gets the 404 or 400, not a connection closed on unread bytes."""
    big = new[1] == 1024
    ctx = ServerContext(hidden_size=new[1] if big else 8, max_model_len=4096 if big else 64,
                        dtype=torch.float32, enable_prompt_embeds=True,
                        max_body_bytes=(32 if big else 1) << 20)
    messages = []
    with pytest.raises(gate.Refused) as e:
        asyncio.run(_binary_request({"model": "m", "prompt_embeds": sec.Continuation(
            ref, torch.zeros(*new), kept_rows)}, ctx, piece=65536 if big else 256,
            messages=messages))
    assert e.value.status == status, e.value.message
    assert status == 400 or e.value.err_type == wire.PREFIX_NOT_FOUND
    assert messages == []  # every byte read


def test_a_body_refused_for_its_header_past_the_cap_or_chunked_is_not_read():
    """What is drained is bounded: a refused header whose ``Content-Length`` states
    more than the body cap, or none (chunked), is answered without reading on."""
    ctx = ServerContext(hidden_size=8, max_model_len=64, dtype=torch.float32,
                        enable_prompt_embeds=True, max_body_bytes=1024)
    for headers in ((), (("content-length", str(1 << 30)),)):
        messages = []
        with pytest.raises(gate.Refused) as e:
            asyncio.run(_binary_request({"model": "m", "prompt_embeds": sec.Continuation(
                "B" * 43, torch.zeros(40, 7), 3)}, ctx, headers, piece=64, messages=messages))
        assert e.value.status in (400, 413) and messages, e.value.message


async def _binary_request(body, ctx, headers=(), piece=4096, messages=None):
    """``BinaryFormat.prepare`` of ``body`` framed as the client frames it, in this
    process (the body in ``piece``-byte messages, handed out of ``messages``)."""
    h, pieces, _ = sec.frame(body)
    raw = b"".join(map(bytes, pieces))
    messages = [] if messages is None else messages
    messages += [{"type": "http.request", "body": raw[i:i + piece], "more_body": True}
                 for i in range(0, len(raw), piece)]
    messages[-1]["more_body"] = False
    receive, _, _ = asgi_peer(messages)
    fmt = binary.BinaryFormat()
    claim = fmt.claim("/v1/completions", Headers({**h, **dict(headers)}), ctx)
    return await fmt.prepare("/v1/completions", gate.Body(receive, claim.length), ctx, claim)


@st.composite
def continuations(draw):
    block = draw(st.sampled_from([None, 1, 2, 3, 16]))  # None: prefix caching off
    b = block or 4
    return dict(dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                hidden=draw(st.integers(1, 24)), block=block,
                kept=draw(st.integers(1, 3 * b + 2)), new=draw(st.integers(1, 2 * b + 2)),
                salt=draw(st.one_of(st.none(), st.text(min_size=1, max_size=6))),
                seed=draw(st.integers(0, 2**31)))


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(c=continuations())
def test_a_continuation_is_the_whole_tensor_with_vllms_digests(shm_env, c):
    """The binary format run in this process, as the API server runs it: turn 1 is
    kept, turn 2 names it and sends its new rows. The request's tensor is the whole
    tensor, bit for bit (prefix caching on and off), and its block digests are
    vLLM's own ``_gen_prompt_embeds_extra_hash_keys`` on the whole tensor, block by
    block (the kept rows' whole blocks reused, the rest hashed here).

    The new rows are written after the kept ones in the kept rows' own file (a tip
    grown in place: nothing of the kept rows copied).

    Shown to fail (throwaway edits, not kept): ``_write_prefix`` writing the kept
    rows rotated by one row (before tips) -> falsified (bytes); ``TipSink.write``
    writing the new rows one row early, over the last kept row -> falsified
    (bytes); ``_reused_blocks`` reusing one block
    more than the kept rows hold whole -> falsified (the stream hasher refuses)."""
    from vllm.v1.core import kv_cache_utils as kcu

    from vllm._shm_embeds.ext.conversations import prefixes
    ctx = ServerContext.from_model_config(types.SimpleNamespace(
        enable_prompt_embeds=True, dtype=c["dtype"], max_model_len=4096,
        get_hidden_size=lambda: c["hidden"]), c["block"])
    g = torch.Generator().manual_seed(c["seed"])
    whole = torch.randn(c["kept"] + c["new"], c["hidden"], generator=g).to(c["dtype"])
    salt = {} if c["salt"] is None else {"cache_salt": c["salt"]}

    async def run():
        first = await _binary_request({"model": "m", "prompt_embeds": whole[:c["kept"]],
                                       **salt}, ctx, {wire.KEEP_HEADER: "60"})
        await first.upload.settle()
        kept = dict(await first.upload.keeps[0].response_headers(200))
        tip = prefixes.holder().lookup(first.upload.tensors[0])[0]
        first.upload.release()
        kid = kept[wire.KEPT_HEADER.lower().encode()].decode()
        second = await _binary_request({"model": "m", "prompt_embeds": sec.Continuation(
            kid, whole[c["kept"]:], c["kept"]), **salt}, ctx)
        return second.upload, tip

    upload = None
    try:
        upload, tip = asyncio.run(run())
        got = upload.tensors[0]
        assert got.dtype == whole.dtype and torch.equal(got.view(torch.uint8),
                                                        whole.view(torch.uint8))
        # grown in place: the new rows written after the kept ones, in their file
        assert prefixes.holder().lookup(got) == (tip, whole.shape[0])
        d = digests.attached(got)
        if c["block"] is None:
            assert d is None
        else:
            stub = types.SimpleNamespace(prompt_embeds=whole, _prompt_embeds_per_block_hashes={})
            for s in range(0, whole.shape[0], c["block"]):
                e = s + c["block"]
                assert [("prompt_embeds", d.digest(s, e))] == \
                    kcu._gen_prompt_embeds_extra_hash_keys(stub, s, e), s
    finally:
        if upload is not None:
            upload.release()
        prefixes.store().clear()


@pytest.mark.parametrize("copy", ["slow", "fails", "breaks"])
def test_an_id_is_answered_before_its_copy_is_done(shm_env, monkeypatch, copy):
    """A keep that must copy (here: no tip to write the body into as it arrives, as
    for a JSON body) has its id in the 200's headers at once, while the copy still
    runs: a continuation naming it waits for the copy and is the whole tensor; if
    the copy fails (no room; or any error midway, e.g. torch's allocator: a tip
    whose bytes were not all written is never kept), the continuation is the same
    404 as any reference not held, and nothing is left."""
    import threading

    from vllm._shm_embeds.ext.conversations import prefixes

    ctx = ServerContext.from_model_config(types.SimpleNamespace(
        enable_prompt_embeds=True, dtype=torch.float32, max_model_len=64,
        get_hidden_size=lambda: 8), 4)
    whole = torch.randn(11, 8, generator=torch.Generator().manual_seed(7))
    go = threading.Event()
    real = prefixes.KeepRequest._copy

    def held_back(tensor, digests, kept):
        go.wait(30)
        if copy == "fails":
            monkeypatch.setattr(prefixes.tips, "Tip", _no_space)
        if copy == "breaks":
            monkeypatch.setattr(prefixes.tips.Tip, "write", _breaks)
        return real(tensor, digests, kept)

    monkeypatch.setattr(prefixes.KeepRequest, "_copy", staticmethod(held_back))
    monkeypatch.setattr(prefixes.Hook, "open_sink", lambda self, *a: None)

    async def run():
        first = await _binary_request({"model": "m", "prompt_embeds": whole[:6]}, ctx,
                                      {wire.KEEP_HEADER: "60"})
        keep = first.upload.keeps[0]
        headers = dict(await keep.response_headers(200))
        assert not keep.future.done()  # answered while the copy waits
        kid = headers[wire.KEPT_HEADER.lower().encode()].decode()
        second = asyncio.ensure_future(_binary_request({"model": "m", "prompt_embeds":
                                                        sec.Continuation(kid, whole[6:], 6)}, ctx))
        await asyncio.sleep(0.2)
        assert not second.done()  # waits for the copy
        go.set()
        try:
            out = await second
        finally:
            await first.upload.settle()
            first.upload.release()
        return out.upload

    try:
        if copy != "slow":
            with pytest.raises(gate.Refused) as e:
                asyncio.run(run())
            assert e.value.status == 404 and e.value.err_type == wire.PREFIX_NOT_FOUND
            assert prefixes.store().nbytes == 0 and kept_memfds(os.getpid()) == 0
        else:
            upload = asyncio.run(run())
            assert torch.equal(upload.tensors[0], whole)
            upload.release()
    finally:
        prefixes.store().clear()


def test_a_tip_that_cannot_grow_leaves_the_continuation_to_a_segment(shm_env, monkeypatch):
    """The kept rows' file cannot grow (ENOMEM from ftruncate): the continuation is
    written into a segment of its own (the kept rows copied), whole, never a 500;
    the rows it had claimed are given back."""
    import errno

    from vllm._shm_embeds.ext.conversations import prefixes

    ctx = ServerContext.from_model_config(types.SimpleNamespace(
        enable_prompt_embeds=True, dtype=torch.float32, max_model_len=64,
        get_hidden_size=lambda: 8), 4)
    whole = torch.randn(11, 8, generator=torch.Generator().manual_seed(5))

    def no_memory(self, rows):
        raise OSError(errno.ENOMEM, "no memory")

    async def run():
        first = await _binary_request({"model": "m", "prompt_embeds": whole[:6]}, ctx,
                                      {wire.KEEP_HEADER: "60"})
        kid = dict(await first.upload.keeps[0].response_headers(200))[
            wire.KEPT_HEADER.lower().encode()].decode()
        tip = prefixes.holder().lookup(first.upload.tensors[0])[0]
        first.upload.release()
        monkeypatch.setattr(prefixes.tips.Tip, "ensure", no_memory)
        second = await _binary_request({"model": "m", "prompt_embeds": sec.Continuation(
            kid, whole[6:], 6)}, ctx)
        return second.upload, tip

    try:
        upload, tip = asyncio.run(run())
        assert torch.equal(upload.tensors[0], whole)
        assert prefixes.holder().lookup(upload.tensors[0]) is None  # a segment
        assert tip.rows == 6  # the claim given back
        upload.release()
    finally:
        prefixes.store().clear()
    assert kept_memfds(os.getpid()) == 0


def test_a_continuation_must_be_the_bodys_only_tensor():
    """Two continuations in one body (each whole tensor made from a few new rows) are
    refused before anything is read or made: one whole tensor per body."""
    ctx = ServerContext(hidden_size=8, max_model_len=64, dtype=torch.float32,
                        enable_prompt_embeds=True, max_body_bytes=1 << 20)
    _, pieces, _ = sec.frame({"model": "m", "prompt_embeds": sec.Continuation(
        "x" * 43, torch.zeros(1, 8), 30)})
    header = json.loads(bytes(pieces[0]))
    header["prompt_embeds"] = [header["prompt_embeds"]] * 2
    head = json.dumps(header).encode()
    raw = head + bytes(pieces[1]) * 2
    h = Headers({"content-type": wire.CONTENT_TYPE, wire.HEADER_LENGTH: str(len(head)),
                 "content-length": str(len(raw))})
    receive, _, _ = asgi_peer([{"type": "http.request", "body": raw, "more_body": False}])
    fmt = binary.BinaryFormat()
    claim = fmt.claim("/v1/completions", h, ctx)
    with pytest.raises(gate.Refused) as e:
        asyncio.run(fmt.prepare("/v1/completions", gate.Body(receive, claim.length), ctx, claim))
    assert e.value.status == 400 and "only prompt_embeds tensor" in e.value.message


def test_a_cancelled_waiter_leaves_a_pending_id_to_the_others(shm_env):
    """A request waiting for a keep's copy that is cancelled (a client gone) does not
    cancel the copy's shared future: the other waiter gets the rows."""
    from vllm._shm_embeds.ext.conversations import prefixes

    store = prefixes.store()
    kid, kept = store.reserve((4, 8), torch.float32, None, 60, 8)

    async def run():
        first = prefixes.HOOK.resolve(kid, {}, torch.float32, 8)
        second = prefixes.HOOK.resolve(kid, {}, torch.float32, 8)
        waiting = asyncio.ensure_future(first.ready())
        other = asyncio.ensure_future(second.ready())
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.sleep(0.05)
        tip = prefixes.new_tip(torch.float32, 4, 8)
        tip.ensure(4)
        tip.write(memoryview(bytes(128)), 0)
        store.fill(kept, tip)
        store.let_go(tip)
        await other
        assert second.tensor is not None and second.tensor.shape == (4, 8)
        first.release()
        second.release()

    try:
        asyncio.run(run())
    finally:
        store.clear()


def test_a_json_keep_of_bytes_never_sent_is_not_made(shm_env):
    """A JSON payload that the loader makes into a stride-0 view (a few bytes on the
    wire, T x H values) with a keep header: answered without an id, nothing copied."""
    from vllm._shm_embeds.ext.json import json_body

    ctx = _json_ctx()
    raw = bytes(sec.openai_json_body("m", torch.ones(1, 8)))
    body = json.loads(raw)
    buf = io.BytesIO()
    torch.save(torch.ones(1, 8).expand(40, 8), buf)
    body["prompt_embeds"] = base64.b64encode(buf.getvalue()).decode()
    body["pad"] = "x" * 2000
    raw = json.dumps(body).encode()
    h = Headers({"content-type": "application/json", "content-length": str(len(raw)),
                 wire.KEEP_HEADER: "60"})
    receive, _, _ = asgi_peer([{"type": "http.request", "body": raw, "more_body": False}])
    fmt = json_body.JsonFormat()
    claim = fmt.claim("/v1/completions", h, ctx)
    out = asyncio.run(fmt.prepare("/v1/completions", gate.Body(receive, claim.length), ctx,
                                  claim))
    try:
        assert out.upload is None or out.upload.keeps == []
    finally:
        if out.upload is not None:
            out.upload.release()


def _breaks(*args, **kwargs):
    raise RuntimeError("DefaultCPUAllocator: can't allocate memory")


def _no_space(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "no space")


def _json_ctx(hidden=8, block=None):
    return ServerContext.from_model_config(types.SimpleNamespace(
        enable_prompt_embeds=True, dtype=torch.float32, max_model_len=64,
        get_hidden_size=lambda: hidden), block)


def test_a_json_continuation_is_refused_by_stock_vllm():
    """The JSON continuation object in ``prompt_embeds`` fails vLLM's own request
    model (400), so a server without the feature never serves the new rows alone."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    body = json.loads(sec.openai_json_body("m", sec.Continuation("x" * 43, torch.zeros(3, 8), 2)))
    assert set(body["prompt_embeds"]) == {wire.PREFIX, wire.PREFIX_ROWS, wire.PREFIX_DATA}
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


@pytest.mark.parametrize("salt", [None, "s" * 2000])
def test_a_json_conversation_in_process(shm_env, monkeypatch, salt):
    """The JSON path run in this process: turn 1 kept (a body below the minimum size,
    claimed for its keep header), turn 2 a continuation object: the whole tensor, bit
    for bit, with vLLM's digests; then a miss is a 404 and bad objects are 400s. A
    ``cache_salt`` as long as a payload (the JSON path's long strings) binds as sent."""
    from vllm.v1.core import kv_cache_utils as kcu

    from vllm._shm_embeds.ext.conversations import prefixes
    from vllm._shm_embeds.ext.json import json_body

    ctx = _json_ctx(block=4)
    whole = torch.randn(13, 8, generator=torch.Generator().manual_seed(5))
    fmt = json_body.JsonFormat()
    monkeypatch.setenv("VLLM_SHM_EMBEDS_MIN_BYTES", "1000000")
    h = Headers({"content-type": "application/json", "content-length": "100",
                 wire.KEEP_HEADER: "60"})
    assert fmt.claim("/v1/completions", h, ctx) is not None  # small, but a keep
    assert fmt.claim("/v1/completions", Headers({
        "content-type": "application/json", "content-length": "100"}), ctx) is None
    uploads = []
    try:
        extra = {} if salt is None else {"cache_salt": salt}
        first = json_body.prepare(bytes(sec.openai_json_body("m", whole[:9], **extra)),
                                  "/v1/completions", ctx, h)
        first.keep.start(next(t for t in first.upload.tensors if t is not None))
        first.upload.keeps.append(first.keep)
        uploads.append(first.upload)
        kept = dict(asyncio.run(first.keep.response_headers(200)))
        kid = kept[wire.KEPT_HEADER.lower().encode()].decode()

        def cont(ref=kid, rows=9, new=whole[9:], **obj):
            body = json.loads(sec.openai_json_body("m", sec.Continuation(ref, new, rows),
                                                   **extra))
            body["prompt_embeds"].update(obj)
            return json_body.prepare(json.dumps(body).encode(), "/v1/completions", ctx,
                                     Headers({}))

        second = cont()
        uploads.append(second.upload)
        name = json.loads(second.body)["prompt_embeds"]
        got = [t for t in second.upload.tensors if t is not None]
        assert len(got) == 1 and name.endswith(f".{second.upload.tensors.index(got[0])}")
        assert torch.equal(got[0], whole)
        d = digests.attached(got[0])
        stub = types.SimpleNamespace(prompt_embeds=whole, _prompt_embeds_per_block_hashes={})
        for s in range(0, 13, 4):
            assert [("prompt_embeds", d.digest(s, s + 4))] == \
                kcu._gen_prompt_embeds_extra_hash_keys(stub, s, s + 4)
        for ref, status in (("A" * 43, 404), ("not an id", 404)):
            with pytest.raises(gate.Refused) as e:
                cont(ref)
            assert e.value.status == status and e.value.err_type == wire.PREFIX_NOT_FOUND
        for bad in ({"rows": 8}, {"extra": 1}, {wire.PREFIX_ROWS: True},
                    {wire.PREFIX_DATA: "AAAA" * 400}, {"new": torch.zeros(2, 7)}):
            args = {k: v for k, v in bad.items() if k in ("rows", "new")}
            with pytest.raises(gate.Refused) as e:
                cont(**args, **{k: v for k, v in bad.items() if k not in args})
            assert e.value.status == 400, bad
        # The new rows are vLLM's loader's (renderers/embed_utils.py
        # safe_load_prompt_embeds, 0.32): any floating-point dtype is cast to the
        # model's and a leading 1 squeezed, then served as the cast rows; integer
        # rows are vLLM's 400.
        for new in (whole[9:].half(), whole[9:].bfloat16(), whole[9:].double(), whole[9:][None]):
            served = cont(**{wire.PREFIX_DATA: encode_embeds(new)})  # (the client sends fewer)
            uploads.append(served.upload)
            [got] = [t for t in served.upload.tensors if t is not None]
            assert got.dtype == torch.float32, new.dtype
            assert torch.equal(got, torch.cat([whole[:9], new.squeeze(0).float()])), new.shape
        with pytest.raises(gate.Refused) as e:
            cont(**{wire.PREFIX_DATA: encode_embeds(whole[9:].to(torch.int32))})
        assert e.value.status == 400 and "floating-point" in e.value.message, e.value.message
    finally:
        for upload in uploads:
            upload.release()
        prefixes.store().clear()


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(obj=st.dictionaries(st.sampled_from([wire.PREFIX, wire.PREFIX_ROWS, wire.PREFIX_DATA,
                                            "x"]),
                           st.one_of(st.none(), st.booleans(), st.integers(-2, 2**40),
                                     st.text(max_size=50), st.lists(st.integers(), max_size=3),
                                     st.just("QUFB" * 300), st.just("kept")),
                           max_size=4),
       pad=st.booleans())
def test_json_continuation_objects_are_refused_or_served(shm_env, obj, pad):
    """Any object in ``prompt_embeds`` (fuzzed keys and values, a kept id among them):
    the JSON path serves it, refuses it (400/404), or leaves it to vLLM (which
    refuses an object there); nothing else escapes and nothing is left."""
    from vllm._shm_embeds.ext.conversations import prefixes
    from vllm._shm_embeds.ext.json import json_body

    ctx = _json_ctx()
    kept = prefixes.KeepRequest(60, None)
    kept.start(torch.ones(4, 8))
    kept.future.result()
    kid = kept.kid
    body = {"model": "m", "prompt_embeds": {k: kid if v == "kept" else v for k, v in obj.items()},
            "pad": "x" * 2000 if pad else ""}
    out = None
    try:
        out = json_body.prepare(json.dumps(body).encode(), "/v1/completions", ctx, Headers({}))
    except gate.Refused as e:
        assert e.status in (400, 404)
    finally:
        if out is not None and out.upload is not None:
            out.upload.release()
        prefixes.store().clear()


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
    """At their TTL every kept tensor goes: no segment left, no kept memfd open. Checked
    once, by the last online test here, for every conversation the main server kept
    before it (each waiting for its own TTL cost the suite a minute of idle engine)."""
    def left():
        return ours_in(server["seg_dir"]), kept_memfds(server.proc.pid)

    wait_until(lambda: left() == ([], 0), 45, lambda: f"kept left: {left()}", interval=0.2)


@pytest.mark.integration
@pytest.mark.online
def test_a_conversation_sends_only_its_new_rows_and_answers_as_the_whole(server):
    url = server["url"]
    sizes = [300, 140, 90]  # 300 rows: two whole blocks of 128 kept with their digests
    ids, embeds = _turns(server, 37, sizes)
    conv = sec.Conversation(url, "tiny", ttl_s=20)  # (on a loaded host a turn may come 10 s after the last)
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
        # Written into the kept rows' file as it arrived, sent by its descriptor; from
        # turn 2 after the kept rows, in place: nothing of the history copied.
        assert d.get("hop1_region_tensors") == 1 and "hop1_stock_tensors" not in d
        assert d.get("tip_grown", 0) == (1 if turn else 0) and "kept_copied_bytes" not in d
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


@pytest.mark.integration
@pytest.mark.online
def test_a_json_conversation_sends_only_its_new_rows_and_answers_as_the_whole(server):
    url = server["url"]
    sizes = [300, 140, 90]
    ids, embeds = _turns(server, 43, sizes)
    conv = sec.Conversation(url, "tiny", ttl_s=10, body="json", cache_salt="carol")
    kw = {**KW, "return_token_ids": True}  # (turn 3's text: vLLM's detokenizer echoes
    end = 0                                  # the prompt for these ids, stock too)
    for turn, n in enumerate(sizes):
        before = server.totals()
        got = conv.complete(embeds[end:end + n], **kw)
        end += n
        d = delta(before, server.totals())
        want = _answer_of_ids(url, ids[:end], cache_salt="carol", return_token_ids=True)
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"], turn
        assert len(got["choices"][0]["token_ids"]) == 6
        assert conv.last_sent_rows == n and conv.kept_id is not None and conv.misses == 0
        assert d.get("kept_tensors") == 1, d
        if not turn:  # decoded into a segment, kept by a copy
            assert d.get("hop1_handover_tensors") == 1, d
            assert d.get("kept_copied_bytes") == n * embeds.shape[1] * embeds.element_size()
        else:  # the new rows written after the kept ones, in place
            assert d.get("hop1_region_tensors") == 1 and d.get("tip_grown") == 1, d
            assert "kept_copied_bytes" not in d, d
        if turn:
            assert d.get("prefix_hits") == 1 and d.get("prefix_rows") == end - n, d
            assert d.get("json_tensors") == 1 and d.get("hash_engine_blocks", 0) == 0, d


@pytest.mark.integration
@pytest.mark.online
def test_a_reference_not_held_is_a_404_the_same_for_every_cause(server):
    url = server["url"]
    ids, embeds = _turns(server, 38, [200, 40])
    conv = sec.Conversation(url, "tiny", ttl_s=6, cache_salt="alice")
    _answer_of_ids(url, ids[:8])  # a cold server's first request may take seconds
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


@pytest.mark.integration
@pytest.mark.online
def test_aborted_continuations_leave_the_kept_rows_as_they_were(server):
    """A continuation cut off while its body arrives, and one whose client goes away
    while vLLM decodes it: the kept prefix still answers the next turn as the whole
    tensor, and goes at its TTL (no pin is left behind)."""
    url = server["url"]
    ids, embeds = _turns(server, 42, [220, 60])
    conv = sec.Conversation(url, "tiny", ttl_s=8)
    conv.complete(embeds[:220], **KW)
    h, pieces, _ = sec.frame({"model": "tiny", "prompt_embeds": sec.Continuation(
        conv.kept_id, embeds[220:], 220), **KW, "max_tokens": 400, "stream": True,
        "ignore_eos": True})
    raw = b"".join(map(bytes, pieces))
    host, port = url.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in h.items())
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # cut midway
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode()
                     + raw[:len(raw) - 5000])
    with requests.post(url + "/v1/completions", data=raw, headers=h, stream=True,
                       timeout=60) as r:  # gone after its first token
        assert r.status_code == 200
        next(r.iter_lines())
    got = conv.complete(embeds[220:], **KW)
    assert conv.misses == 0 and conv.last_sent_rows == 60
    assert got["choices"][0]["text"] == _answer_of_ids(url, ids)["choices"][0]["text"]


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
    assert d.get("kept_tensors", 0) <= 1  # its copy (done before or after the answer) let go
    _no_kept_left(server)
