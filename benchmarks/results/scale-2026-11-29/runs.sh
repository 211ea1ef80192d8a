#!/bin/bash
# Quiet-machine benchmark runs of 2026-11-29 (issue 43 decision + replicas + rate; issue 39 per-token).
cd /work/main
R=benchmarks/results/scale-2026-11-29
P=.venv/bin/python
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a $R/runs.log; }
log decision cache-aware
$P -m pdserve bench decision --iterations 5000 > $R/decision-cache-aware.txt 2>&1
log decision first-tokens
$P -m pdserve bench decision --iterations 5000 --routing-policy first-tokens > $R/decision-first-tokens.txt 2>&1
log router per-token
$P -m pdserve bench router --open-loop --front-door http --rate 1 --rounds 2 --duration 15 > $R/router-per-token.txt 2>&1
COMMON="--sim-prefill 250 --sim-decode 750 --sim-model base --profile cpu-base --poll-interval 0.5 --input-len 512 --output-len 64 --vocab-from base"
for spec in "1 20 1000 30" "2 40 1000 15" "4 80 1000 15" "1 5 300 10" "1 40 1000 10" "1 80 1000 10"; do
  set -- $spec
  log scale routers=$1 rate=$2 prompts=$3
  $P -m pdserve bench scale $COMMON --routers $1 --request-rate $2 --num-prompts $3 --idle-seconds $4 \
     --out $R/r$1-rate$2.json > $R/r$1-rate$2.txt 2>&1
  log "rc=$?"
done
log done
