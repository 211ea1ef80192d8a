#!/usr/bin/env bash
# issue 42's light load (256 in / 64 out, 48 requests, 8 in flight): pdserve up's
# pods sharing both cores (--pin off, the old default), pinned a core each
# (--pin auto's choice on 2 cores), and one colocated pod on both cores; two
# rounds over {base, smollm2} x {float32, bfloat16}, the topologies alternating.
set -u
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/defaults-2026-11-29
for round in 1 2; do
  for model in base smollm2-135m-instruct; do
    for dtype in float32 bfloat16; do
      name=light-$model-$dtype-r$round
      .venv/bin/pdserve bench disagg --model $model --workloads light-c8 --light-requests 48 \
        --topologies disaggregated-shared,disaggregated,colocated \
        --pod-arg=--dtype=$dtype --out-dir /tmp/defaults/$name --no-progress \
        > $OUT/$name.txt 2>&1
      cp /tmp/defaults/$name/comparison.json $OUT/$name-comparison.json 2>/dev/null
    done
  done
done
