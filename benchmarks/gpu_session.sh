#!/usr/bin/env bash
# One pass of every GPU check, sized for a short lease of a CUDA machine:
# the gpu-marked tests (compiled Triton), `pdserve bench engine` with CUDA
# graphs and without, `pdserve bench kernels`, `pdserve bench ttft` and
# `pdserve bench serve` against `pdserve up` (disaggregated, then colocated)
# on the same GPU. Each step has its own time limit and its log goes to
# $OUT_DIR (default ./gpu-out); a failing step does not stop the others.
#
#   bash benchmarks/gpu_session.sh            # from the repository root
#
# Needs python3 with torch (CUDA), triton and the project's dependencies;
# WHEELS=DIR installs wheels from DIR into /tmp/site first (a bare machine).
# STEPS (default "tests engine kernels ttft serve"; "disagg" is opt-in) picks steps; SERVE_LOADS
# the `bench serve` loads, each INPUT:OUTPUT:PROMPTS:CONCURRENCY; PYTEST_ARGS more
# pytest arguments for the GPU tests (e.g. "-n 8": pytest-xdist is on the device).
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-gpu-out}
mkdir -p "$OUT_DIR"
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}  # cpu: a dry run of the script itself
export PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

step() {  # step NAME SECONDS CMD...: run CMD with a limit, log to $OUT_DIR/NAME.log
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=5 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc $rc in $((SECONDS - start)) s"
  tail -n "${TAIL:-25}" "$OUT_DIR/$name.log"
  # TAR=FILE: everything so far in one archive after every step (kept if a later one hangs)
  [ -n "${TAR:-}" ] && tar czf "$TAR" -C "$OUT_DIR" .
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton, grpc, google.protobuf as p; print('torch', torch.__version__, \
'triton', triton.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__)"
} 2>&1 | tee "$OUT_DIR/machine.log"

BASE=$($PY -c "from engine.make_model import ensure_model; print(ensure_model('base'))")

has() { [[ " ${STEPS:-tests engine kernels ttft serve} " == *" $1 "* ]]; }

has tests && TAIL=40 step gpu-tests "${T_TESTS:-300}" env TRITON_INTERPRET=0 $PY -m pytest -q -m gpu \
  -p no:cacheprovider -o addopts= ${PYTEST_ARGS:-} tests/kernels/test_gpu.py tests/engine/test_cuda_graphs_gpu.py \
  tests/kv_transfer/test_device.py tests/engine/test_linear.py tests/kernels/test_dispatch.py \
  tests/router/test_split_prefill_gpu.py

# CUDA graphs against eager in bfloat16, then float32 with graphs
has engine && for run in bfloat16: bfloat16:--enforce-eager float32:; do
  dtype=${run%%:*} extra=${run#*:}
  step "engine-$dtype${extra:+-eager}" "${T_ENGINE:-45}" $PY -m pdserve bench engine \
    --model base --device "$DEVICE" --dtype "$dtype" --batch-sizes 1,8,32 --prompt-len 256 \
    --max-tokens 64 --breakdown 8:300 $extra
done

has kernels && TAIL=60 step kernels "${T_KERNELS:-75}" $PY -m pdserve bench kernels --batches 1 8 64 256 \
  --contexts 512 4096 32768 --block-sizes 16 128 256

has ttft && for transport in ${TTFT_TRANSPORTS:-tcp}; do
  step "ttft-$transport" "${T_TTFT:-60}" $PY -m pdserve bench ttft --device "$DEVICE" \
    --model base --prompt-lens 128,512,2048 --repeats 5 --kv-transport "$transport" \
    --json "$OUT_DIR/ttft-$transport.json"
done

serve() {  # serve LABEL UP-ARGS...: pdserve up on the GPU, then bench serve against it
  local label=$1; shift
  local ready="$OUT_DIR/up-$label.json"
  rm -f "$ready"
  $PY -m pdserve up --port 8100 --grpc-port 50150 --ready-file "$ready" \
    --model "$BASE" --pod-arg=--device="$DEVICE" --pod-arg=--dtype=bfloat16 "$@" > "$OUT_DIR/up-$label.log" 2>&1 &
  local up=$!
  for _ in $(seq 60); do [ -s "$ready" ] && break; sleep 0.5; done
  local load input output prompts concurrency
  for load in ${SERVE_LOADS:-256:64:64:16}; do
    IFS=: read -r input output prompts concurrency <<< "$load"
    step "serve-$label-${load//:/-}" "${T_SERVE:-35}" $PY -m pdserve bench serve \
      --base-url http://127.0.0.1:8100 --label "$label" --num-prompts "$prompts" \
      --concurrency "$concurrency" --input-len "$input" --output-len "$output" --warmup 2 \
      --no-progress --up-ready-file "$ready" --out "$OUT_DIR/serve-$label-${load//:/-}.json"
  done
  kill -INT $up; wait $up
}
if has serve; then
  serve disaggregated
  serve colocated --prefill 0 --decode 0 --colocated 1
fi

# Opt-in (STEPS=... disagg): issue 14's workloads with one host core per pod,
# then every file of Triton's cache by modification time. A kernel compiled
# while a workload ran carries a time inside that workload's run (its JSON's
# started_unix and duration_s): the first-wave stall of 2026-11-27 (docs/benchmarks.md, GPU).
if has disagg; then
  step disagg "${T_DISAGG:-240}" $PY -m pdserve bench disagg --model base \
    --workloads "${DISAGG_WORKLOADS:-heavy-0.2,heavy-0.4,light-c8}" \
    --topologies disaggregated,colocated --num-requests "${DISAGG_REQUESTS:-12}" \
    --pod-arg=--device="$DEVICE" --pod-arg=--dtype=bfloat16 --out-dir "$OUT_DIR/disagg" \
    --no-progress
  find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -type f -printf '%T@ %p\n' 2>/dev/null \
    | sort -n > "$OUT_DIR/triton-cache.log"
  [ -n "${TAR:-}" ] && tar czf "$TAR" -C "$OUT_DIR" .
fi
echo "=== done"
