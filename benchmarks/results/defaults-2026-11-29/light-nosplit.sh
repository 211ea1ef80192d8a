#!/usr/bin/env bash
# Pinned pods with the decode pod's own prompt work off: the split prefill
# (--split-prefill-min-tokens 0) and, in a second run, the idle side too
# (--local-prefill-max-tokens 0), against the pinned defaults and colocated.
set -u
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/defaults-2026-11-29
for round in ${ROUNDS:-1}; do
  for model in base smollm2-135m-instruct; do
    for dtype in float32 bfloat16; do
      for variant in nosplit noprompts; do
        extra=(--router-arg=--split-prefill-min-tokens=0)
        [ $variant = noprompts ] && extra+=(--router-arg=--local-prefill-max-tokens=0)
        name=light-$variant-$model-$dtype-r$round
        .venv/bin/pdserve bench disagg --model $model --workloads light-c8 --light-requests 48 \
          --topologies disaggregated,colocated "${extra[@]}" \
          --pod-arg=--dtype=$dtype --out-dir /tmp/defaults/$name \
          --no-progress > $OUT/$name.txt 2>&1
        cp /tmp/defaults/$name/comparison.json $OUT/$name-comparison.json 2>/dev/null
      done
    done
  done
done
