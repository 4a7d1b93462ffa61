# SPDX-License-Identifier: Apache-2.0
"""No page of ours is replaced while a zero-copy send may still read it.

vLLM sends tensor memory out of band without a copy: ``MessageQueue.enqueue``
(hop 2: the remote XPUB socket, and the local socket when a message overflows
the ring) and the core client's ``_send_input`` (hop 1) call
``send_multipart(..., copy=False)``, so ZMQ's I/O thread reads that memory
after the call returns, for as long as the peer does not read its socket.
vLLM counts on the frame keeping the tensor alive. We drop the pages of a
finished request's mapping (``segment.drop_pages``: zero pages over the same
addresses) whatever still holds the tensor, so a send still queued when the
request is aborted would carry zeros, and the peer's KV for those blocks
would be registered in the prefix cache under the real embeds' digest.

Each test stalls a real ZMQ receiver (it does not read until the request has
been freed and the safe point passed), then reads and compares the bytes.
A message of 64 MiB leaves most of its bytes in ZMQ's queue: loopback's
socket buffers hold a few MiB.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import types

import pytest
import torch
import zmq
from helpers import ring_message

from vllm._shm_embeds import counters
from vllm._shm_embeds.handle import InlineEmbeds, SharedTensorHandle
from vllm._shm_embeds.hops import hop2
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.ext.digests.streamed import StreamedSegment
from vllm._shm_embeds.lifetime.transfer import release_streamed
from vllm._shm_embeds.sites import multiproc_executor, shm_broadcast

ROWS, COLS = 16384, 1024  # 64 MiB of float32


class _Req:
    def __init__(self, t):
        self.prompt_embeds = t


@pytest.fixture
def stalled_pair():
    """A PUSH socket whose PULL peer reads only when asked: ``(push, receive)``."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVBUF, 1 << 16)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDBUF, 1 << 16)
    push.connect(f"tcp://127.0.0.1:{port}")

    def receive(timeout_ms=20000):
        assert pull.poll(timeout_ms), "nothing arrived"
        return [bytes(f) for f in pull.recv_multipart(copy=False)]

    try:
        yield push, receive
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


class _Queue:
    """What ``MessageQueue.enqueue`` (vLLM 0.32) touches on a writer: a ring that
    every message overflows (``max_chunk_bytes`` 1 KiB, so the local readers'
    bytes go by ``local_socket``) and the remote socket, both real ZMQ sockets
    sending without a copy."""

    _is_writer = True
    tensor_arena = None

    def __init__(self, n_local, n_remote, local_socket, remote_socket):
        self.n_local_reader, self.n_remote_reader = n_local, n_remote
        self.buffer = types.SimpleNamespace(max_chunk_bytes=1024)
        self._spin_condition = types.SimpleNamespace(notify=lambda: None)
        self.local_socket, self.remote_socket = local_socket, remote_socket

        self.ring: list[bytearray] = []

    def acquire_write(self, timeout=None):
        self.ring.append(bytearray(1024))
        return contextlib.nullcontext(self.ring[-1])

    def enqueue(self, obj, timeout=None):
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        return shm_broadcast.wrap_enqueue(MessageQueue.enqueue)(self, obj, timeout)


class _Null:
    """A socket that drops what it is sent (the readers this test does not watch)."""

    def send_multipart(self, buffers, copy=True):
        pass


def _executor(mq, tp):
    cfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(enable_prompt_embeds=True),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp,
                                              pipeline_parallel_size=1,
                                              prefill_context_parallel_size=1))
    return types.SimpleNamespace(rpc_broadcast_mq=mq, vllm_config=cfg)


def _step(executor, tensor):
    """One ``execute_model`` broadcast through our ``collective_rpc`` wrapper
    and vLLM's own ``enqueue``."""
    so = types.SimpleNamespace(scheduled_new_reqs=[_Req(tensor)])

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, **kw):
        if callable(method):  # the probe
            return [multiproc_executor.HOP2_WIRE] * 2
        self.rpc_broadcast_mq.enqueue((method, args, kwargs or {}, 0))
        return "ok"

    wrapped = multiproc_executor.wrap_executor_rpc(collective_rpc)
    assert wrapped(executor, "execute_model", args=(so,)) == "ok"
    assert so.scheduled_new_reqs[0].prompt_embeds is tensor


def _adopted(src):
    """``src`` as the EngineCore holds it after hop 1: an adopted segment."""
    return transfer.adopt_tensor(transfer.share_tensor(src))


def _received_embeds(buffers):
    req = pickle.loads(buffers[0], buffers=buffers[1:])[1][0].scheduled_new_reqs[0]
    return req.prompt_embeds


def _free_and_settle(tensor, handle=None):
    """The request is aborted and freed (vLLM's ``_free_request``), its local
    readers have mapped it, and the next safe point passes."""
    if handle is not None:
        transfer.open_tensor(handle, 0)  # the local TP rank maps it
    transfer.release_adopted(tensor)
    process.collect()


def test_remote_tp_rank_gets_the_bytes_it_was_sent(shm_env, monkeypatch, stalled_pair):
    """TP=2 across two nodes: the remote rank is sent the tensor (InlineEmbeds)
    over the adopted hop-1 mapping; the request is aborted before the send is
    done. The bytes that arrive are the request's, not zeros."""
    push, receive = stalled_pair
    monkeypatch.setitem(multiproc_executor.STATUS, "remote", [])
    src = torch.randn(ROWS, COLS)
    embeds = _adopted(src)
    mq = _Queue(1, 1, _Null(), push)
    _step(_executor(mq, tp=2), embeds)
    [ring] = mq.ring  # the local rank's message: the handle, in the ring
    handle = _received_embeds(ring_message(ring))
    assert isinstance(handle, SharedTensorHandle)
    _free_and_settle(embeds, handle)
    got = _received_embeds(receive())
    assert isinstance(got, InlineEmbeds)
    assert torch.equal(got.tensor, src)
    del got, embeds
    process.collect()


def test_stock_hop2_over_an_adopted_mapping(shm_env, monkeypatch, stalled_pair):
    """Hop 2 stock (readers on other nodes, the split off): the adopted tensor's
    memory goes out of band to the remote socket and, overflowing the ring, to
    the local socket. Both receivers get the request's bytes."""
    push, receive = stalled_pair
    monkeypatch.setitem(multiproc_executor.STATUS, "remote", ["enqueue: missing"])
    src = torch.randn(ROWS, COLS)
    embeds = _adopted(src)
    mq = _Queue(1, 1, push, _Null())
    _step(_executor(mq, tp=2), embeds)
    _free_and_settle(embeds)
    got = _received_embeds(receive())
    assert isinstance(got, torch.Tensor) and torch.equal(got, src)
    del got, embeds
    process.collect()


def test_pages_are_dropped_once_the_send_is_done(shm_env, monkeypatch, stalled_pair):
    """The drop is deferred, not lost: once ZMQ lets go of the frames, the
    next safe point drops the pages (``engine_pages_released``) and nothing
    of the request is left in the books."""
    push, receive = stalled_pair
    monkeypatch.setitem(multiproc_executor.STATUS, "remote", ["enqueue: missing"])
    embeds = _adopted(torch.randn(ROWS, COLS))
    _step(_executor(_Queue(1, 1, push, _Null()), tp=2), embeds)
    before = counters.stats().get("engine_pages_released", 0)
    _free_and_settle(embeds)
    assert counters.stats().get("engine_pages_released", 0) == before  # still sending
    receive()
    for _ in range(200):  # pyzmq releases the frames on its own thread
        process.collect()
        if counters.stats().get("engine_pages_released", 0) > before:
            break
        threading.Event().wait(0.01)
    assert counters.stats().get("engine_pages_released", 0) == before + 1
    assert process.current().owned.live() == 0
    assert (embeds == 0).all()  # what vLLM still holds reads zeros, as before


def test_hop1_stock_send_of_a_streamed_body(shm_env, stalled_pair):
    """Hop 1 stock (e.g. EngineCores on other nodes): a request body written
    into a streamed segment goes to the EngineCore as ZMQ frames from that
    mapping. The client disconnects before the send is done (the body's
    segment is released); the EngineCore still gets the body's bytes."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm._shm_embeds.sites.core_client import wrap_send_input

    push, receive = stalled_pair
    src = torch.randn(ROWS, COLS)
    seg = StreamedSegment(src.dtype, tuple(src.shape))
    seg.write(memoryview(src.numpy()).cast("B"))
    embeds = seg.finish()
    encoder = MsgpackEncoder()

    class _Client:  # AsyncMPClient._send_input's essence (vLLM 0.32), the request's tensor alone
        def _send_input(self, request_type, request):
            frames = encoder.encode(request.prompt_embeds)
            return push.send_multipart((request_type, *frames), copy=False)

    request = _Req(embeds)
    wrap_send_input(_Client._send_input)(_Client(), b"\x00", request)
    assert request.prompt_embeds is embeds
    release_streamed(embeds)  # the body's request ended (client gone)
    process.collect()
    got = MsgpackDecoder(torch.Tensor).decode(receive()[1:])
    assert torch.equal(got, src)
    del got, embeds, request
    process.collect()


def test_hop1_stock_send_of_a_registered_region(shm_env, monkeypatch, stalled_pair):
    """Hop 1 stock with a registered region's tensor (e.g. EngineCores on other
    nodes): the region's pages go out as ZMQ frames. The request is aborted
    (its lease released) and the producer unregisters the region before the
    send is done: the EngineCore still gets the region's bytes, and the
    region is freed once the send is done."""
    from test_regions import ALL_SEALS, memfd, tensor_bytes
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm._shm_embeds.ext.regions.registry import RegionLimits, RegionRegistry
    from vllm._shm_embeds.sites.core_client import wrap_send_input

    push, receive = stalled_pair
    src = torch.randn(ROWS, COLS)
    registry = RegionRegistry(RegionLimits(
        hidden_size=COLS, max_tokens=ROWS, allowed_uids=frozenset({os.getuid()}),
        max_regions_per_uid=1, max_bytes_per_uid=src.nbytes, idle_ttl_s=600.0))
    monkeypatch.setattr(process.current(), "holders", [registry])
    region = registry.register(memfd(tensor_bytes(src), ALL_SEALS), os.getuid(), "FP32",
                               [ROWS, COLS])
    lease = registry.lease(region.id, "FP32", [ROWS, COLS], src.nbytes, 0)
    encoder = MsgpackEncoder()

    class _Client:
        def _send_input(self, request_type, request):
            frames = encoder.encode(request.prompt_embeds)
            return push.send_multipart((request_type, *frames), copy=False)

    request = _Req(lease.tensor)
    wrap_send_input(_Client._send_input)(_Client(), b"\x00", request)
    assert request.prompt_embeds is lease.tensor
    before = counters.stats().get("regions_freed", 0)
    lease.release()
    registry.unregister(region.id)
    assert counters.stats().get("regions_freed", 0) == before  # not while sending
    got = MsgpackDecoder(torch.Tensor).decode(receive()[1:])
    assert torch.equal(got, src)
    del got
    for _ in range(200):  # pyzmq releases the frames on its own thread
        if registry.settle():
            break
        threading.Event().wait(0.01)
    assert counters.stats().get("regions_freed", 0) == before + 1
    registry.close()


def test_an_error_of_ours_in_a_send_view_leaves_the_send_to_vllm(shm_env, monkeypatch):
    """If making a send view fails (a bug of ours), hop 2 and hop 1 send the
    request's own tensor the stock way: the RPC and the send still happen,
    the request keeps its tensor, no exception reaches vLLM."""
    from vllm._shm_embeds.sites import core_client

    def broken(tensor):
        raise RuntimeError("injected send-view failure")

    monkeypatch.setattr(hop2, "send_view", broken)
    monkeypatch.setattr(core_client, "send_view", broken)
    monkeypatch.setitem(multiproc_executor.STATUS, "remote", ["enqueue: missing"])
    embeds = _adopted(torch.randn(64, 32))
    sent = []

    class _Socket:
        def send_multipart(self, buffers, copy=True):
            sent.append(len(buffers))

    _step(_executor(_Queue(1, 1, _Socket(), _Socket()), tp=2), embeds)  # hop 2, stock
    assert sent  # vLLM's enqueue ran
    request = _Req(embeds)

    class _Client:
        def _send_input(self, request_type, request):
            assert request.prompt_embeds is embeds
            return "sent"

    assert core_client.wrap_send_input(_Client._send_input)(_Client(), b"\x00",
                                                             request) == "sent"
    assert request.prompt_embeds is embeds
    transfer.release_adopted(embeds)
    process.collect()
