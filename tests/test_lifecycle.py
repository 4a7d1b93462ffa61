# SPDX-License-Identifier: Apache-2.0
"""The segment lifecycle (``lifetime/lifecycle.py``): every transition of its table
driven through the real verbs of ``owned.OwnedSegments``, and illegal ones
refused (raised under pytest, logged and refused elsewhere)."""

import gc
import os
import threading

import pytest
import torch
from helpers import true_in_forked_child

from vllm._shm_embeds.config import shm_dir
from vllm._shm_embeds.files import segment as seg
from vllm._shm_embeds.hops import hop2
from vllm._shm_embeds.lifetime import lifecycle, process, transfer
from vllm._shm_embeds.lifetime.lifecycle import (BROADCAST, DRAINING, FREED, GONE, HELD,
                                                  MAPPED, IllegalTransition, Kind, State)


def _owned():
    return process.current().owned


def _entry(tensor):
    """The index entry of the segment ``tensor`` maps here (or was copied from)."""
    return next((e for e in _owned()._index.all() if e.data_ptr == tensor.data_ptr()
                 or (e.source is not None and e.source() is tensor)), None)


def _streamed(shape=(8, 32)):
    """A segment owned as ``Kind.STREAMED`` (what a body extension's finished one is),
    made with the core alone: the core's tests also run with every extension deleted."""
    handle, fds = transfer.create_segment(torch.zeros(shape))
    try:
        mm = seg.map_segment(shm_dir(), handle, fds=fds)
    finally:
        for fd in fds:
            os.close(fd)
    t, anchor = seg.tensor_view(mm, handle)
    _owned().own(Kind.STREAMED, handle, mm, t, anchor)
    return t


def _adopt(rows=64):
    return transfer.adopt_tensor(transfer.share_tensor(torch.randn(rows, 32)))


def _die(*entries):
    """Let the garbage collector run and the safe point apply the records."""
    gc.collect()
    process.collect()
    return [e.state for e in entries]


def _unlink_files(entry, directory):
    for part, _, _ in entry.handle.parts():
        os.unlink(os.path.join(directory, part))


# -- scenarios: each starts from a fresh process state and leaves nothing


def s_broadcast_and_settle(d):
    a = _adopt()
    e = _entry(a)
    assert (e.kind, e.state) == (Kind.ADOPTED, HELD)  # own
    h1 = hop2.externalize(a, readers=2)
    assert e.state is BROADCAST  # broadcast: HELD -> BROADCAST
    h2 = hop2.externalize(a, readers=1)
    assert e.state is BROADCAST and h2.flag_base == 2  # BROADCAST -> BROADCAST
    for h, i in ((h1, 0), (h1, 1), (h2, 0)):
        transfer.open_tensor(h, i)
    assert process.collect() == 0 and e.state is HELD  # settle: in use
    assert transfer.release_adopted(a) and e.state is GONE  # HELD -> GONE
    # settled inside release_adopted: BROADCAST -> GONE at once
    a = _adopt()
    e = _entry(a)
    transfer.open_tensor(hop2.externalize(a, readers=1), 0)
    assert transfer.release_adopted(a) and e.state is GONE and os.listdir(d) == []


def s_freed(d):
    a = _adopt()
    h = hop2.externalize(a, readers=1)
    e = _entry(a)
    assert not transfer.release_adopted(a) and e.state is FREED  # readers not done
    assert not transfer.release_adopted(a) and e.state is FREED  # FREED -> FREED
    h2 = _owned().broadcast(e, 1)  # a lookup from before vLLM freed it
    assert h2 is not None and e.state is FREED
    transfer.open_tensor(h, 0)
    assert process.collect() == 0 and e.state is FREED  # one reader left
    transfer.open_tensor(h2, 0)
    assert process.collect() == 1 and e.state is GONE and not a.any()  # settle
    # freed again once the readers are done: FREED -> GONE
    a = _adopt()
    h = hop2.externalize(a, readers=1)
    e = _entry(a)
    assert not transfer.release_adopted(a)
    transfer.open_tensor(h, 0)
    assert transfer.release_adopted(a) and e.state is GONE and os.listdir(d) == []


def s_die(d):
    a = _adopt()
    e = _entry(a)
    del a
    assert _die(e) == [GONE]  # HELD -> GONE
    a = _adopt()
    h = hop2.externalize(a, readers=1)
    e = _entry(a)
    del a
    assert _die(e) == [BROADCAST] and e.data_ptr is None  # BROADCAST -> BROADCAST
    transfer.open_tensor(h, 0)
    assert process.collect() == 1 and e.state is GONE  # settle: nothing uses it
    a = _adopt()
    h = hop2.externalize(a, readers=1)
    e = _entry(a)
    transfer.release_adopted(a)
    del a
    assert _die(e) == [FREED]  # FREED -> FREED
    transfer.open_tensor(h, 0)
    assert process.collect() == 1 and e.state is GONE and os.listdir(d) == []


def s_copies(d):
    src = torch.randn(64, 32)
    h = hop2.externalize(src, readers=1)
    e = _entry(src)
    assert (e.kind, e.state) == (Kind.COPY, BROADCAST)
    transfer.open_tensor(h, 0)
    assert process.collect() == 0 and e.state is HELD and e.fds is None
    del src
    assert _die(e) == [GONE]  # the source died: HELD -> GONE
    src = torch.randn(64, 32)
    h = hop2.externalize(src, readers=1)
    e = _entry(src)
    del src
    assert _die(e) == [BROADCAST]
    transfer.open_tensor(h, 0)
    assert process.collect() == 1 and e.state is GONE and os.listdir(d) == []


def s_vanish(d):
    # an adopted segment whose name someone removed: MAPPED, copied instead
    a = _adopt()
    e = _entry(a)
    _unlink_files(e, d)
    h = hop2.externalize(a, readers=1)
    assert e.state is MAPPED and h.name != e.handle.name
    transfer.open_tensor(h, 0)
    assert transfer.release_adopted(a) and e.state is GONE  # MAPPED -> GONE
    # a copy whose name someone removed: GONE, copied again
    src = torch.randn(64, 32)
    transfer.open_tensor(hop2.externalize(src, readers=1), 0)
    process.collect()
    e = _entry(src)
    assert e.state is HELD and e.fds is None
    _unlink_files(e, d)
    transfer.open_tensor(hop2.externalize(src, readers=1), 0)
    assert e.state is GONE and _entry(src).state is BROADCAST
    assert not transfer.release_adopted(src) and os.listdir(d) == []


def s_release_unknown(d):
    process.current().release_known = False  # nothing tells when requests end
    a = _adopt()
    e = _entry(a)
    transfer.open_tensor(hop2.externalize(a, readers=1), 0)
    assert process.collect() == 1 and e.state is MAPPED  # settle: name gone, mapped
    assert os.listdir(d) == []
    del a
    assert _die(e) == [GONE]  # MAPPED -> GONE


def s_streamed(d):
    t = _streamed()
    e = _entry(t)
    assert (e.kind, e.state) == (Kind.STREAMED, HELD) and transfer.is_streamed(t)
    assert transfer.release_streamed(t) and e.state is GONE  # HELD -> GONE
    t = _streamed()
    e = _entry(t)
    handle = transfer.hand_over(t)
    assert handle is not None and e.state is MAPPED and not transfer.is_streamed(t)
    adopted = transfer.adopt_tensor(handle)  # the peer (here: this process)
    assert transfer.release_streamed(t) and e.state is GONE  # MAPPED -> GONE
    assert transfer.release_adopted(adopted)
    t = _streamed()
    e = _entry(t)
    adopted = transfer.adopt_tensor(transfer.hand_over(t))
    del t
    assert _die(e) == [GONE]  # MAPPED -> GONE
    transfer.release_adopted(adopted)
    t = _streamed()
    e = _entry(t)
    del t
    assert _die(e) == [GONE] and os.listdir(d) == []  # HELD -> GONE


def s_draining(d):
    """A zero-copy send of the bytes (a live ``send_view``) keeps the pages
    wherever the request's end would drop them: DRAINING, name gone, bytes
    intact; once the send is done (the view's storage freed) the next safe
    point drops them (sent: DRAINING -> GONE)."""

    def draining(e, t):
        assert e.state is DRAINING and os.listdir(d) == [] and t.any()

    def dropped(e, t):
        assert _die(e) == [GONE] and not t.any()

    a = _adopt()
    e, v = _entry(a), transfer.send_view(a)
    assert v is not a and v.data_ptr() == a.data_ptr() and torch.equal(v, a)
    assert not transfer.release_adopted(a)  # HELD -> DRAINING
    draining(e, a)
    del v
    dropped(e, a)
    a = _adopt()
    e, h = _entry(a), hop2.externalize(a, readers=1)
    transfer.open_tensor(h, 0)
    v = transfer.send_view(a)
    assert not transfer.release_adopted(a)  # BROADCAST -> DRAINING (settled there)
    draining(e, a)
    del v
    dropped(e, a)
    a = _adopt()
    e, h = _entry(a), hop2.externalize(a, readers=1)
    v = transfer.send_view(a)
    assert not transfer.release_adopted(a) and e.state is FREED
    transfer.open_tensor(h, 0)
    process.collect()  # settle: FREED -> DRAINING
    draining(e, a)
    del v
    dropped(e, a)
    a = _adopt()
    e, h = _entry(a), hop2.externalize(a, readers=1)
    transfer.release_adopted(a)
    v = transfer.send_view(a)  # (sent by a step scheduled before vLLM freed it)
    transfer.open_tensor(h, 0)
    assert not transfer.release_adopted(a)  # FREED -> DRAINING
    draining(e, a)
    del v
    dropped(e, a)
    a = _adopt()  # its name removed by someone: MAPPED
    e = _entry(a)
    _unlink_files(e, d)
    transfer.open_tensor(hop2.externalize(a, readers=1), 0)
    v = transfer.send_view(a)
    assert e.state is MAPPED and not transfer.release_adopted(a)  # MAPPED -> DRAINING
    draining(e, a)
    del v
    dropped(e, a)
    t = _streamed()
    t.fill_(1)
    e, v = _entry(t), transfer.send_view(t)
    assert transfer.release_streamed(t)  # HELD -> DRAINING
    draining(e, t)
    del v
    dropped(e, t)
    t = _streamed()
    t.fill_(1)
    e = _entry(t)
    adopted = transfer.adopt_tensor(transfer.hand_over(t))
    v = transfer.send_view(t)
    transfer.release_adopted(adopted)  # the peer's end
    assert transfer.release_streamed(t)  # MAPPED -> DRAINING
    draining(e, t)
    del v
    dropped(e, t)
    # a send done before the request's end changes nothing
    a = _adopt()
    e, v = _entry(a), transfer.send_view(a)
    del v
    assert _die(e) == [HELD] and e.sends == 0
    assert transfer.release_adopted(a) and e.state is GONE
    # only our mappings get views
    other = torch.randn(4, 4)
    assert transfer.send_view(other) is other and transfer.send_view(None) is None
    a = _adopt()
    e, v = _entry(a), transfer.send_view(a)
    transfer.release_adopted(a)
    _owned().unlink_all()  # DRAINING -> GONE
    assert e.state is GONE and a.any()
    del v
    process.collect()


def s_unlink_all(d):
    held = _adopt()
    broadcast = _adopt()
    hop2.externalize(broadcast, readers=1)
    freed = _adopt()
    hop2.externalize(freed, readers=1)
    transfer.release_adopted(freed)
    mapped = _streamed()
    peer = transfer.adopt_tensor(transfer.hand_over(mapped))
    entries = [_entry(t) for t in (held, broadcast, freed, mapped, peer)]
    assert [e.state for e in entries] == [HELD, BROADCAST, FREED, MAPPED, HELD]
    assert _owned().unlink_all() == 4
    assert all(e.state is GONE for e in entries) and len(_owned()._index) == 0
    assert os.listdir(d) == []


SCENARIOS = [s_broadcast_and_settle, s_freed, s_die, s_copies, s_vanish,
             s_release_unknown, s_streamed, s_draining, s_unlink_all]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__[2:])
def test_scenario(shm_env, scenario):
    scenario(shm_env)
    assert len(_owned()._index) == 0


def test_every_transition_of_the_table_is_driven(shm_env, monkeypatch):
    """The scenarios above make every move the table allows (so none is
    dead, and each is checked by a test)."""
    seen = set()
    check = lifecycle.check

    def recording(kind, event, source, to, name=""):
        seen.add((event, source, to))
        return check(kind, event, source, to, name)

    monkeypatch.setattr(lifecycle, "check", recording)
    for scenario in SCENARIOS:
        monkeypatch.setattr(process, "_state", process.Process())
        scenario(shm_env)
    table = {(t.event, t.source, to) for t in lifecycle.TRANSITIONS for to in t.to}
    assert table - seen == set()


def test_a_verb_returns_after_the_unlinks_of_a_concurrent_safe_point(shm_env, monkeypatch):
    """The reaper thread's safe point moves a dead segment to ``GONE`` under
    the lock and unlinks it after; a verb on another thread meanwhile returns
    only once that unlink is done (else it can see the state but not the
    file gone)."""
    entered, go = threading.Event(), threading.Event()
    unlink = seg.unlink_segment

    def held(*args):  # the first unlink waits (on whichever thread: the reaper runs)
        if not entered.is_set():
            entered.set()
            go.wait(10)
        return unlink(*args)

    monkeypatch.setattr(seg, "unlink_segment", held)
    t = _streamed()
    e = _entry(t)
    del t
    gc.collect()
    reaper = threading.Thread(target=process.collect)  # (or the reaper's own pass)
    reaper.start()
    try:
        assert entered.wait(10) and e.state is GONE and len(os.listdir(shm_env)) == 1
        done = threading.Event()
        other = threading.Thread(target=lambda: (process.collect(), done.set()))
        other.start()
        assert not done.wait(0.3)  # it waits for the reaper's unlink
    finally:
        go.set()
    assert done.wait(10) and os.listdir(shm_env) == []
    reaper.join()
    other.join()


ILLEGAL = [
    ("hand_over", HELD, MAPPED, Kind.ADOPTED),  # only streamed segments are handed over
    ("broadcast", HELD, BROADCAST, Kind.STREAMED),  # never broadcast from here
    ("broadcast", MAPPED, BROADCAST, Kind.ADOPTED),  # its name is gone
    ("settle", HELD, GONE, Kind.ADOPTED),  # no broadcast to settle
    ("settle", FREED, HELD, Kind.ADOPTED),  # a freed request is not used again
    ("release_streamed", HELD, GONE, Kind.ADOPTED),
    ("release_adopted", HELD, GONE, Kind.STREAMED),
    ("die", MAPPED, GONE, Kind.COPY),  # a copy is never mapped here
    ("own", HELD, HELD, Kind.ADOPTED),  # owned twice
    ("unlink_all", GONE, GONE, Kind.ADOPTED),  # nothing moves out of GONE
    ("vanish", BROADCAST, MAPPED, Kind.ADOPTED),  # its files are open
    ("no_such_event", HELD, GONE, Kind.ADOPTED),
]


@pytest.mark.parametrize("event,source,to,kind", ILLEGAL)
def test_illegal_transition_raises_when_strict(event, source, to, kind):
    assert not lifecycle.allowed(kind, event, source, to)
    with pytest.raises(IllegalTransition, match=event):
        lifecycle.check(kind, event, source, to, "x")


@pytest.mark.parametrize("value,strict", [("1", True), ("0", False), ("", False)])
def test_strict_is_the_setting(monkeypatch, value, strict):
    monkeypatch.setenv("VLLM_SHM_EMBEDS_STRICT", value)
    assert lifecycle.strict() is strict


def test_illegal_transition_is_logged_and_refused_in_production(monkeypatch):
    errors = []
    monkeypatch.setattr(lifecycle, "strict", lambda: False)
    monkeypatch.setattr(lifecycle.logger, "error", lambda *a: errors.append(a))
    for event, source, to, kind in ILLEGAL:
        assert lifecycle.check(kind, event, source, to, "x") is False
    assert len(errors) == len(ILLEGAL)
    assert lifecycle.check(Kind.ADOPTED, "own", None, HELD) and len(errors) == len(ILLEGAL)


def test_a_refused_move_changes_nothing(shm_env, monkeypatch):
    """In production a move the table does not allow leaves the segment as it
    was (no exception into vLLM's thread); the index too."""
    monkeypatch.setattr(lifecycle, "strict", lambda: False)
    monkeypatch.setattr(lifecycle.logger, "error", lambda *a: None)
    a = _adopt()
    e = _entry(a)
    index = _owned()._index
    assert not index.move(e, "hand_over", MAPPED)
    assert e.state is HELD and index.at(a.data_ptr()) is e
    # a verb whose move the table refuses does nothing
    with monkeypatch.context() as m:
        m.delitem(lifecycle._ALLOWED, ("release_adopted", HELD))
        assert not transfer.release_adopted(a)
        assert e.state is HELD and len(os.listdir(shm_env)) == 1 and a.any()
    assert transfer.release_adopted(a) and os.listdir(shm_env) == []


def test_illegal_move_raises_through_the_index(shm_env):
    a = _adopt()
    e = _entry(a)
    with pytest.raises(IllegalTransition):
        _owned()._index.move(e, "hand_over", MAPPED)
    assert e.state is HELD
    transfer.release_adopted(a)


def test_table_names_only_known_states_and_verbs():
    """Every event is a verb of ``OwnedSegments`` or one it observes (the
    finalizers' ``die``, readers done: ``settle``, a name removed: ``vanish``),
    and every state but GONE can be left."""
    for t in lifecycle.TRANSITIONS:
        assert (t.event in lifecycle.OBSERVED
                or callable(getattr(type(_owned()), t.event, None))), t
        assert t.kinds and t.to <= set(State)
    left = {t.source for t in lifecycle.TRANSITIONS}
    assert left == {None, *State} - {GONE}


def test_a_forked_child_keeps_only_what_describes_the_server(shm_env):
    """Per-process state (``process.Process``) is replaced in a forked child
    in one place: it keeps whether request ends are told and the model name,
    and has none of its parent's segments, threads or metrics directory."""
    state = process.current()
    state.release_known, state.model_name, state.stats_dir_made = False, "m", "/x"
    state.writer_pool()
    a = _adopt()

    def child_state_is_new() -> bool:
        child = process.current()
        return (child is not state and child.pid == os.getpid() and not child.release_known
                and child.model_name == "m" and child.stats_dir_made is None
                and child.pool is None and child.owned.live() == 0)

    assert true_in_forked_child(child_state_is_new)
    assert transfer.release_adopted(a)
