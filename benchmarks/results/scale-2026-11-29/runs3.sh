#!/bin/bash
cd /work/main
R=benchmarks/results/scale-2026-11-29
P=.venv/bin/python
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a $R/runs.log; }
COMMON="--sim-prefill 250 --sim-decode 750 --sim-model base --profile cpu-base --poll-interval 0.5 --input-len 512 --output-len 64 --vocab-from base"
log "at $(git rev-parse --short HEAD) (a poll round sends at most 256 polls)"
log scale routers=2 rate=20 prompts=1000
timeout 900 $P -m pdserve bench scale $COMMON --routers 2 --request-rate 20 --num-prompts 1000 --idle-seconds 10 \
   --out $R/r2-rate20-c.json > $R/r2-rate20-c.txt 2>&1
log "rc=$?"
