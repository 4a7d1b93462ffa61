# SPDX-License-Identifier: Apache-2.0
"""The glue (vllm/_shm_embeds_glue.py) against the installed vLLM, without engines.

Hop 1 through vLLM's real ``MsgpackEncoder``/``MsgpackDecoder`` and
``EngineCoreRequest``; hop 2's ``collective_rpc`` wrapper with local and with
remote (other-node) readers; every site resolves; executors we do not
support stay untouched.
"""

import os
import subprocess
import sys
import types

import pytest
import torch

from helpers import mine
from vllm import _shm_embeds as shm
from vllm import _shm_embeds_glue as glue


def _request(embeds):
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id="r1", prompt_token_ids=None, mm_features=None,
        sampling_params=None, pooling_params=None, arrival_time=0.0,
        lora_request=None, cache_salt=None, data_parallel_rank=None,
        prompt_embeds=embeds,
    )


def test_every_site_resolves_in_installed_vllm():
    assert glue.check_sites() == {"hop1": [], "hop2": []}
    for key, site in glue.BINARY_SITES.items():
        site.resolve()  # raises if a binary-body site does not hold


def test_hop1_through_vllm_msgpack(shm_env):
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    embeds = torch.randn(300, 64).to(torch.bfloat16)
    enc = MsgpackEncoder()
    consumer = shm.HandleOOBConsumer(enc.oob_tensor_consumer)
    enc.oob_tensor_consumer = consumer
    wrapped = glue._ArmingEncoder(enc, consumer)
    frames = wrapped.encode(_request(embeds))
    # Only the msgpack header crosses: no frame carries the tensor bytes.
    assert sum(len(memoryview(f)) for f in frames) < 1024
    provider = shm.HandleOOBProvider(None)
    req = MsgpackDecoder(EngineCoreRequest, oob_tensor_provider=provider).decode(frames)
    assert torch.equal(req.prompt_embeds, embeds)
    assert mine(os.listdir(shm_env)[0])
    # Encoding a non-request (e.g. a utility call) sends tensors inline.
    other = wrapped.encode(("utility", torch.randn(300, 64)))
    assert sum(len(memoryview(f)) for f in other) > 300 * 64 * 4
    del req
    shm.collect()
    assert os.listdir(shm_env) == []  # released before any broadcast


class _NewReq:
    def __init__(self, t):
        self.prompt_embeds = t


def _fake_executor(n_local, n_remote):
    mq = types.SimpleNamespace(n_local_reader=n_local, n_remote_reader=n_remote)
    cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(enable_prompt_embeds=True))
    return types.SimpleNamespace(rpc_broadcast_mq=mq, vllm_config=cfg)


@pytest.mark.parametrize("n_remote", [0, 1])
def test_hop2_wrapper_local_vs_remote_readers(shm_env, n_remote):
    embeds = torch.randn(100, 64)
    so = types.SimpleNamespace(scheduled_new_reqs=[_NewReq(embeds)])
    seen = []

    def orig(self, method, timeout=None, args=(), kwargs=None, **kw):
        seen.append(type(args[0].scheduled_new_reqs[0].prompt_embeds))
        return "ok"

    rpc = glue._wrap_executor_rpc(orig)
    executor = _fake_executor(2, n_remote)
    before = shm.stats()
    assert rpc(executor, "execute_model", args=(so,)) == "ok"
    assert so.scheduled_new_reqs[0].prompt_embeds is embeds  # restored
    if n_remote:
        # A reader on another node cannot map a local file: stock path.
        assert seen == [torch.Tensor]
        assert executor._shm_embeds_readers == 0
        assert shm.stats() == before
    else:
        assert seen == [shm.SharedTensorHandle]
        [name] = os.listdir(shm_env)
        h = shm.SharedTensorHandle(name, "float32", (100, 64))
        for reader in range(2):
            shm.open_tensor(h, reader)
        assert shm.collect() == 1


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
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
    from check_sites import check_site

    return {
        key: check_site(vllm_dir, s.hop, s.module, s.qualname, s.params, s.source_marks,
                        getattr(s, "alt_modules", ()))
        for key, s in {**glue.SITES, **glue.BINARY_SITES, **glue.JSON_SITES}.items()
    }


def test_static_site_check_agrees_with_installed_vllm():
    import vllm

    assert set(_check_tree(os.path.dirname(vllm.__file__)).values()) == {None}


def test_sites_hold_in_vllm_0_33_wheel(tmp_path):
    """vllm 0.33.0 (CUDA wheel, what GPU users run), checked from its source."""
    import zipfile

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
    import check_sites

    dl = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "vllm==0.33.0",
         "-d", str(tmp_path)], capture_output=True, text=True, timeout=900,
    )
    wheels = list(tmp_path.glob("vllm-0.33.0-*.whl"))
    if dl.returncode != 0 or not wheels:
        pytest.skip(f"cannot download vllm 0.33.0: {dl.stderr[-300:]}")
    sites = {**glue.SITES, **glue.BINARY_SITES, **glue.JSON_SITES}
    wanted = {f"vllm/{rel}" for s in sites.values()
              for m in (s.module, *getattr(s, "alt_modules", ()))
              for rel in check_sites.site_files(m)}
    with zipfile.ZipFile(wheels[0]) as z:
        for name in wanted & set(z.namelist()):
            z.extract(name, tmp_path / "src")
    assert _check_tree(str(tmp_path / "src" / "vllm")) == {k: None for k in sites}
