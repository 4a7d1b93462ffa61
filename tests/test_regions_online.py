# SPDX-License-Identifier: Apache-2.0
"""Online: registered regions on the suite's main server, TP=2.

The main server serves registrations on ``VLLM_SHM_EMBEDS_REGIONS``
(conftest.py). A producer registers a sealed memfd; requests name it in a
plain JSON body. The counters must show that no process copied its bytes
(hop 1 by the API server's descriptor, hop 2 by the EngineCore's) and that
the EngineCore hashed none of its blocks; the answers must equal the binary
path's; a reference that does not match gets 400 and leaves the server
healthy; a producer killed while its region is in use leaves nothing behind
once the requests end.
"""

import os
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from helpers import METRICS_PREFIX, delta, descendants, encode_embeds, stopped, wait_until
from test_binary import KW, _ids, _prefix_cache_hits

import shm_embeds_client as sec

pytestmark = [pytest.mark.integration, pytest.mark.online]

MEMFD_NAME = "shm-embeds-region"  # the client's memfd name


def _memfd_holders() -> dict[int, int]:
    """pid -> mappings and fds of client regions (memfds named by the client)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        n = 0
        try:
            with open(f"/proc/{pid}/maps") as f:
                n += sum(f"memfd:{MEMFD_NAME}" in line for line in f)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    n += f"memfd:{MEMFD_NAME}" in os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    pass
        except OSError:
            continue
        if n and int(pid) != os.getpid():
            out[int(pid)] = n
    return out


def _wait_released() -> None:
    """Every mapping and fd of a client region goes (within 10 s)."""
    wait_until(lambda: not _memfd_holders(), 10,
               lambda: f"every mapping and fd of the regions to go: {_memfd_holders()}")


def _settled(server, before: dict) -> dict:
    """Counters once both TP workers counted the request's hop 2."""
    def counted():
        d = delta(before, server.totals())
        return d if d.get("hop2_shm_tensors", 0) >= 3 else None

    return wait_until(counted, 10, lambda: f"hop 2 of both TP workers counted: "
                      f"{delta(before, server.totals())}")


def test_region_request_copies_nothing_and_hits_the_prefix_cache(server):
    """The same tensor as a binary body, then as a registered region (twice),
    then in a chat part: equal answers; the region requests copy no byte in
    any process, the EngineCore hashes none of their blocks, and the region
    hits the blocks the binary body cached (same keys as stock)."""
    url, w = server["url"], server["weights"]
    embeds = w[_ids(320, 21)].contiguous()
    binary = sec.complete(url, "tiny", embeds, **KW)["choices"][0]["text"]
    _, m0 = server.scrape()
    with sec.RegionClient(server["regions"]) as producer:
        region = producer.register(embeds)
        assert region.byte_size == embeds.nbytes
        for i in range(2):
            before, hits = server.totals(), _prefix_cache_hits(url)
            out = sec.complete(url, "tiny", region, **KW)
            assert len(out["choices"]) == 1  # the client adds no "" text prompt
            text = out["choices"][0]["text"]
            d = _settled(server, before)
            assert text == binary
            assert d.get("hop1_region_tensors") == 1 and d.get("hop1_region_adopted") == 1, d
            assert d.get("copied_bytes", 0) == 0, d  # no process copied a byte
            assert d.get("hop2_reused_tensors") == 1 and d.get("hop2_shm_tensors") == 3, d
            assert d.get("hash_engine_blocks", 0) == 0, d  # hashed once, at registration
            assert _prefix_cache_hits(url) - hits >= 256, d
        # a chat content part and a completions list item name it too
        chat = sec.chat(url, "tiny", messages=[{"role": "user", "content": [
            {"type": "prompt_embeds", "data": region}]}], **KW)
        assert chat["choices"][0]["message"]["content"]
        listed = requests.post(url + "/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": "", "prompt_embeds": [region.to_json()], **KW})
        assert listed.status_code == 200 and listed.json()["choices"][0]["text"] == binary
    _, m1 = server.scrape()  # /metrics shows the region path

    def moved(name, **labels):
        key = (METRICS_PREFIX + name, frozenset(labels.items()))
        return m1.get(key, 0) - m0.get(key, 0)

    assert moved("regions_registered_total") == 1 and moved("region_leases_total") == 4
    assert moved("reused_tensors_total", hop="1") == 4 and moved("copied_bytes_total") == 0
    # unregistered by closing the connection: every mapping and fd goes
    _wait_released()


def test_region_references_that_do_not_match_get_400(server):
    url, w = server["url"], server["weights"]
    embeds = w[_ids(64, 22)].contiguous()
    with sec.RegionClient(server["regions"]) as producer:
        region = producer.register(embeds)
        good = region.to_json()

        def post(ref):
            return requests.post(url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "", "prompt_embeds": ref, **KW})

        bad = [
            {**good, "parameters": {**good["parameters"], "shared_memory_region": "x" * 22}},
            {**good, "parameters": {**good["parameters"], "shared_memory_byte_size": 4}},
            {**good, "parameters": {**good["parameters"], "shared_memory_offset": 4096}},
            {**good, "shape": [32, 2 * good["shape"][1]]},
            {**good, "datatype": "FP16"},
            {**good, "parameters": {**good["parameters"], "shared_memory_region": 7}},
        ]
        for ref in bad:
            r = post(ref)
            assert r.status_code == 400, (ref, r.text)
            msg = r.json()["error"]["message"]
            assert "/" not in msg.replace("prompt_embeds", "") and "memfd" not in msg, msg
            assert ref["parameters"]["shared_memory_region"] != msg
        # beside a base64 tensor: refused clearly (the JSON path would hide it)
        r = post([good, encode_embeds(embeds)])
        assert r.status_code == 400 and "cannot also carry" in r.text, r.text
        # a chat part without data, in a body that mentions regions: vLLM's 400, not a 500
        r = requests.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", **KW, "messages": [{"role": "user", "content": [
                {"type": "prompt_embeds"},
                {"type": "text", "text": "shared_memory_region"}]}]})
        assert r.status_code == 400, r.text
        producer.unregister(region)
        assert post(good).status_code == 400  # unregistered
    assert post(good).status_code == 400
    assert post({**good, "parameters": {}}).status_code == 400  # vLLM's own validation
    assert requests.get(url + "/health", timeout=30).status_code == 200
    _wait_released()


PRODUCER = textwrap.dedent("""
    import sys, time, torch
    import shm_embeds_client as sec
    t = torch.load(sys.argv[2])
    c = sec.RegionClient(sys.argv[1])
    r = c.register(t)
    print(r.id, flush=True)
    time.sleep(600)
""")


def test_producer_killed_while_its_region_is_in_use(server, tmp_path):
    """A producer SIGKILLed while requests use its region: those requests end
    well, later ones get 400, and nothing of the region is left anywhere.

    The region is in use at the kill (asserted): the EngineCore is stopped
    (SIGSTOP) before the three requests are sent and until the registry has
    unregistered the dead producer's region, so none of them can end
    meanwhile (in CI a version that stopped it only once the leases were
    counted saw all three end first: ``regions_freed`` 1); the region must
    then be draining, unregistered but not freed (counters)."""
    url, w = server["url"], server["weights"]
    embeds = w[_ids(1500, 23)].contiguous()
    torch.save(embeds, tmp_path / "e.pt")
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, server["regions"],
                             str(tmp_path / "e.pt")], stdout=subprocess.PIPE, text=True)
    try:
        region_id = proc.stdout.readline().strip()
        assert region_id, "the producer did not register"
        ref = {"datatype": "FP32", "shape": list(embeds.shape), "parameters": {
            "shared_memory_region": region_id, "shared_memory_byte_size": embeds.nbytes,
            "shared_memory_offset": 0}}
        body = {"model": "tiny", "prompt": "", "prompt_embeds": ref, "max_tokens": 24,
                "temperature": 0.0}
        before = server.totals()
        [engine] = descendants(server["proc"], "EngineCore")
        # (the pool is left after the EngineCore runs again: it waits for the requests)
        with ThreadPoolExecutor(3) as pool, stopped([engine.pid]):
            futures = [pool.submit(requests.post, url + "/v1/completions", json=body,
                                   timeout=300) for _ in range(3)]
            wait_until(lambda: delta(before, server.totals()).get("region_leases", 0) >= 3,
                       60, lambda: f"a lease for each request: {delta(before, server.totals())}")
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            wait_until(lambda: delta(before, server.totals()).get(
                "region_unregistered.disconnect", 0) >= 1, 30,
                "the registry to unregister the dead producer's region")
            # read after the unregistration was counted (a region freed
            # at its unregistration is counted freed before that)
            d = delta(before, server.totals())
            assert d.get("region_leases") == 3 and d.get("regions_freed", 0) == 0, \
                f"no lease of the region was live when its producer died: {d}"
        answers = [f.result() for f in futures]  # the EngineCore ran again: they ended
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        assert len({r.json()["choices"][0]["text"] for r in answers}) == 1
        wait_until(lambda: requests.post(url + "/v1/completions", json=body,
                                         timeout=60).status_code == 400,
                   10, "the dead producer's region to stop serving (400)", interval=0.2)
        wait_until(lambda: delta(before, server.totals()).get("regions_freed") == 1, 10,
                   "the region freed at the end of its last lease")
    finally:
        proc.kill()
        proc.wait()
    _wait_released()
    assert requests.get(url + "/health", timeout=30).status_code == 200


def test_regions_with_two_api_servers_and_dp2(dp_server):
    """``vllm serve --data-parallel-size 2`` starts two API servers and two
    EngineCores: one API server serves the regions socket, the other looks
    each region up there (``ext/regions/mirror.py``); requests on either copy
    nothing, and hop 1 reaches both EngineCores."""
    url, server = dp_server["url"], dp_server
    from helpers import embed_weights

    w = embed_weights(server.model)
    embeds = w[_ids(200, 24)].contiguous()
    want = sec.complete(url, "tiny", embeds, **KW)["choices"][0]["text"]
    with sec.RegionClient(server["regions"]) as producer:
        region = producer.register(embeds)
        before = server.read_stats()
        for i in range(40):
            r = requests.post(url + "/v1/completions", timeout=300,
                              headers={"X-data-parallel-rank": str(i % 2)}, json={
                                  "model": "tiny", "prompt": "", **KW,
                                  "prompt_embeds": region.to_json()})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
            after = server.read_stats()
            lookups = sum(p["counters"].get("region_lookups", 0) for p in after) - sum(
                p["counters"].get("region_lookups", 0) for p in before)
            if i >= 3 and lookups:
                break
        assert lookups >= 1, "no request reached the API server that mirrors regions"
    adopted = {p["pid"]: p["counters"].get("hop1_region_adopted", 0) for p in after}
    was = {p["pid"]: p["counters"].get("hop1_region_adopted", 0) for p in before}
    engines = [p for p in after if "engine" in p["roles"]]
    assert len(engines) == 2 and all(adopted[p["pid"]] > was.get(p["pid"], 0)
                                     for p in engines), adopted
    assert sum(p["counters"].get("copied_bytes", 0) for p in after) == sum(
        p["counters"].get("copied_bytes", 0) for p in before)
    _wait_released()
