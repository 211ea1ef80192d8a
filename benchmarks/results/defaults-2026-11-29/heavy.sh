#!/usr/bin/env bash
# issue 42's prefill-heavy targets with the pods pinned apart (bench disagg's
# own pinning, what --pin auto chooses on 2 cores): 384-1,152 in / 128 out,
# Poisson 0.2 and 0.4 req/s, 40 requests each, against one colocated pod.
set -u
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/defaults-2026-11-29
for round in ${ROUNDS:-1}; do
  .venv/bin/pdserve bench disagg --model base --workloads heavy-0.2,heavy-0.4 \
    --topologies disaggregated,colocated --out-dir /tmp/defaults/heavy-r$round \
    --no-progress > $OUT/heavy-r$round.txt 2>&1
  cp /tmp/defaults/heavy-r$round/comparison.json $OUT/heavy-r$round-comparison.json
done
