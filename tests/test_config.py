# SPDX-License-Identifier: Apache-2.0
"""config.py: each variable is declared once (the core's in ``config.SETTINGS``, an
extension's in its ``EXTENSION.settings``), each fixed limit too (``config.LIMITS``,
``EXTENSION.limits``; changed only by ``VLLM_SHM_EMBEDS_TEST_LIMITS``), and those
declarations (``config.declared()``) drive the parsing, its problem messages, the getters the
package imports, vLLM's ``environment_variables`` entries and the variables table
of ``docs/configuration.md``."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from vllm._shm_embeds import config, extensions
from vllm._shm_embeds.ext.binary import settings as binary_settings
from vllm._shm_embeds.ext.json import json_on
from vllm._shm_embeds.ext.regions import settings as regions_settings
from vllm._shm_embeds.ext.conversations import settings as conversations_settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
PACKAGE = ROOT / "vllm" / "_shm_embeds"
DECLARED = config.declared()
BY_NAME = {s.name: s for s in DECLARED.settings + DECLARED.limits}
TEST_LIMITS = "VLLM_SHM_EMBEDS_TEST_LIMITS"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No variable of ours set, and this process's cache left as it was found."""
    for name in DECLARED.variables:
        monkeypatch.delenv(name, raising=False)
    cache = config.CACHE
    saved = (cache.parsed, dict(cache.budget), dict(cache.shares))
    cache.reset()
    yield
    cache.parsed, cache.budget, cache.shares = saved


def _doc_table() -> str:
    text = DOC.read_text()
    m = re.search(r"<!-- generated from config\.SETTINGS[^\n]*-->\n(.*?)"
                  r"<!-- end of generated table -->", text, re.S)
    assert m, f"{DOC} lost the markers around its variables table"
    return m.group(1)


def test_doc_table_is_what_the_declarations_give():
    assert _doc_table() == config.markdown_table(), (
        "docs/configuration.md's variables table differs from the declarations: "
        "paste the output of `python -m vllm._shm_embeds.config --markdown`")


def test_markdown_command_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "vllm._shm_embeds.config", "--markdown"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    assert out == config.markdown_table()


# The limits that were settings until issue 38 ("fewer knobs").
FORMER_SETTINGS = ("WRITERS", "MAX_SEGMENTS", "BODY_TIMEOUT_S", "BODY_MIN_RATE",
                   "INFLIGHT_BYTES", "BINARY_MAX_BYTES", "BINARY_MAX_TENSORS", "REGIONS_MAX",
                   "REGIONS_MAX_BYTES", "REGIONS_TTL_S", "REGIONS_IDLE_S", "REGIONS_REFS_MAX",
                   "REGIONS_LEASES_MAX")


def test_declarations_are_consistent():
    names = [s.name for s in DECLARED.settings]
    limits = [s.name for s in DECLARED.limits]
    fields = [s.field for s in DECLARED.settings + DECLARED.limits]
    assert len(set(names + limits)) == len(names + limits) and len(set(fields)) == len(fields)
    assert all(n == "VLLM_SHM_EMBEDS" or n.startswith("VLLM_SHM_EMBEDS_") for n in names)
    assert not any(n.startswith("VLLM_") for n in limits)  # no variable of their own
    assert all(s.unit and s.doc and "|" not in s.doc for s in DECLARED.settings + DECLARED.limits)
    # issue 38, "fewer knobs": 23 settings before, these 10 after (the 13 others: limits)
    assert len(names) == 10 and set(FORMER_SETTINGS) <= set(limits)
    # the core declares its own; each extension's are in its EXTENSION, in EXTENSIONS order
    assert DECLARED.extensions == tuple(extensions.EXTENSIONS)
    assert names[:len(config.SETTINGS)] == [s.name for s in config.SETTINGS]
    assert limits[:len(config.LIMITS)] == [s.name for s in config.LIMITS] == [
        "WRITERS", "MAX_SEGMENTS"]
    assert names[len(config.SETTINGS):] == [
        "VLLM_SHM_EMBEDS_JSON", *(s.name for s in regions_settings.SETTINGS)]
    assert limits[len(config.LIMITS):] == [s.name for s in
                                           binary_settings.LIMITS + regions_settings.LIMITS
                                           + conversations_settings.LIMITS]
    assert config.TEST_LIMITS == TEST_LIMITS
    assert DECLARED.variables == (*names, TEST_LIMITS)
    env_vars = config.env_vars()
    assert list(env_vars) == [*names, TEST_LIMITS]  # vLLM warns about none of them
    for name, getter in env_vars.items():
        getter()  # vLLM may call any of them: none raises with nothing set
    assert env_vars["VLLM_SHM_EMBEDS_MAX_BYTES"] is config.budget_bytes


def test_settings_follow_the_loaded_extensions(monkeypatch):
    """Settings parsed while the extensions were still loading are never reused, and an
    extension's getter gives its default while its extension is not loaded."""
    loaded = extensions.loaded()
    full = config.settings()
    monkeypatch.setattr(extensions, "_LOADED", {})  # as while the extensions load
    partial = config.settings()
    assert partial is not full and not hasattr(partial, "json") and hasattr(partial, "dir")
    assert json_on() is True and regions_settings.regions_max() == regions_settings.REGIONS_MAX
    monkeypatch.setattr(extensions, "_LOADED", loaded)
    assert config.settings() is not partial and config.settings().json is True


def test_vllm_does_not_warn_about_the_test_limits(monkeypatch):
    """The plugin declares VLLM_SHM_EMBEDS_TEST_LIMITS to vLLM with the settings, so
    ``Platform.validate_environ`` (even with ``hard_fail``) accepts it."""
    import vllm.envs as envs
    from vllm.platforms.interface import Platform

    from vllm._shm_embeds import plugin

    plugin._declare_env_vars()
    for name in [n for n in os.environ if n.startswith("VLLM_")]:
        if name not in envs.environment_variables:
            monkeypatch.delenv(name)  # somebody else's: not what this test is about
    monkeypatch.setenv(TEST_LIMITS, "BODY_TIMEOUT_S=2")
    Platform.validate_environ(hard_fail=True)
    assert envs.environment_variables[TEST_LIMITS]() == "BODY_TIMEOUT_S=2"


def test_changelog_lists_every_former_setting():
    """docs/configuration.md says what each limit was and what it is now."""
    text = DOC.read_text()
    changelog = text[text.index("## Changelog"):]
    for limit in DECLARED.limits:
        if limit.name not in FORMER_SETTINGS:
            continue
        row = f"| `VLLM_SHM_EMBEDS_{limit.name}` | {limit.default_text()} | {limit.unit} | "
        assert row in changelog, limit.name
    assert TEST_LIMITS in text and TEST_LIMITS not in _doc_table()


def test_unset_means_the_declared_defaults():
    s = config.settings()
    assert s.problems == () and s.fatal == ()
    for setting in DECLARED.settings + DECLARED.limits:
        default = setting.default
        expected = default() if callable(default) else default
        assert getattr(s, setting.field) == expected, setting.name
    assert (s.enabled, s.min_bytes, s.dir, s.json, s.max_segments) == (
        False, 1 << 20, "/dev/shm", True, 4096)
    assert (config.max_segments(), binary_settings.body_timeout_s(),
            regions_settings.regions_leases_max()) == (
        config.MAX_SEGMENTS, binary_settings.BODY_TIMEOUT_S, regions_settings.REGIONS_LEASES_MAX)


# The messages the start-up log prints (``shm-embeds: <message>``), as they were
# before the declarations: a bad value is named, cut at 64 characters, and the
# default used instead is said.
@pytest.mark.parametrize("name,raw,message", [
    ("VLLM_SHM_EMBEDS", "enable", "VLLM_SHM_EMBEDS='enable' is not a flag (1/0); using False"),
    ("VLLM_SHM_EMBEDS_JSON", "2", "VLLM_SHM_EMBEDS_JSON='2' is not a flag (1/0); using True"),
    ("VLLM_SHM_EMBEDS_STRICT", "2", "VLLM_SHM_EMBEDS_STRICT='2' is not a flag (1/0); using False"),
    ("VLLM_SHM_EMBEDS_MIN_BYTES", " 1MiB ",
     "VLLM_SHM_EMBEDS_MIN_BYTES='1MiB' is not a byte count; using 1048576"),
    ("VLLM_SHM_EMBEDS_MAX_BYTES", "x" * 100,
     f"VLLM_SHM_EMBEDS_MAX_BYTES={'x' * 64!r} is not a byte count; using None"),
    ("VLLM_SHM_EMBEDS_REGIONS_UIDS", "1001,x",
     "VLLM_SHM_EMBEDS_REGIONS_UIDS='1001,x' is not a comma-separated list of uids; using ()"),
])
def test_bad_value_gives_the_default_and_one_message(monkeypatch, name, raw, message):
    monkeypatch.setenv(name, raw)
    s = config.settings()
    assert s.problems == (message,)
    setting = BY_NAME[name]
    assert getattr(s, setting.field) == setting.default


# The limits the test suite changes, with the kinds (and messages) they had as settings.
@pytest.mark.parametrize("name,raw,message", [
    ("BINARY_MAX_BYTES", "-1", "BINARY_MAX_BYTES='-1' is not a byte count; using None"),
    ("BODY_TIMEOUT_S", "0", "BODY_TIMEOUT_S='0' is not a number of seconds; using 30.0"),
    ("BODY_MIN_RATE", "0", "BODY_MIN_RATE='0' is not a positive byte rate; using 1048576"),
    ("INFLIGHT_BYTES", "1.5", "INFLIGHT_BYTES='1.5' is not a byte count; using None"),
    ("BINARY_MAX_TENSORS", "0", "BINARY_MAX_TENSORS='0' is not a positive count; using 256"),
    ("MAX_SEGMENTS", "many", "MAX_SEGMENTS='many' is not a positive count; using 4096"),
    ("REGIONS_MAX", "-1", "REGIONS_MAX='-1' is not a positive count; using 64"),
    ("REGIONS_MAX_BYTES", "0",
     "REGIONS_MAX_BYTES='0' is not a positive byte count; using 17179869184"),
    ("REGIONS_TTL_S", "-3", "REGIONS_TTL_S='-3' is not a number of seconds; using 600.0"),
    ("REGIONS_IDLE_S", "soon", "REGIONS_IDLE_S='soon' is not a number of seconds; using 60.0"),
    ("REGIONS_REFS_MAX", "0", "REGIONS_REFS_MAX='0' is not a positive count; using 64"),
    ("REGIONS_LEASES_MAX", "0", "REGIONS_LEASES_MAX='0' is not a positive count; using 1024"),
])
def test_bad_test_limit_gives_the_constant_and_one_message(monkeypatch, name, raw, message):
    monkeypatch.setenv(TEST_LIMITS, f"{name}={raw}")
    s = config.settings()
    assert s.problems == (f"{TEST_LIMITS}: {message}",)
    assert getattr(s, BY_NAME[name].field) == BY_NAME[name].default


def test_test_limits_override_only_what_they_name(monkeypatch):
    monkeypatch.setenv(TEST_LIMITS, " BODY_TIMEOUT_S=2, inflight_bytes = 1048576 ,")
    assert binary_settings.body_timeout_s() == 2.0 and binary_settings.inflight_bytes() == 1 << 20
    assert config.settings().problems == ()
    assert config.max_segments() == config.MAX_SEGMENTS  # not named: the constant
    assert binary_settings.body_deadline_s(1 << 20) == 3.0  # 2 s + 1 MiB at the constant 1 MiB/s
    # a bad entry: that limit keeps its constant, the others still apply, one message each
    monkeypatch.setenv(TEST_LIMITS, "BODY_TIMEOUT_S=soon,REGIONS_MAX=3,NO_SUCH=1,WRITERS")
    s = config.settings()
    assert (binary_settings.body_timeout_s(), regions_settings.regions_max()) == (
        binary_settings.BODY_TIMEOUT_S, 3)
    assert s.problems == (
        f"{TEST_LIMITS}: 'NO_SUCH=1' is not NAME=value with NAME one of the declared limits; "
        "ignored",
        f"{TEST_LIMITS}: 'WRITERS' is not NAME=value with NAME one of the declared limits; "
        "ignored",
        f"{TEST_LIMITS}: BODY_TIMEOUT_S='soon' is not a number of seconds; using 30.0")
    # the old variables are no longer read
    monkeypatch.delenv(TEST_LIMITS)
    monkeypatch.setenv("VLLM_SHM_EMBEDS_" + "BODY_TIMEOUT_S", "2")
    assert binary_settings.body_timeout_s() == binary_settings.BODY_TIMEOUT_S
    assert config.settings().problems == ()


@pytest.mark.parametrize("raw,ok", [("", True), ("2", True), ("0", False), ("x", False),
                                    ("99", False)])
def test_writers_limit(monkeypatch, raw, ok):
    monkeypatch.setenv(TEST_LIMITS, f"WRITERS={raw}")
    assert 1 <= config.writers() <= config.MAX_WRITERS
    assert (not any("WRITERS" in p for p in config.settings().problems)) == ok
    if not ok:
        assert config.settings().problems == (
            f"{TEST_LIMITS}: WRITERS={raw!r} is not a count in 1..16; "
            f"using {config._default_writers()}",)


@pytest.mark.parametrize("raw", ["", "1MiB", "1e6", "-5"])
def test_bad_min_bytes_defaults(monkeypatch, raw):
    monkeypatch.setenv("VLLM_SHM_EMBEDS_MIN_BYTES", raw)
    assert config.min_bytes() == config.DEFAULT_MIN_BYTES
    assert bool(config.settings().problems) == bool(raw)


@pytest.mark.parametrize(("raw", "on"), [
    *[(raw, True) for raw in ("1", "true", "T", " yes ", "y", "ON")],
    *[(raw, False) for raw in ("0", "false", "F", " no ", "n", "OFF")]])
@pytest.mark.parametrize("name", ["VLLM_SHM_EMBEDS", "VLLM_SHM_EMBEDS_JSON",
                                  "VLLM_SHM_EMBEDS_STRICT"])
def test_flags(monkeypatch, name, raw, on):
    monkeypatch.setenv(name, raw)
    assert getattr(config.settings(), BY_NAME[name].field) is on
    assert config.settings().problems == ()


def test_text_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_SHM_EMBEDS_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_SHM_EMBEDS_REGIONS", "  /run/r.sock ")
    monkeypatch.setenv("VLLM_SHM_EMBEDS_REGIONS_GROUP", "   ")
    monkeypatch.setenv("VLLM_SHM_EMBEDS_REGIONS_UIDS", " 1001, 1002,")
    assert config.shm_dir() == str(tmp_path) and config.settings().fatal == ()
    assert regions_settings.regions_path() == "/run/r.sock"
    assert regions_settings.regions_group() is None
    assert regions_settings.regions_allowed_uids() == {os.getuid(), 1001, 1002}
    monkeypatch.setenv("VLLM_SHM_EMBEDS_DIR", str(tmp_path / "missing"))
    assert config.settings().fatal == (
        f"segment directory {tmp_path / 'missing'} is missing or not writable",)
    assert config.settings().problems == ()  # fatal messages are the plugin's to add


def test_binary_max_bytes_zero_means_the_model(monkeypatch):
    assert binary_settings.binary_max_bytes(10, 4) == 160
    monkeypatch.setenv(TEST_LIMITS, "BINARY_MAX_BYTES=0")
    assert binary_settings.binary_max_bytes(10, 4) == 160 and config.settings().problems == ()
    monkeypatch.setenv(TEST_LIMITS, "BINARY_MAX_BYTES=1000")
    assert binary_settings.binary_max_bytes(10, 4) == 1000


def test_body_deadline(monkeypatch):
    deadline = binary_settings.body_deadline_s
    assert deadline(1 << 20) == 31.0  # the constants: 30 s + 1 MiB at 1 MiB/s
    monkeypatch.setenv(TEST_LIMITS, "BODY_TIMEOUT_S=2.5,BODY_MIN_RATE=100")
    assert binary_settings.body_timeout_s() == 2.5
    assert deadline(1000) == 12.5 and deadline(-1) == 2.5


@pytest.mark.parametrize("shared,free,budget", [
    (False, 10 << 20, 500 << 20),  # a file system of its own: half of it
    (True, 900 << 20, 500 << 20),  # /dev/shm's: half of it ...
    (True, 100 << 20, 36 << 20),  # ... at most what is free less 64 MiB
    (True, 10 << 20, 0),
])
def test_default_budget(monkeypatch, shared, free, budget):
    """What README and docs/configuration.md say of the default budget."""
    class Vfs:
        f_frsize, f_blocks, f_bavail = 1 << 20, 1000, free >> 20

    asked = []
    monkeypatch.setattr(config.os, "statvfs", lambda d: asked.append(d) or Vfs)
    monkeypatch.setattr(config, "shares_dev_shm", lambda: shared)
    assert config.budget_bytes() == budget
    assert config.budget_bytes() == budget and asked == ["/dev/shm"]  # asked once
    inflight = binary_settings.inflight_bytes
    assert inflight() == max(1 << 30, budget)
    monkeypatch.setenv("VLLM_SHM_EMBEDS_MAX_BYTES", "12345")
    assert config.budget_bytes() == 12345 and inflight() == 1 << 30
    monkeypatch.setenv(TEST_LIMITS, "INFLIGHT_BYTES=777")
    assert config.budget_bytes() == 12345 and inflight() == 777


def test_cache_parses_again_only_on_change(monkeypatch):
    first = config.settings()
    assert config.settings() is first
    monkeypatch.setenv("VLLM_SHM_EMBEDS_MIN_BYTES", "5")
    assert config.settings() is not first and config.min_bytes() == 5
    config.shares_dev_shm()
    assert config.CACHE.shares and config.CACHE.parsed
    config.CACHE.reset()
    assert config.CACHE.parsed is None and not config.CACHE.shares and not config.CACHE.budget


def test_every_config_name_the_package_uses_exists():
    """Getters are built from the declarations: a name imported from config
    (``from ...config import x`` or ``config.x``) must be there."""
    used = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for group in re.findall(r"from vllm\._shm_embeds\.config import (\([^)]*\)|[^\n]*)",
                                text):
            used.update(n.strip(" ()\n") for n in group.split(",") if n.strip(" ()\n"))
        if re.search(r"from vllm\._shm_embeds import [^\n]*\bconfig\b", text):
            used.update(re.findall(r"(?<![\w.])config\.([A-Za-z_]\w*)", text))
    assert {"min_bytes", "shm_dir", "budget_bytes", "MAX_WRITERS"} <= used
    assert sorted(n for n in used if not hasattr(config, n)) == []
