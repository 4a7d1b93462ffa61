# SPDX-License-Identifier: Apache-2.0
"""Fuzz the sibling socket's parser and its lease (``ext/conversations/siblings.py``).

A sibling API server's messages are bytes from another process: ``recv`` must give a
message or raise one of the errors its connection thread ends on (never another, never
an fd left open), a chat turn's rendered prompt is whole or refused, and any sequence of
messages to a lease (a chat turn's too) must leave the store's accounting as it was once
the connection ends (no pin, use or charge left behind).
"""

import array
import json
import os
import socket

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm._shm_embeds.ext.conversations import rendered, siblings, tips
from vllm._shm_embeds.ext.conversations.store import Store

ENDS = (EOFError, ValueError, OSError, TypeError, KeyError)  # what Owner._serve ends on

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(datagram=st.binary(max_size=2048) | json_values.map(
    lambda v: json.dumps(v).encode()) | st.integers(0, 5000).map(lambda n: b"[" * n),
       tail=st.binary(max_size=64))
def test_recv_gives_a_message_or_ends_the_connection(datagram, tail):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        a.settimeout(1)
        b.settimeout(1)
        try:
            b.send(datagram)
            if tail:
                b.send(tail)
        except OSError:  # (over the socket's message size)
            return
        b.shutdown(socket.SHUT_WR)
        try:
            msg, blob, fds = siblings.recv(a)
        except ENDS:
            return
        assert isinstance(msg, dict) and isinstance(blob, bytes) and fds == []
    finally:
        a.close()
        b.close()


ops = st.fixed_dictionaries({"op": st.sampled_from(["pin", "claim", "trim", "unclaim",
                                                    "commit", "drop", "other"])},
                            optional={"id": json_values, "salt": json_values,
                                      "rows": st.integers(-5, 40) | json_values,
                                      "to": st.integers(-5, 40) | json_values,
                                      "chat": st.booleans() | json_values,
                                      "parts": st.integers(-2, 4) | json_values,
                                      "digest_bytes": st.integers(-2, 70) | json_values,
                                      "ttl": json_values, "block": json_values})


@settings(max_examples=300, deadline=None)
@given(blob=st.binary(max_size=200), rows=st.integers(-2, 40) | json_values,
       parts=st.integers(-2, 6) | json_values)
def test_a_rendered_prompt_from_a_sibling_is_whole_or_refused(blob, rows, parts):
    """``rendered.unpack`` of any bytes: None, or token ids and parts in order within
    the rows, which ``pack`` gives back byte for byte."""
    got = rendered.unpack(blob, rows, parts)
    if got is None:
        return
    assert len(got.token_ids) == got.rows == rows and len(got.positions) == parts
    at = 0
    for start, n in got.positions:
        assert start >= at and n >= 1 and start + n <= rows
        at = start + n
    assert rendered.pack(got) == blob


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=st.lists(ops, max_size=8), blob=st.binary(max_size=64), use_real_id=st.booleans(),
       chat=st.booleans())
def test_any_messages_to_a_lease_leave_the_store_as_it_was(msgs, blob, use_real_id, chat):
    closed = []
    store = Store(closed.append)
    tip = tips.Tip(torch.float32, 4)
    turn = rendered.Rendered(array.array("i", range(8)), ((2, 4),), 8) if chat else None
    try:
        assert store.claim(tip, 0, 8, 1 << 20) is None
        tip.ensure(8)
        kid = store.put(tip, 8, None, None, 60, 16, turn)
        store.let_go(tip)  # (the entry's use holds it now)
        refs, charged = tip.refs, store.nbytes
        lease = siblings._Lease(store, lambda: 1 << 20, lambda: 16, lambda: 3600.0,
                                lambda block, rows, d: None)
        for m in msgs:
            if use_real_id and m["op"] == "pin":
                m = dict(m, id=kid, salt=None, chat=chat)
            try:
                reply = lease.handle(m, blob)
            except ENDS:
                break
            for fd in (reply[2] if reply is not None and len(reply) > 2 else ()):
                assert fd == tip.fd  # only the pinned tip's own descriptor
        lease.end()
        for kid_made, salt in lease.made:  # (ids a commit made are the store's own)
            store.drop(kid_made, salt, "test")
        assert tip.refs == refs and not closed
        assert all(e.pins == 0 for e in store._entries.values())
        assert store.nbytes >= charged  # (rows claimed stay charged: the file keeps them)
        # no row past the file's end stays claimed: nobody wrote or read it
        assert tip.rows <= os.fstat(tip.fd).st_size // tip.row_bytes
    finally:
        store.clear()  # (its close only records: the tip is closed here)
        tip.close()
