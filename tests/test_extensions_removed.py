# SPDX-License-Identifier: Apache-2.0
"""Proof that the extensions can be deleted (issue 38): on a copy of the package
with folders of ``ext/`` deleted, loaded in every process instead of this tree's.

* each extension deleted in turn (and all of them): the plugin imports and
  applies in an API server's process; the core's groups are patched, the
  deleted extension's are gone, and what needs it is off and says why;
* every extension deleted: an offline TP=2 engine carries ``prompt_embeds``
  through both hops by shared memory (counters), with answers equal to the
  token ids'; and the core's own tests pass against that copy.

The copy is put first by a ``sitecustomize`` on ``PYTHONPATH`` (every process
of the engine inherits it): a finder that loads ``vllm._shm_embeds`` from the
copy; its submodules then follow the copy's ``__path__``.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
from helpers import REPO, SITECUSTOMIZE, by_role, forked_cases, run_offline, tiny_model

from vllm._shm_embeds import extensions

PACKAGE = os.path.join(REPO, "vllm", "_shm_embeds")
# The core's own tests: none imports an extension.
CORE_TESTS = ("test_mechanism.py", "test_lifecycle.py", "test_census.py",
              "test_private_dir.py")

_SITECUSTOMIZE = r'''
import importlib.machinery, os, sys
_ROOT = {root!r}

class _CopyFinder:
    """vllm._shm_embeds from the copy at _ROOT (never this repository's)."""
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "vllm._shm_embeds":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, [os.path.join(_ROOT, "vllm")])
        if spec is None:
            raise ModuleNotFoundError(fullname)
        with open(os.path.join(_ROOT, "loaded-by"), "a") as f:  # one line per process
            f.write(f"{{os.getpid()}}\n")
        return spec

sys.meta_path.insert(0, _CopyFinder())
'''


def stripped_tree(tmp: str, deleted: tuple[str, ...]) -> dict[str, str]:
    """A copy of the package under ``tmp`` without the folders of
    ``deleted`` extensions; returns the environment that loads it."""
    dst = os.path.join(tmp, "tree", "vllm", "_shm_embeds")
    shutil.copytree(PACKAGE, dst, ignore=shutil.ignore_patterns("__pycache__"))
    for name in deleted:
        shutil.rmtree(os.path.join(dst, extensions.EXTENSIONS[name]))
    site = os.path.join(tmp, "site")
    os.makedirs(site)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE.format(root=os.path.join(tmp, "tree")))
        if os.environ.get("SHM_EMBEDS_TEST_HOOKS"):  # the suite's engine hooks too
            f.write(SITECUSTOMIZE)
    return {"PYTHONPATH": os.pathsep.join(
        [site, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")])}


_PROBE = textwrap.dedent("""
    import json, os
    import vllm._shm_embeds as pkg
    from vllm._shm_embeds import extensions, plugin, sites
    from vllm._shm_embeds.sites.site import STATUS
    plugin.register()
    print("PROBE " + KEY + " " + json.dumps({"file": pkg.__file__, "status": STATUS,
                                             "loaded": list(extensions.loaded()),
                                             "missing": extensions.MISSING,
                                             "groups": list(sites.GROUPS)}))
""")


def _probes(cases: dict[str, str], tmp: pathlib.Path) -> dict[str, dict]:
    """``{key: what the plugin loaded}`` for each ``{key: tree root}``
    (:func:`stripped_tree`'s ``tmp``; outputs in ``tmp``). One interpreter imports vLLM as an API
    server's process does (every group considered), then a child forked per tree
    puts the tree's finder first (as its sitecustomize would) and loads the plugin
    from it (``helpers.forked_cases``: the imports, 15 s a case here, paid once)."""
    preamble = ("import sys, vllm.entrypoints.launchers.app\n"
                "assert 'vllm._shm_embeds' not in sys.modules, 'vLLM loaded the plugin'")
    todo = [({"VLLM_SHM_EMBEDS": "1"}, _SITECUSTOMIZE.format(root=os.path.join(root, "tree"))
             + f"\nKEY = {key!r}\n" + _PROBE) for key, root in cases.items()]
    out = {}
    for key, (status, stdout, stderr) in zip(cases, forked_cases(preamble, todo, tmp)):
        assert status == 0, stderr[-3000:]
        line = [ln for ln in stdout.splitlines() if ln.startswith(f"PROBE {key} ")]
        assert line, stdout[-2000:] + stderr[-3000:]
        out[key] = json.loads(line[-1][len(f"PROBE {key} "):])
    return out


DELETIONS = {**{n: (n,) for n in extensions.EXTENSIONS}, "all": tuple(extensions.EXTENSIONS)}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """What the plugin loaded from each stripped tree (:data:`DELETIONS`), and
    from a tree whose binary site module raises on import (``"broken"``)."""
    roots = {key: str(tmp_path_factory.mktemp(f"probe-{key}")) for key in [*DELETIONS, "broken"]}
    for key, deleted in DELETIONS.items():
        stripped_tree(roots[key], deleted)
    stripped_tree(roots["broken"], ())
    broken = os.path.join(roots["broken"], "tree", "vllm", "_shm_embeds", "ext", "binary",
                          "site_renderers.py")
    with open(broken) as f:
        text = f.read()
    with open(broken, "w") as f:
        f.write('raise RuntimeError("planted: this site module cannot load")\n' + text)
    return roots, _probes(roots, tmp_path_factory.mktemp("probe-out"))


def _needing(name: str) -> set[str]:
    """The extensions that cannot load without ``name``, directly or not."""
    out = {name}
    for other in extensions.EXTENSIONS:  # in load order: needs come first
        if set(extensions.loaded()[other].needs) & out:
            out.add(other)
    return out


@pytest.mark.xdist_group("extension_probes")
@pytest.mark.parametrize("key", list(DELETIONS))
def test_plugin_applies_with_extensions_deleted(probed, key):
    roots, probes = probed
    deleted, got = DELETIONS[key], probes[key]
    assert got["file"].startswith(roots[key])  # the copy was loaded, not this tree
    off = set().union(*(_needing(n) for n in deleted))
    assert set(got["loaded"]) == set(extensions.EXTENSIONS) - off
    for name in deleted:
        assert got["missing"][name] == "not installed (its folder is absent)"
    for name in off - set(deleted):
        assert got["missing"][name].startswith("needs ")
    gone = {g for n in off for g in extensions.loaded()[n].groups}
    assert not gone & set(got["groups"])
    # The core's hops and every group of what is left are patched.
    assert got["status"]["hop1"] == [] and got["status"]["hop2"] == []
    kept = {g for n in got["loaded"] for g in extensions.loaded()[n].groups} - {"regions"}
    assert all(got["status"][g] == [] for g in kept), got["status"]


@pytest.mark.integration
@pytest.mark.xdist_group("offline_core")
def test_core_alone_carries_embeds_through_both_hops(tmp_path):
    """Every extension deleted: an offline TP=2 engine on the tiny model
    answers ``prompt_embeds`` as it answers the same token ids, and both hops
    carried every tensor by shared memory (counted, not logged)."""
    env = stripped_tree(str(tmp_path), tuple(extensions.EXTENSIONS))
    out, _, _ = run_offline(tmp_path, True, tiny_model(), (40, 300), env=env)
    assert out["embeds"] == out["token_ids"]
    stats = out["stats_after_generate"]
    n, total = len(out["embeds_bytes"]), sum(out["embeds_bytes"])
    [client], [engine] = by_role(stats, "client"), by_role(stats, "engine")
    workers = by_role(stats, "worker")
    assert len(workers) == 2
    assert client.get("hop1_shm_tensors") == n and client.get("hop1_shm_bytes") == total
    assert "hop1_stock_tensors" not in client
    assert engine.get("hop1_adopted_tensors") == n
    assert engine.get("hop2_shm_tensors") == n and "hop2_stock_tensors" not in engine
    for w in workers:
        assert w.get("hop2_shm_tensors") == n and w.get("hop2_shm_bytes") == total
    # The copy's package, not this tree's, in every process (client, EngineCore, 2 workers).
    with open(tmp_path / "tree" / "loaded-by") as f:
        assert len(set(f.read().split())) >= 4


@pytest.mark.xdist_group("offline_core")
def test_core_tests_pass_without_extensions(tmp_path):
    env = {**os.environ, **stripped_tree(str(tmp_path), tuple(extensions.EXTENSIONS))}
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm._shm_embeds as p; print(p.__file__)"],
        env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip().startswith(str(tmp_path)), probe.stderr[-2000:]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not integration",
         *[os.path.join(REPO, "tests", t) for t in CORE_TESTS]],
        env=env, capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


@pytest.mark.xdist_group("extension_probes")
def test_extension_whose_site_module_fails_is_left_out_whole(probed):
    """An extension whose site module raises on import (here binary's renderers)
    is left out with everything that needs it: none of their groups is patched,
    in part or whole, and the core's hops still are."""
    roots, probes = probed
    got = probes["broken"]
    assert got["file"].startswith(roots["broken"])
    off = _needing("binary")
    assert set(got["loaded"]) == set(extensions.EXTENSIONS) - off
    assert got["missing"]["binary"] == "failed to load"
    assert all(got["missing"][n] == "needs binary" for n in off - {"binary"})
    gone = {g for n in off for g in extensions.loaded()[n].groups}
    assert not gone & set(got["groups"]) and not gone & set(got["status"])
    assert got["status"]["hop1"] == [] and got["status"]["hop2"] == []


def test_the_project_builds_with_extension_folders_deleted(tmp_path):
    """A checkout with every ``ext/`` folder deleted and nothing else changed builds
    (``pip wheel .``: what ``pip install .`` runs) and its wheel holds every
    package that is left and none that was deleted (pyproject.toml finds them;
    the offline engine above proves both hops on that tree)."""
    deleted = tuple(extensions.EXTENSIONS)
    src = tmp_path / "checkout"
    for name in ("pyproject.toml", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(REPO, name), src / name)
    shutil.copytree(os.path.join(REPO, "vllm"), src / "vllm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in deleted:
        shutil.rmtree(src / "vllm" / "_shm_embeds" / extensions.EXTENSIONS[name])
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    [wheel] = os.listdir(tmp_path / "wheel")
    import zipfile
    with zipfile.ZipFile(tmp_path / "wheel" / wheel) as z:
        dirs = {os.path.dirname(n) for n in z.namelist() if n.endswith(".py")}
    left = {os.path.relpath(root, src) for root, _, files in os.walk(src / "vllm")
            if "__init__.py" in files}
    assert dirs == left and "vllm/_shm_embeds" in dirs
    assert not any(extensions.EXTENSIONS[n] in d for n in deleted for d in dirs)
