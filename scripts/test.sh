#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The test command: set up (scripts/setup.sh), lint (ruff) and run the test suite.
#
#   scripts/test.sh                   # the whole suite
#   scripts/test.sh [pytest args]     # e.g. -m "not integration" for unit tests only
#
# Runs the unit tests and the integration tests on the few vLLM engines the
# suite shares (tests/conftest.py: offline TP=2 runs incl. 256 MiB of
# prompt_embeds on the wide model, and four OpenAI servers), two at a time.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
bash scripts/setup.sh --wide
VENV=${SHM_EMBEDS_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
# Lint first (pyproject.toml [tool.ruff]; ruff comes with the test extra): a
# finding fails the run before any test starts.
"$VENV/bin/ruff" check .
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-"0|1"}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
if [ $# -gt 0 ]; then  # your selection, as given
  exec "$PY" -m pytest -q -p no:cacheprovider "$@" tests
fi
# The whole suite in one run on both cores (pytest-xdist): each shared engine's
# tests form one group that a single worker runs (tests/conftest.py), the
# groups in conftest.ORDER (longest first; pytest-xdist would otherwise order
# them by their number of tests), then the unit tests on both workers.
exec "$PY" -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --no-loadscope-reorder tests
