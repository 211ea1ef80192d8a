#!/bin/bash
cd /work/main
R=benchmarks/results/scale-2026-11-29
P=.venv/bin/python
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a $R/runs.log; }
COMMON="--sim-prefill 250 --sim-decode 750 --sim-model base --profile cpu-base --poll-interval 0.5 --input-len 512 --output-len 64 --vocab-from base"
log "at $(git rev-parse --short HEAD) (decode fast path fixed, decision CPU time)"
for spec in "1 20 1000 30 b" "1 10 600 10 b" "2 20 1000 10 b"; do
  set -- $spec
  log scale routers=$1 rate=$2 prompts=$3
  $P -m pdserve bench scale $COMMON --routers $1 --request-rate $2 --num-prompts $3 --idle-seconds $4 \
     --out $R/r$1-rate$2-$5.json > $R/r$1-rate$2-$5.txt 2>&1
  log "rc=$?"
done
log decision cache-aware
$P -m pdserve bench decision --iterations 5000 > $R/decision-cache-aware-b.txt 2>&1
log done
