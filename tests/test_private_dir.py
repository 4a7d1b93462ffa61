# SPDX-License-Identifier: Apache-2.0
"""The private segment directory (``private_dir``): made safely in a shared
mount, inherited by the server's processes, unreadable to other users, gone
at exit, swept when its maker died."""

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

from vllm._shm_embeds import private_dir




def test_made_private_with_one_name_at_the_top(mount):
    seg_dir = private_dir.resolve(mount)
    outer = os.path.dirname(seg_dir)
    assert os.listdir(mount) == [os.path.basename(outer)]
    assert os.path.basename(outer).startswith(private_dir.PREFIX)
    for d in (outer, seg_dir):
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.geteuid()
    assert sorted(os.listdir(outer)) == sorted([private_dir.INNER, private_dir.OWNER_FILE])
    assert os.environ[private_dir.ENV] == outer
    assert private_dir.resolve(mount) == seg_dir
    assert private_dir.remove_made() == 1
    assert os.listdir(mount) == []
    assert private_dir.resolve(mount) == seg_dir  # after the exit's removal: never made again
    assert os.listdir(mount) == []


def test_a_child_inherits_it(mount):
    """A process this one starts (vLLM's EngineCore and workers) gets the same
    directory: the path is in the environment an exec'd child gets (``printenv``),
    and ``resolve`` in a child with none of this module's state (forked, its
    cache cleared: a fresh interpreter's import of vLLM costs seconds) finds it."""
    seg_dir = private_dir.resolve(mount)
    outer = os.path.dirname(seg_dir)
    assert subprocess.run(["printenv", private_dir.ENV], capture_output=True, text=True,
                          check=True).stdout.strip() == outer
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            private_dir._resolved.clear()
            private_dir._made.clear()
            os.write(w, private_dir.resolve(mount).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and out == seg_dir
    assert len(os.listdir(mount)) == 1


@pytest.mark.parametrize("plant", ["dir", "symlink", "file"])
def test_a_squatted_name_gets_a_fresh_one(mount, monkeypatch, tmp_path, plant):
    """Whatever sits at the first name drawn (another user's directory, a
    symlink to a directory of ours, a file), a fresh random name is used and
    the squatter is left alone."""
    names = iter(["0" * 16, "1" * 16])
    monkeypatch.setattr(private_dir.secrets, "token_hex", lambda n: next(names))
    taken = os.path.join(mount, private_dir.PREFIX + "0" * 16)
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    if plant == "dir":
        os.mkdir(taken, 0o777)
    elif plant == "symlink":
        os.symlink(target, taken)
    else:
        open(taken, "w").close()
    seg_dir = private_dir.resolve(mount)
    assert seg_dir == os.path.join(mount, private_dir.PREFIX + "1" * 16, private_dir.INNER)
    assert os.listdir(target) == []
    assert os.path.lexists(taken)


@pytest.mark.parametrize("bad", ["not_private", "elsewhere", "symlink"])
def test_an_inherited_path_is_checked(mount, tmp_path, monkeypatch, bad):
    """A path in the environment that is not a private directory of ours in
    this mount is not used: a fresh one is made."""
    other = tmp_path / "other"
    (other / private_dir.INNER).mkdir(parents=True)
    if bad == "not_private":
        fake = os.path.join(mount, private_dir.PREFIX + "f" * 16)
        os.makedirs(os.path.join(fake, private_dir.INNER), 0o755)
        os.chmod(fake, 0o755)
    elif bad == "elsewhere":
        fake = str(other)
        other.chmod(0o700)
    else:
        fake = os.path.join(mount, private_dir.PREFIX + "e" * 16)
        other.chmod(0o700)
        os.symlink(other, fake)
    monkeypatch.setenv(private_dir.ENV, fake)
    seg_dir = private_dir.resolve(mount)
    assert not seg_dir.startswith(fake + os.sep) and os.path.dirname(seg_dir) != str(other)
    assert os.environ[private_dir.ENV] == os.path.dirname(seg_dir)


def test_a_private_mount_is_used_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(private_dir, "_resolved", {})
    d = tmp_path / "mine"
    d.mkdir(mode=0o700)
    assert private_dir.resolve(str(d)) == str(d)
    assert os.listdir(d) == []


def test_a_mount_others_may_rename_in_is_refused(tmp_path, monkeypatch):
    """World-writable and not sticky: another user could swap our directory."""
    monkeypatch.setattr(private_dir, "_resolved", {})
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(private_dir.UnsafeDirectory):
        private_dir.resolve(str(d))
    assert os.listdir(d) == []


def test_sweep_removes_only_dead_makers_directories(mount):
    live = os.path.dirname(private_dir.resolve(mount))
    dead = os.path.join(mount, private_dir.PREFIX + "d" * 16)
    os.makedirs(os.path.join(dead, private_dir.INNER), 0o700)
    os.chmod(dead, 0o700)
    ns = private_dir.pid_namespace()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with open(os.path.join(dead, private_dir.OWNER_FILE), "w") as f:
        f.write(f"{ns} {proc.pid} 1\n")  # a pid that just exited
    foreign = os.path.join(mount, private_dir.PREFIX + "a" * 16)
    os.mkdir(foreign, 0o755)  # not private: not ours to judge
    assert private_dir.sweep_dead(mount) == 1
    assert sorted(os.listdir(mount)) == sorted(os.path.basename(p) for p in (live, foreign))


@pytest.fixture
def shm_mount(monkeypatch):
    """A shared mount that uid 65534 can reach: a 1777 directory in ``/dev/shm``."""
    m = tempfile.mkdtemp(prefix="shm-embeds-test-mount-", dir="/dev/shm")
    os.chmod(m, 0o1777)
    monkeypatch.delenv(private_dir.ENV, raising=False)
    monkeypatch.setattr(private_dir, "_resolved", {})
    monkeypatch.setattr(private_dir, "_made", {})
    monkeypatch.setattr(private_dir, "_state", {"closed": False})
    yield m
    private_dir.remove_made()
    shutil.rmtree(m, ignore_errors=True)


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="needs root and a system python to run a check as uid 65534")
def test_another_user_can_neither_list_nor_plant_nor_learn_sizes(shm_mount):
    mount = shm_mount
    """As uid 65534: the segment directory cannot be listed, entered or
    written; the one name at the top says nothing of how many segments there
    are or how large they are (its size and times do not change with them)."""
    seg_dir = private_dir.resolve(mount)
    outer = os.path.dirname(seg_dir)
    before = os.stat(outer)
    with open(os.path.join(seg_dir, "vllm-shm-embeds.1.2.3.4"), "wb") as f:
        f.write(b"x" * (1 << 20))
    after = os.stat(outer)
    assert (before.st_size, before.st_mtime_ns, before.st_nlink) == \
           (after.st_size, after.st_mtime_ns, after.st_nlink)
    probe = r"""
import json, os, sys
outer, inner = sys.argv[1], sys.argv[2]
out = {"list_mount": "allowed" if os.listdir(os.path.dirname(outer)) else "empty"}
for what, f in [("list_outer", lambda: os.listdir(outer)),
                ("list_inner", lambda: os.listdir(inner)),
                ("stat_inner", lambda: os.stat(inner)),
                ("stat_file", lambda: os.stat(os.path.join(inner, "vllm-shm-embeds.1.2.3.4"))),
                ("plant", lambda: open(os.path.join(inner, "planted"), "w")),
                ("plant_outer", lambda: open(os.path.join(outer, "planted"), "w")),
                ("rename", lambda: os.rename(outer, outer + "x"))]:
    try:
        f()
        out[what] = "allowed"
    except PermissionError:
        out[what] = "denied"
    except OSError as e:
        out[what] = type(e).__name__
print(json.dumps(out))
"""
    res = subprocess.run([SYSTEM_PYTHON, "-I", "-c", probe, outer, seg_dir],
                         capture_output=True, text=True, user=65534, group=65534,
                         extra_groups=[], cwd="/", check=True)
    seen = json.loads(res.stdout)
    assert seen.pop("list_mount") == "allowed"  # the mount itself is reachable: a real check
    assert set(seen.values()) == {"denied"}, seen
    assert sorted(os.listdir(seg_dir)) == ["vllm-shm-embeds.1.2.3.4"]
