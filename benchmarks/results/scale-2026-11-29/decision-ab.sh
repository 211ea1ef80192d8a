#!/bin/bash
# pdserve bench decision (cache-aware, 128 cached blocks per prefill pod): main (before holders) against lead (with it), alternating
R=/work/main/benchmarks/results/scale-2026-11-29
for round in 3 4 5 6; do
  for d in /work/main /work/wt; do
    echo "== $(date -u +%H:%M:%S) $(cd $d && git rev-parse --short HEAD) round $round" >> $R/decision-ab.log
    (cd $d && PYTHONPATH=$d .venv/bin/python -c "
import sys, importlib.util, argparse
spec = importlib.util.spec_from_file_location('decision_new', '/work/wt/benchmarks/decision.py')
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
p = argparse.ArgumentParser(); m.add_arguments(p)
m.main(p.parse_args(['--iterations', '2000']))" 2>&1 | grep -E "choose_prefill|choose_decode") >> $R/decision-ab.log
  done
done
