#!/bin/bash
# router CPU per relayed token, session base (70d4c76) against HEAD, alternating
R=/work/main/benchmarks/results/scale-2026-11-29
for round in 1 2; do
  for d in /tmp/ab-base /work/main; do
    echo "== $(date -u +%H:%M:%S) $d round $round" >> $R/router-ab.log
    (cd $d && .venv/bin/python -m pdserve bench router --open-loop --front-door http --rate 1 --rounds 1 --duration 15 2>&1 | grep -E "router CPU per relayed|^\| router \||^\| direct \|") >> $R/router-ab.log
  done
done
echo "== $(date -u +%H:%M:%S) done" >> $R/router-ab.log
