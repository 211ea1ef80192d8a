#!/bin/bash
# One at a time on the idle AVX512-BF16 EPYC (2 cores); see README.md.
cd /work/main
R=benchmarks/results/scale-2026-11-29-epyc
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a $R/runs.log; }
COMMON="--sim-prefill 250 --sim-decode 750 --sim-model base --profile cpu-base --poll-interval 0.5 --input-len 512 --output-len 64 --vocab-from base"
log "at $(git rev-parse --short HEAD)"
for run in a b; do
  log scale r1 rate20 $run
  # at 4703d46 the simulated decode pods kept no prefix cache unless asked;
  # since the flip (decode pods' prefix cache on by default) say so
  .venv/bin/python -m pdserve bench scale $COMMON --no-sim-decode-prefix-cache --routers 1 --request-rate 20 --num-prompts 1000 --idle-seconds 10 \
     --out $R/r1-rate20-$run.json > $R/r1-rate20-$run.txt 2>&1; log "rc=$?"
  log scale r1 rate20 decode-prefix-cache $run
  .venv/bin/python -m pdserve bench scale $COMMON --sim-decode-prefix-cache --routers 1 --request-rate 20 --num-prompts 1000 --idle-seconds 10 \
     --out $R/r1-rate20-dpc-$run.json > $R/r1-rate20-dpc-$run.txt 2>&1; log "rc=$?"
done
for run in a b; do
  .venv/bin/python -m pdserve bench decision --iterations 5000 > $R/decision-cache-aware-$run.txt 2>&1
  .venv/bin/python -m pdserve bench decision --iterations 5000 --decode-cached-blocks 128 > $R/decision-decode-cached-$run.txt 2>&1
done
log done
