#!/bin/bash
# alternating before/after: router http open loop, then disagg light-c8
PY=/work/main/.venv/bin/python
for round in 1 2; do
for side in before after; do
  dir=/tmp/before; [ $side = after ] && dir=/work/main
  cd $dir
  PYTHONPATH=$dir $PY -m pdserve bench router --open-loop --front-door http --rate 1 --rounds 2 --duration 15 > /tmp/b37/router-$side-$round.txt 2>&1
done; done
for round in 1 2; do
for side in before after; do
  dir=/tmp/before; [ $side = after ] && dir=/work/main
  cd $dir
  PYTHONPATH=$dir $PY -m pdserve bench disagg --model base --workloads light-c8 --out-dir /tmp/b37/disagg-$side-$round > /tmp/b37/disagg-$side-$round.txt 2>&1
done; done
echo done > /tmp/b37/DONE
