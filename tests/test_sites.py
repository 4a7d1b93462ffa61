# SPDX-License-Identifier: Apache-2.0
"""The sites registry (vllm/_shm_embeds/sites/) against the installed vLLM, without engines.

Hop 1 through vLLM's real ``MsgpackEncoder``/``MsgpackDecoder`` and
``EngineCoreRequest``; hop 2's ``collective_rpc`` wrapper with local and with
remote (other-node) readers; every site resolves, here and (statically) in
the vllm 0.33 wheel; executors we do not support stay untouched.
"""

import importlib
import os
import subprocess
import sys
import types

import pytest
import torch
from helpers import REPO, mine

from vllm._shm_embeds import counters, handle, sites
from vllm._shm_embeds.hops import hop1
from vllm._shm_embeds.lifetime import process, transfer
from vllm._shm_embeds.sites import core_client, multiproc_executor, records

sys.path.insert(0, os.path.join(REPO, "tools"))
import check_sites  # noqa: E402


def _request(embeds):
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id="r1", prompt_token_ids=None, mm_features=None,
        sampling_params=None, pooling_params=None, arrival_time=0.0,
        lora_request=None, cache_salt=None, data_parallel_rank=None,
        prompt_embeds=embeds,
    )


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def test_every_site_resolves_in_installed_vllm():
    keys = [s.key for s in sites.SITES]
    assert len(keys) == len(set(keys)), "site keys must be unique"
    for site in sites.SITES:
        assert site.group in sites.GROUPS, site.key
        assert any(map(_importable, (site.module, *site.alt_modules))), site.key
    for group in sites.GROUPS:
        assert sites.check(group)[0] == [], group


def test_encoder_wrapper_forwards_vllm_attributes():
    """vLLM reads attributes of ``MPClient.encoder`` that the wrapper does not
    define (``oob_tensor_consumer``, ``aux_buffers``, ...): they must be the
    inner ``MsgpackEncoder``'s. (An unreachable ``__getattr__`` once made
    every such read raise AttributeError.)"""
    from vllm.v1.serial_utils import MsgpackEncoder

    enc = MsgpackEncoder()
    consumer = hop1.HandleOOBConsumer(enc.oob_tensor_consumer)
    enc.oob_tensor_consumer = consumer
    wrapped = core_client.ArmingEncoder(enc, consumer)
    assert wrapped.oob_tensor_consumer is consumer
    assert wrapped.size_threshold == enc.size_threshold
    assert wrapped.enc_hook == enc.enc_hook
    wrapped.encode(("utility", 1))
    assert wrapped.aux_buffers is enc.aux_buffers
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute


def test_hop1_through_vllm_msgpack(shm_env):
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    embeds = torch.randn(300, 64).to(torch.bfloat16)
    enc = MsgpackEncoder()
    consumer = hop1.HandleOOBConsumer(enc.oob_tensor_consumer)
    enc.oob_tensor_consumer = consumer
    wrapped = core_client.ArmingEncoder(enc, consumer)
    frames = wrapped.encode(_request(embeds))
    # Only the msgpack header crosses: no frame carries the tensor bytes.
    assert sum(len(memoryview(f)) for f in frames) < 1024
    provider = hop1.HandleOOBProvider(None)
    req = MsgpackDecoder(EngineCoreRequest, oob_tensor_provider=provider).decode(frames)
    assert torch.equal(req.prompt_embeds, embeds)
    assert mine(os.listdir(shm_env)[0])
    # Encoding a non-request (e.g. a utility call) sends tensors inline.
    other = wrapped.encode(("utility", torch.randn(300, 64)))
    assert sum(len(memoryview(f)) for f in other) > 300 * 64 * 4
    del req
    process.collect()
    assert os.listdir(shm_env) == []  # released before any broadcast


class _NewReq:
    def __init__(self, t):
        self.prompt_embeds = t


def _fake_executor(n_local, n_remote):
    mq = types.SimpleNamespace(n_local_reader=n_local, n_remote_reader=n_remote)
    cfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(enable_prompt_embeds=True),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=n_local + n_remote))
    return types.SimpleNamespace(rpc_broadcast_mq=mq, vllm_config=cfg)


@pytest.mark.parametrize("n_remote", [0, 1])
def test_hop2_wrapper_local_vs_remote_readers(shm_env, monkeypatch, n_remote):
    """TP=2 (+1 on another node). Without the enqueue split (the ``remote``
    group off) a remote reader makes hop 2 stock for every reader;
    tests/test_pipeline.py covers the split."""
    monkeypatch.setitem(multiproc_executor.STATUS, "remote", ["enqueue: missing"])
    embeds = torch.randn(100, 64)
    so = types.SimpleNamespace(scheduled_new_reqs=[_NewReq(embeds)])
    seen = []

    def orig(self, method, timeout=None, args=(), kwargs=None, **kw):
        if callable(method):  # the wrapper's probe: every worker runs hop 2
            return [handle.HOP2_WIRE] * (2 + n_remote)
        seen.append(type(args[0].scheduled_new_reqs[0].prompt_embeds))
        return "ok"

    rpc = multiproc_executor.wrap_executor_rpc(orig)
    executor = _fake_executor(2, n_remote)
    before = counters.stats()
    assert rpc(executor, "execute_model", args=(so,)) == "ok"
    assert so.scheduled_new_reqs[0].prompt_embeds is embeds  # restored
    if n_remote:
        # A reader on another node cannot map a local file: stock path.
        assert seen == [torch.Tensor]
        assert records.peek(executor, records.ExecutorRecord).plan is None
        assert counters.stats() == {**before, "fallback.hop2.remote": 1,
                                    "hop2_stock_tensors": 1, "hop2_stock_bytes": embeds.nbytes}
    else:
        assert seen == [handle.SharedTensorHandle]
        [name] = os.listdir(shm_env)
        h = handle.SharedTensorHandle(name, "float32", (100, 64))
        for reader in range(2):
            transfer.open_tensor(h, reader)
        assert process.collect() == 0  # the request still uses it
        transfer.release_adopted(embeds)  # vLLM freed it (``free_request``)
        assert os.listdir(shm_env) == []


@pytest.mark.parametrize("release_ok", [True, False])
def test_names_last_as_long_as_requests_only_with_free_request(monkeypatch, release_ok):
    """Without the ``free_request`` site nothing says when a request ends: the
    books then let a name go once every TP rank mapped it."""
    monkeypatch.setattr(process.current(), "release_known", not release_ok)
    monkeypatch.setattr(sites, "STATUS", {})
    # nothing resolves, nothing is patched; only the release group has problems
    monkeypatch.setattr(sites, "check", lambda group: (
        ["Scheduler._free_request: missing"] if group == "release" and not release_ok
        else [], []))
    sites.apply()
    assert process.current().release_known is release_ok


_UNTOUCHED_PROBE = """
import vllm.plugins as p
p.load_general_plugins()
from vllm.v1.executor.uniproc_executor import UniProcExecutor
wrapped = [n for n, f in vars(UniProcExecutor).items()
           if getattr(f, "__shm_embeds_wrapped__", False)]
try:
    from vllm.v1.executor.ray_executor import RayDistributedExecutor as Ray
    wrapped += [n for n, f in vars(Ray).items()
                if getattr(f, "__shm_embeds_wrapped__", False)]
except ImportError:
    pass
print(wrapped)
"""


def test_uniproc_and_ray_executors_untouched():
    env = dict(os.environ, VLLM_SHM_EMBEDS="1")
    out = subprocess.run([sys.executable, "-c", _UNTOUCHED_PROBE], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _check_tree(vllm_dir):
    return {site.key: check_sites.check_site(vllm_dir, site) for site in sites.SITES}


def test_static_site_check_agrees_with_installed_vllm():
    import vllm

    assert _check_tree(os.path.dirname(vllm.__file__)) == {s.key: None for s in sites.SITES}


def test_static_check_sees_a_missing_mark(tmp_path):
    """The static check is not a rubber stamp: a site whose source lost a
    line we rely on fails it."""
    import vllm

    src = os.path.dirname(vllm.__file__)
    site = sites.get("client_init")
    rel = check_sites.site_files(site.module)[0]
    os.makedirs(tmp_path / os.path.dirname(rel))
    text = open(os.path.join(src, rel)).read()
    (tmp_path / rel).write_text(text.replace("self.encoder = MsgpackEncoder(", "self.enc = X("))
    assert "no longer contains" in check_sites.check_site(str(tmp_path), site)


def test_sites_hold_in_vllm_0_33_wheel():
    """vllm 0.33.0 (CUDA wheel, what GPU users run), checked from its source.

    The wheel is downloaded once and only the site files are kept
    (``.cache/vllm-0.33.0/``; ``tools/check_sites.py --fetch``)."""
    tree = check_sites.fetch("0.33.0")
    if tree is None:
        pytest.skip("cannot download vllm 0.33.0 (no package index?)")
    assert _check_tree(tree) == {s.key: None for s in sites.SITES}
