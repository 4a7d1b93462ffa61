# SPDX-License-Identifier: Apache-2.0
"""Metrics: shm-embeds counters of every process on ``/metrics``.

Unit: the aggregation of per-process counters (sender/receiver attribution,
sums over processes), the collector's exposition, the sizing warning's
arithmetic; the feature off: vLLM's /metrics route gets no shm-embeds metric.
Online (``small_shm_server``): a TP=2 server whose segment directory is a
256 KiB tmpfs, with mixed requests (text, embeds by shm, one below the
threshold, one too large for the tmpfs, binary bodies): every metric equals
what the counters of all processes say, and the absolute values are the ones
these requests must give; one no-space warning and the start-up sizing
warning. ``dp_server`` (``vllm serve`` with DP=2: two API servers, two
EngineCores) and the plugin's own stats directory: every scrape shows the
same totals, equal to the counters and to the requests sent (the directory
is removed at exit: test_faults.py's SIGTERM test).
"""

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from helpers import (
    METRICS_PREFIX,
    by_role,
    delta,
    embed_weights,
    encode_embeds,
    forked_cases,
    holders,
    read_stats_dir,
    ours_in,
    parse_metrics,
    tiny_model,
    wait_until,
    write_counters,
)

from vllm._shm_embeds import counters
from vllm._shm_embeds.files import sizing
from vllm._shm_embeds.ext.metrics import metrics as hmetrics
from vllm._shm_embeds.lifetime import process
from vllm._shm_embeds.ext.metrics import site_instrumentator

PREFIX = METRICS_PREFIX
MAX_LEN = 2048
MAX_SEQS = 4  # conftest.py's small_shm_server


# --------------------------------------------------------------------------
# reading /metrics (helpers.parse_metrics) and the counters independently of
# the plugin's aggregation


def expected_from_files(stats: list[dict]) -> dict[tuple[str, frozenset], float]:
    """What /metrics must say, computed from the stats files (counters only).

    A hop's tensors and bytes are the sender's (hop 1: the API server, role
    ``client``; hop 2: the EngineCore, role ``engine``); the receiver's
    mappings (EngineCore for hop 1, TP workers for hop 2) are
    ``received_tensors``; everything else is summed over all processes.
    """
    exp: dict = {}

    def add(name, value, **labels):
        key = (PREFIX + name + "_total", frozenset(labels.items()))
        exp[key] = exp.get(key, 0) + value

    for hop in "12":
        for path in ("shm", "stock"):
            add("tensors", 0, hop=hop, path=path)
            add("bytes", 0, hop=hop, path=path)
        add("received_tensors", 0, hop=hop)
        add("reused_tensors", 0, hop=hop)
    add("remote_bytes", 0, hop="2")
    add("placeholder_tensors", 0, hop="2")
    plain = ("copied_bytes", "segments_created", "segments_unlinked", "segments_swept",
             "adopt_names_taken", "binary_bodies", "binary_bytes", "regions_registered",
             "region_bytes",
             "region_leases", "region_lookups", "region_lookup_trimmed", "regions_freed")
    for name in plain:
        add(name, 0)
    for s in stats:
        c, roles = s["counters"], s["roles"]
        sender = {"1": "client", "2": "engine"}
        for hop in "12":
            for path in ("shm", "stock"):
                for what in ("tensors", "bytes"):
                    if sender[hop] in roles:
                        add(what, c.get(f"hop{hop}_{path}_{what}", 0), hop=hop, path=path)
        if "engine" in roles:
            add("received_tensors", c.get("hop1_shm_tensors", 0), hop="1")
        if "worker" in roles:
            add("received_tensors", c.get("hop2_shm_tensors", 0), hop="2")
        add("reused_tensors", c.get("hop1_handover_tensors", 0), hop="1")
        add("reused_tensors", c.get("hop1_region_tensors", 0), hop="1")
        add("reused_tensors", c.get("hop2_reused_tensors", 0), hop="2")
        add("remote_bytes", c.get("hop2_remote_bytes", 0), hop="2")
        add("placeholder_tensors", c.get("hop2_placeholder_tensors", 0), hop="2")
        for name in plain:
            add(name, c.get(name, 0))
        for k, v in c.items():
            if k.startswith("fallback."):
                _, hop, reason = k.split(".")
                add("fallbacks", v, hop=hop.removeprefix("hop"), reason=reason)
            elif k.startswith("hop2_reader_tensors."):
                _, hop, kind = k.split(".")
                add("reader_tensors", v, hop=hop.removeprefix("hop"), kind=kind)
            elif k.startswith("binary_rejected."):
                add("binary_rejected", v, reason=k.split(".")[1])
            elif k.startswith("binary_fallback."):
                add("binary_fallbacks", v, reason=k.split(".")[1])
            elif k.startswith("json_fallback."):
                add("json_fallbacks", v, reason=k.split(".")[1])
            elif k.split(".")[0] in ("region_refused", "region_lease_refused",
                                     "region_unregistered", "json_direct_declined"):
                add(k.split(".")[0], v, reason=k.split(".")[1])
        add("json_tensors", c.get("json_direct_tensors", 0), how="direct")
        add("json_tensors", c.get("json_tensors", 0) - c.get("json_direct_tensors", 0),
            how="loader")
    return exp


def counters_only(scraped: dict) -> dict:
    return {k: v for k, v in scraped.items() if k[0].endswith("_total")}


def value(scraped: dict, name: str, **labels) -> float:
    return scraped[(PREFIX + name, frozenset(labels.items()))]


# --------------------------------------------------------------------------
# unit


def test_aggregate_attributes_hops_to_senders_and_sums_processes(tmp_path):
    seg_dir = tmp_path / "seg"
    seg_dir.mkdir()
    stats = [
        {"roles": ["client"], "counters": {
            "hop1_shm_tensors": 2, "hop1_shm_bytes": 100, "hop1_stock_tensors": 1,
            "hop1_stock_bytes": 7, "fallback.hop1.small": 1, "copied_bytes": 100,
            "segments_created": 2, "binary_rejected.no_space": 1, "hop1_handover_tensors": 1,
            "json_tensors": 3, "json_direct_tensors": 2, "json_fallback.rejected": 1}},
        {"roles": ["client"], "counters": {"hop1_shm_tensors": 3,
                                                          "hop1_shm_bytes": 30}},
        {"roles": ["engine"], "counters": {
            "hop1_shm_tensors": 5, "hop1_shm_bytes": 130, "hop1_adopted_tensors": 5,
            "hop2_shm_tensors": 5, "hop2_shm_bytes": 130, "hop2_reused_tensors": 5,
            "fallback.hop2.no_space": 2, "segments_unlinked": 5}},
        {"roles": ["worker"], "counters": {"hop2_shm_tensors": 5,
                                                      "hop2_shm_bytes": 130}},
        {"roles": ["worker"], "counters": {"hop2_shm_tensors": 5,
                                                      "hop2_shm_bytes": 130,
                                                      "fallback.hop2.map_failed": 1}},
    ]
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir()
    pids = write_counters(str(stats_dir), stats)
    # One segment file of a process in ``stats``, one of a process that is not.
    from vllm._shm_embeds.handle import SegmentName
    from vllm._shm_embeds.procfs import pid_namespace

    ours = SegmentName(pid_namespace(), pids[0], 1, 0)
    (seg_dir / str(ours)).write_bytes(b"x" * 8192)
    (seg_dir / str(SegmentName(pid_namespace(), 99, 1, 0))).write_bytes(b"x" * 4096)
    assert set(counters.stats_files(str(stats_dir))) == set(pids)
    v = hmetrics.aggregate(hmetrics.read_server(str(stats_dir)), set(pids), str(seg_dir))
    assert v["tensors"] == {("1", "shm"): 5, ("1", "stock"): 1, ("2", "shm"): 5,
                            ("2", "stock"): 0}
    assert v["bytes"][("1", "shm")] == 130 and v["bytes"][("2", "shm")] == 130
    assert v["received_tensors"] == {("1",): 5, ("2",): 10}
    assert v["reused_tensors"] == {("1",): 1, ("2",): 5}
    assert v["fallbacks"] == {("1", "small"): 1, ("2", "no_space"): 2, ("2", "map_failed"): 1}
    assert v["binary_rejected"] == {("no_space",): 1}
    assert v["json_tensors"] == {("direct",): 2, ("loader",): 1}
    assert v["json_fallbacks"] == {("rejected",): 1}
    assert v["copied_bytes"][()] == 100 and v["segments_unlinked"][()] == 5
    assert v["dir_held_bytes"][()] == os.stat(seg_dir / str(ours)).st_blocks * 512 > 0
    st = os.statvfs(seg_dir)
    assert v["dir_size_bytes"][()] == st.f_blocks * st.f_frsize


def test_a_deleted_extensions_families_are_absent(tmp_path, monkeypatch):
    """With only the core's events declared (every extension deleted), the
    extensions' families are not on /metrics, their stale counts are ignored, and
    the core's families are as before."""
    core = [e for e in counters.events() if type(e) is counters.Event]
    monkeypatch.setattr(counters, "events", lambda: core)
    values = {(counters.Key("binary_bodies"), "client"): 2,
              (counters.Key("copied_bytes"), "client"): 5,
              (counters.Key("hop1_handover_tensors"), "client"): 1}
    v = hmetrics.aggregate(values, set(), str(tmp_path))
    assert not any(m.startswith(("binary_", "json_", "region")) for m in v), sorted(v)
    assert v["copied_bytes"] == {(): 5} and v["reused_tensors"] == {("1",): 1, ("2",): 0}
    assert set(v) == set(hmetrics.families()) and "dir_held_bytes" in v
    text = hmetrics.exposition().decode()
    assert "vllm:shm_embeds_copied_bytes" in text and "binary_bodies" not in text


def test_metrics_route_appends_families_equal_to_files(tmp_path, monkeypatch):
    """vLLM's own /metrics route (attach_router) with our wrapper: its metrics
    stay, ours are appended and equal the files; gzip asked or not; other
    routes untouched."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.instrumentator import metrics as route

    stats = [{"roles": ["client"], "counters": {
                  "hop1_shm_tensors": 3, "hop1_shm_bytes": 300, "fallback.hop1.no_space": 2}},
             {"roles": ["engine"], "counters": {
                  "hop1_shm_tensors": 3, "hop1_shm_bytes": 300, "hop2_shm_tensors": 3}},
             {"roles": ["worker"], "counters": {"hop2_shm_tensors": 3}}]
    write_counters(str(tmp_path), stats)
    monkeypatch.setenv("VLLM_SHM_EMBEDS_STATS_DIR", str(tmp_path))
    monkeypatch.setattr(process.current(), "model_name", "tiny")
    app = FastAPI()
    site_instrumentator.wrap_attach_router(route.attach_router)(app)
    app.get("/other")(lambda: {"metrics": "no"})
    client = TestClient(app)
    for headers in ({}, {"Accept-Encoding": "gzip"}):
        r = client.get("/metrics", headers=headers)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert "python_gc_objects_collected_total" in r.text  # vLLM's registry's own
        scraped = parse_metrics(r.text)
        assert counters_only(scraped) == expected_from_files(read_stats_dir(str(tmp_path)))
        assert value(scraped, "tensors_total", hop="2", path="shm") == 3
        assert value(scraped, "received_tensors_total", hop="2") == 3
        assert value(scraped, "fallbacks_total", hop="1", reason="no_space") == 2
        assert r.text.count("# TYPE vllm:shm_embeds_tensors_total counter") == 1
    assert client.get("/other").json() == {"metrics": "no"}


def test_sizing_warning_says_how_large():
    class Cfg:
        class model_config:
            max_model_len, dtype = 8192, torch.bfloat16

            @staticmethod
            def get_hidden_size():
                return 8192

        class scheduler_config:
            max_num_seqs = 16

        class parallel_config:
            data_parallel_size_local = 2

    need = 2 * 16 * (8192 * 8192 * 2 + 4096)
    st = os.statvfs("/dev/shm")
    warning = sizing.check_dir_size(Cfg, "/dev/shm")
    if st.f_blocks * st.f_frsize >= need:
        assert warning is None
    else:
        assert f"({need} bytes)" in warning and "--shm-size=5g" in warning
    Cfg.scheduler_config.max_num_seqs = 1 << 20
    warning = sizing.check_dir_size(Cfg, "/dev/shm")
    assert str(2 * (1 << 20) * (8192 * 8192 * 2 + 4096)) in warning


# --------------------------------------------------------------------------
# online

def settled(stats_dir: str) -> list[dict]:
    """The stats files once every segment created was unlinked and nothing changes
    (the EngineCore unlinks a name when vLLM frees its request)."""
    seen: list = [None]

    def still():
        stats, last = read_stats_dir(stats_dir), seen[0]
        seen[0] = stats
        total = lambda k: sum(s["counters"].get(k, 0) for s in stats)  # noqa: E731
        return (stats,) if total("segments_created") == total("segments_unlinked") and \
            stats == last else None

    return wait_until(still, 60, lambda: f"counters to settle: {seen[0]}", interval=0.5)[0]


def _embeds(weights, n, seed):
    ids = torch.randint(3, weights.shape[0], (n,), generator=torch.Generator().manual_seed(seed))
    return weights[ids].contiguous()


@pytest.mark.integration
@pytest.mark.online
def test_metrics_equal_every_process_counters_tp2_small_tmpfs(small_shm_server):
    """Also: a too-small /dev/shm takes the stock path with one warning."""
    import shm_embeds_client as sec

    server, small_tmpfs = small_shm_server, small_shm_server.seg_dir
    stats_dir = server.stats
    w = embed_weights(tiny_model())
    hidden = w.shape[1]
    fits, big, tiny = _embeds(w, 40, 1), _embeds(w, 1000, 2), _embeds(w, 1, 3)
    assert tiny.nbytes < 1024 <= fits.nbytes  # engine_env: 1 KiB threshold
    assert big.nbytes > 256 * 1024  # does not fit in the tmpfs
    scrapes = [server.scrape()[1]]
    server.complete({"prompt": "a text prompt between the embeds"})
    for t in (fits, tiny, big):
        server.complete({"prompt": "", "prompt_embeds": encode_embeds(t)})
        scrapes.append(server.scrape()[1])
    sec.complete(server.url, "tiny", fits, max_tokens=4, temperature=0.0)
    # Too big for the tmpfs: received into private memory, served the stock way.
    sec.complete(server.url, "tiny", big, max_tokens=4, temperature=0.0)
    stats = settled(str(stats_dir))
    text, scraped = server.scrape()
    scrapes.append(scraped)
    log = server.log()
    # Per process (what the offline small-/dev/shm test checked): the API
    # server handed over the JSON and the binary tensor and could not place
    # the big one; the EngineCore could not place it for hop 2 either and sent
    # the adopted segments on without a copy; nothing crashed on a full tmpfs.
    [client] = by_role(stats, "client")
    [engine] = by_role(stats, "engine")
    assert client.get("hop1_shm_tensors") == 2 and client.get("hop1_handover_tensors") == 2
    assert client.get("fallback.hop1.no_space") == 2  # the big JSON and binary ones
    assert engine.get("fallback.hop2.no_space") == 2
    assert engine.get("hop2_reused_tensors") == 2
    assert "SIGBUS" not in log
    # Every counter series equals the processes' files (API server, EngineCore,
    # both TP workers), and none ever went down between scrapes.
    assert len(stats) == 4, stats
    assert counters_only(scraped) == expected_from_files(stats)
    for before, after in zip(scrapes, scrapes[1:]):
        assert all(after.get(k, 0) >= v for k, v in counters_only(before).items())
    # ... and they are what these requests must give.
    n = fits.nbytes
    assert value(scraped, "tensors_total", hop="1", path="shm") == 2  # JSON + binary
    assert value(scraped, "bytes_total", hop="1", path="shm") == 2 * n
    # tiny, and big twice (JSON and binary)
    assert value(scraped, "tensors_total", hop="1", path="stock") == 3
    assert value(scraped, "bytes_total", hop="1", path="stock") == tiny.nbytes + 2 * big.nbytes
    assert value(scraped, "tensors_total", hop="2", path="shm") == 2
    assert value(scraped, "tensors_total", hop="2", path="stock") == 3
    assert value(scraped, "received_tensors_total", hop="1") == 2
    assert value(scraped, "received_tensors_total", hop="2") == 4  # 2 tensors x 2 ranks
    # the binary body and the JSON one (decoded by the JSON path into a segment)
    assert value(scraped, "reused_tensors_total", hop="1") == 2
    assert value(scraped, "reused_tensors_total", hop="2") == 2
    for hop in "12":
        assert value(scraped, "fallbacks_total", hop=hop, reason="small") == 1
        assert value(scraped, "fallbacks_total", hop=hop, reason="no_space") == 2
    # The JSON and binary tensors, plus what the big JSON and binary uploads
    # wrote before the tmpfs was full (counted too: it was copied).
    assert 2 * n <= value(scraped, "copied_bytes_total") < 2 * n + 2 * 256 * 1024
    assert value(scraped, "binary_bodies_total") == 2  # none refused
    assert value(scraped, "binary_bytes_total") == n + big.nbytes
    assert value(scraped, "binary_fallbacks_total", reason="no_space") == 1
    assert ("vllm:shm_embeds_binary_rejected_total", frozenset({("reason", "no_space")})) \
        not in scraped
    created = value(scraped, "segments_created_total")
    # JSON, binary, the big binary upload's segment (ENOSPC midway: read back
    # into private memory, removed), and the JSON path's attempt at the big
    # tensor (ENOSPC while writing: removed, then vLLM's own decode)
    assert created == 4
    assert value(scraped, "segments_unlinked_total") == created
    # Gauges: nothing held now; the tmpfs's own size and free bytes.
    st = os.statvfs(small_tmpfs)
    assert value(scraped, "dir_held_bytes") == 0
    assert value(scraped, "dir_size_bytes") == st.f_blocks * st.f_frsize == 256 * 1024
    assert value(scraped, "dir_free_bytes") == st.f_bavail * st.f_frsize
    assert "# TYPE vllm:shm_embeds_dir_held_bytes gauge" in text
    # One no-space warning for the whole server (API server and EngineCore both
    # hit it), and the start-up sizing warning with the size needed.
    assert len(re.findall(r"WARNING.*could not place", log)) == 1, log
    need = MAX_SEQS * (MAX_LEN * hidden * 4 + 4096)
    assert len(re.findall(rf"WARNING.*\({need} bytes\).*--shm-size=5m", log)) == 1
    assert ours_in(small_tmpfs) == []


_OFF_PROBE = """
import logging
import os
logging.basicConfig(level=logging.INFO)
import vllm.plugins as p
p.load_general_plugins()
from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm.entrypoints.serve.instrumentator import metrics as route
app = FastAPI()
route.attach_router(app)
text = TestClient(app).get("/metrics").text
print("wrapped" if getattr(route.attach_router, "__shm_embeds_wrapped__", False) else "stock")
print("shm_embeds" in text, "VLLM_SHM_EMBEDS_STATS_DIR" in os.environ)
"""


def test_feature_off_shows_no_shm_embeds_metric(tmp_path):
    """``VLLM_SHM_EMBEDS=0`` in an API server process: vLLM's own /metrics
    route is not wrapped and shows no shm-embeds metric, and no stats
    directory is made. (Was a whole server; the plugin decides all of this
    at load, which is what this runs.)"""

    cases = []
    for flag in "01":  # the plugin on too: the probe can fail
        (tmp_path / flag).mkdir()
        cases.append(({"VLLM_SHM_EMBEDS": flag, "TMPDIR": str(tmp_path / flag)},
                      "import os, tempfile\n"
                      "os.environ.pop('VLLM_SHM_EMBEDS_STATS_DIR', None)\n"
                      "tempfile.tempdir = None  # TMPDIR as this case sets it\n" + _OFF_PROBE))
    (off, out, err), (on_status, on, on_err) = forked_cases(
        "import vllm.entrypoints.launchers.app", cases, tmp_path)
    assert off == 0, err[-2000:]
    assert out.split("\n")[-3:-1] == ["stock", "False False"], out
    assert "shm-embeds: off" in out + err
    assert os.listdir(tmp_path / "0") == []
    assert on_status == 0, on_err[-2000:]
    assert on.split("\n")[-3:-1] == ["wrapped", "True True"], on


@pytest.mark.integration
@pytest.mark.online
def test_two_api_servers_and_dp2_add_up(dp_server):
    """``vllm serve --data-parallel-size 2``: two API servers (vLLM's default for
    DP=2), two EngineCores, vLLM's multiprocess Prometheus registry, and the
    plugin's own stats directory (``VLLM_SHM_EMBEDS_STATS_DIR`` unset)."""
    server = dp_server
    w = embed_weights(tiny_model())
    embeds = [_embeds(w, 30 + 10 * i, i) for i in range(16)]
    stats_dir = server.stats
    assert os.path.basename(stats_dir).startswith(hmetrics.STATS_DIR_PREFIX)
    before = server.scrape()[1]
    bodies = [{"prompt": "", "prompt_embeds": encode_embeds(t)} for t in embeds]
    bodies += [{"prompt": "text between the embeds"}] * 4
    with ThreadPoolExecutor(8) as pool:  # a new connection per request
        list(pool.map(server.complete, bodies))
    stats = settled(str(stats_dir))
    scrapes = [server.scrape()[1] for _ in range(6)]  # either API server answers
    log = server.log()
    assert ours_in(server.seg_dir) == []
    clients = [s for s in stats if "client" in s["roles"]]
    engines = [s for s in stats if "engine" in s["roles"]]
    assert len(clients) == 2 and len(engines) == 2, stats  # no process missing
    assert "Defaulting api_server_count to data_parallel_size (2)" in log
    for s in scrapes:
        assert counters_only(s) == expected_from_files(stats)
    scraped = scrapes[0]

    def grew(name, **labels):
        return value(scraped, name, **labels) - value(before, name, **labels)

    total = sum(t.nbytes for t in embeds)
    assert grew("tensors_total", hop="1", path="shm") == len(embeds)
    assert grew("bytes_total", hop="1", path="shm") == total
    assert grew("received_tensors_total", hop="1") == len(embeds)
    assert grew("copied_bytes_total") == total  # one copy each
    assert grew("segments_created_total") == len(embeds)
    assert grew("segments_unlinked_total") == len(embeds)
    assert value(scraped, "dir_held_bytes") == 0
    # The start-up sizing warning comes once, from the first API server.
    assert len(re.findall(r"WARNING.*segment directory .* holds", log)) <= 1


def _stalled_upload(url: str, t: torch.Tensor) -> str:
    """Declare a whole binary body, send a third of it, then nothing: the
    status the server answers with ("cut" if it closed without one)."""
    import socket

    import shm_embeds_client as sec

    headers, pieces, length = sec.frame({"model": "tiny", "max_tokens": 1,
                                         "prompt_embeds": t})
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}"
                  "Connection: close\r\n\r\n".encode())
        s.sendall(b"".join(bytes(p) for p in pieces)[: length // 3])
        reply = s.recv(64).decode(errors="replace")
    return reply.split(" ")[1] if reply.startswith("HTTP/") else "cut"


def _slow_binary(url: str, t: torch.Tensor, kw: dict, pause_s: float = 2.0) -> tuple:
    """A binary body sent as two thirds, a pause of ``pause_s`` (below the
    server's body timeout), then the rest: ``(status, token_ids or text)``.
    While it pauses its segment holds what it has written."""
    import http.client

    import shm_embeds_client as sec

    headers, pieces, length = sec.frame({"model": "tiny", "prompt_embeds": t, **kw})
    data = b"".join(bytes(p) for p in pieces)
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.putrequest("POST", "/v1/completions")
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        conn.send(data[: 2 * length // 3])
        time.sleep(pause_s)
        conn.send(data[2 * length // 3:])
        r = conn.getresponse()
        body = r.read()
        return r.status, (json.loads(body)["choices"][0]["token_ids"] if r.status == 200
                          else body[:200])
    finally:
        conn.close()


@pytest.mark.integration
@pytest.mark.online
def test_flood_on_a_tmpfs_smaller_than_what_is_in_flight(small_shm_server):
    """A flood scaled to this server's 256 KiB tmpfs: 6 binary and 6
    base64 JSON bodies of 100 KiB (about 4.7x the tmpfs in flight), 2 text
    prompts and 2 uploads that stall, all at once. Every embeds and text
    request gets 200 and the tokens of the same token ids, the stalled ones
    408, nothing is a 5xx or hangs; afterwards nothing is left, the server is
    healthy, and what did not fit took the stock way (counted). Three of the
    binary bodies pause for 2 s after two thirds: with the stalled ones they
    hold more than the tmpfs at once, whatever the timing of the others."""
    import shm_embeds_client as sec

    server = small_shm_server
    w = embed_weights(tiny_model())
    ids = [torch.randint(3, w.shape[0], (200,), generator=torch.Generator().manual_seed(60 + i))
           for i in range(12)]
    tensors = [w[i].contiguous() for i in ids]
    # token ids, not text: byte-level text of a token depends on the prompt's tail
    kw = {"max_tokens": 2, "temperature": 0.0, "return_token_ids": True}
    before = server.totals()

    def one(job):
        kind, i = job
        try:
            if kind == "binary" and i < 3:
                return (kind, i, *_slow_binary(server.url, tensors[i], kw))
            if kind == "binary":
                return kind, i, 200, sec.complete(server.url, "tiny", tensors[i], **kw,
                                                  timeout=120)["choices"][0]["token_ids"]
            if kind == "stalled":
                return kind, i, _stalled_upload(server.url, tensors[i]), None
            body = {"model": "tiny", "prompt": f"text {i} " * 20, **kw} if kind == "text" \
                else {"model": "tiny", "prompt": "", "prompt_embeds": encode_embeds(tensors[i]),
                      **kw}
            r = requests.post(server.url + "/v1/completions", json=body, timeout=120)
            return kind, i, r.status_code, r.json()["choices"][0]["token_ids"] if r.ok else r.text
        except Exception as e:  # a hang (timeout) or a refusal fails the test below
            return kind, i, repr(e)[:80], None

    jobs = [("binary", i) for i in range(6)] + [("json", i) for i in range(6, 12)] + \
        [("text", 0), ("text", 1), ("stalled", 0), ("stalled", 1)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    statuses = {(k, i): c for k, i, c, _ in results}
    assert all(c == 200 for (k, _), c in statuses.items() if k != "stalled"), statuses
    assert all(str(c) == "408" for (k, _), c in statuses.items() if k == "stalled"), statuses
    for kind, i, _, text in results:
        if kind in ("binary", "json"):
            want = requests.post(server.url + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": ids[i].tolist(), **kw}).json()["choices"][0]["token_ids"]
            assert text == want, (kind, i)
    d = delta(before, server.totals())
    assert not any(k.startswith("binary_rejected") and not k.endswith("timeout")
                   for k in d), d
    # more than the tmpfs was in flight: some bodies found no room and took the
    # stock way (counted), the others shared memory
    assert sum(v for k, v in d.items() if k.endswith(".no_space")) > 0, d
    assert d.get("hop1_handover_tensors", 0) > 0, d
    wait_until(lambda: not ours_in(server.seg_dir), 5,
               lambda: f"every name to go: {ours_in(server.seg_dir)}", interval=0.1)
    assert requests.get(server.url + "/health", timeout=30).status_code == 200


@pytest.mark.integration
@pytest.mark.online
def test_back_to_back_binary_bodies_on_a_dev_shm_that_holds_one(small_shm_server):
    """Back-to-back bodies on this server's 256 KiB tmpfs: a
    binary body that only fits once, sent again as soon as the last answer
    came, on an otherwise idle server. Every one is served, none refused (one
    that finds no room would be received privately, counted); the names and
    the pages are gone within two seconds of the answer (the API
    server lets go of its mapping when the request ends; the TP workers drop
    theirs at the step right after it). So every one is handed over."""
    import shm_embeds_client as sec

    server = small_shm_server
    w = embed_weights(tiny_model())
    t = _embeds(w, 300, 7)  # 150 KiB: one fits in the 256 KiB tmpfs, two do not
    assert 128 * 1024 < t.nbytes + 4096 < 256 * 1024 < 2 * t.nbytes
    before = server.totals()

    def used():
        st = os.statvfs(server.seg_dir)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    held = {}
    for i in range(4):
        sec.complete(server.url, "tiny", t, max_tokens=4, temperature=0.0)
        # The TP workers drop a finished request at the step right after it.
        deadline = time.monotonic() + 2.0
        while (ours_in(server.seg_dir) or used() >= t.nbytes) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ours_in(server.seg_dir) == [], f"request {i}: names still there after 2 s"
        if used() >= t.nbytes:
            held[i] = holders(server.seg_dir)
    d = delta(before, server.totals())
    assert d.get("binary_bodies") == 4, d
    assert not any(k.startswith("binary_rejected") for k in d), d
    # Every page back within 2 s of the answer, whatever process held them.
    assert held == {}, f"a finished request's pages still held (by pid): {held}"
    assert d.get("hop1_handover_tensors") == 4, d
    # ... and the EngineCore let go of each freed request's pages (the release site)
    assert d.get("engine_pages_released") == 4, d
