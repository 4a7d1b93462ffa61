# SPDX-License-Identifier: Apache-2.0
"""The private segment directory at the exit of an offline ``vllm.LLM`` script.

Seen with TP=2 and 128-256 MiB of prompt_embeds: a script that just returns
left a ``vllm-shm-embeds-*`` directory in ``/dev/shm``. At exit, process 0
removed its directory (atexit) before vLLM's ``weakref.finalize`` of the
engine client stopped the EngineCore (weakref.finalize's own atexit hook ran
later); the EngineCore, told to stop, found the directory gone and made one
of its own, then was SIGKILLed by vLLM (5 s after its SIGTERM, spent waiting
for its workers) before its exit removed it.

Both halves are reproduced here without an engine, in a few seconds: a
process that inherited the directory never makes another one once it is
gone, and the maker removes it only after the finalizers made after the
plugin loaded (vLLM's, which stop the engine) have run.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from vllm._shm_embeds import private_dir




@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_an_inherited_directory_is_not_made_again_once_gone(mount, monkeypatch, start):
    """The EngineCore or a worker whose directory its maker removed (the server
    is exiting) makes no new one: it may be killed before its exit would
    remove it. This process stands for one, after process 0 made the directory."""
    seg_dir = private_dir.resolve(mount)  # process 0 makes it
    outer = os.path.dirname(seg_dir)
    if start == "spawn":  # a new interpreter: the path comes in the environment
        monkeypatch.setattr(private_dir, "_made", {})
        monkeypatch.setattr(private_dir, "_resolved", {})
    else:  # forked: process 0's tables, another pid
        monkeypatch.setattr(private_dir, "_made", {outer: os.getpid() + 1})
    assert private_dir.resolve(mount) == seg_dir
    shutil.rmtree(outer)  # process 0's exit removed it
    assert private_dir.resolve(mount) == seg_dir
    assert os.listdir(mount) == []


# Process 0 of an offline LLM script, down to what its exit does: the plugin
# loads (and makes the private directory) after something made a
# weakref.finalize (torch, vLLM: so finalize's atexit hook runs after the
# plugin's), then vLLM starts an EngineCore, which inherits the directory,
# and keeps a weakref.finalize on its engine client that stops the EngineCore
# at exit: SIGTERM, then SIGKILL after a timeout (vLLM: 5 s). The EngineCore
# here, on SIGTERM, records whether the directory is still there, sweeps
# (what its exit does first; it resolves the directory) and then exits
# slowly, as one waiting for its workers does, so that it is SIGKILLed.
_PROCESS_0 = textwrap.dedent("""
    import os, signal, sys, time, weakref

    class Anything:
        pass

    weakref.finalize(Anything(), print)  # finalize's atexit hook: before the plugin's
    from vllm._shm_embeds import config
    from vllm._shm_embeds.lifetime import process

    seg_dir = config.shm_dir()  # process 0 makes the private directory
    ready_r, ready_w = os.pipe()
    engine_core = os.fork()
    if engine_core == 0:
        def on_sigterm(*_):
            with open(sys.argv[1], "w") as f:
                f.write("present" if os.path.isdir(seg_dir) else "gone")
            process.sweep_stale_segments(expected=True)  # resolves the directory
            time.sleep(60)  # a slow exit (waiting for its workers): killed before it ends

        signal.signal(signal.SIGTERM, on_sigterm)
        os.write(ready_w, b"r")
        time.sleep(60)
        os._exit(1)
    os.read(ready_r, 1)

    def stop(pid):  # vLLM's finalizer of its engine client (SIGKILL after 5 s there)
        os.kill(pid, signal.SIGTERM)
        time.sleep(1)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    class EngineClient:
        pass

    client = EngineClient()
    weakref.finalize(client, stop, engine_core)
    # The script ends here, without shutting the engine down, as a user's may.
""")


def test_the_maker_removes_it_after_the_engine_is_stopped(tmp_path):
    """Nothing of ours is left after an offline script that just exits, and the
    EngineCore still had the directory when it was told to stop."""
    mount = tmp_path / "shm"
    mount.mkdir()
    mount.chmod(0o1777)
    seen = tmp_path / "seen-at-sigterm"
    script = tmp_path / "process0.py"
    script.write_text(_PROCESS_0)
    env = {k: v for k, v in os.environ.items() if k != private_dir.ENV}
    env.update({"VLLM_SHM_EMBEDS": "1", "VLLM_SHM_EMBEDS_DIR": str(mount)})
    env.pop("VLLM_SHM_EMBEDS_STATS_DIR", None)
    run = subprocess.run([sys.executable, str(script), str(seen)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert os.listdir(mount) == [], (os.listdir(mount), run.stderr[-3000:])
    assert seen.read_text() == "present"
