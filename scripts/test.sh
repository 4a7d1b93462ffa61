#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The test command: set up (scripts/setup.sh) and run the test suite.
#
#   scripts/test.sh [pytest args]     # e.g. -m "not integration" for unit tests only
#
# Runs unit tests, the offline TP=2 integration tests (incl. 256 MiB of
# prompt_embeds on the wide model), topologies/lifetime and the online server
# tests. About 15 minutes on 2 cores after setup.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
bash scripts/setup.sh --wide
PY=${SHM_EMBEDS_VENV:-$ROOT/.venv}/bin/python
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-"0|1"}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec "$PY" -m pytest -q -p no:cacheprovider "$@" tests
