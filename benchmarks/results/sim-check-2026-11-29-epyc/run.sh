#!/usr/bin/env bash
# Issue 43: the simulator against real pods on the AVX512-BF16 EPYC: a
# profile measured here (the engine on one pinned core), then sim-check with
# it, and with the Cascade Lake profile for comparison. From a clone.
set -u
OUT=${OUT:-/work/main/benchmarks/results/sim-check-2026-11-29-epyc}
PY=${PY:-/work/main/.venv/bin/python}
echo "== $(date -u +%H:%M:%S) profile at $(git rev-parse --short HEAD)" >> $OUT/runs.log
taskset -c 1 $PY -m pdserve bench sim-profile --model base --out $OUT/cpu-base-measured-epyc.json \
    > $OUT/profile.txt 2>&1
echo "== $(date -u +%H:%M:%S) rc=$? check" >> $OUT/runs.log
$PY -m pdserve bench sim-check --model base --profile $OUT/cpu-base-measured-epyc.json \
    --out-dir /tmp/sim-check-epyc > $OUT/check.txt 2>&1
echo "== $(date -u +%H:%M:%S) rc=$? done" >> $OUT/runs.log
