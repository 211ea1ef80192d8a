#!/bin/bash
PY=/work/main/.venv/bin/python
out=/work/main/benchmarks/results/native-attention-2026-11-28-avx512
mkdir -p $out
for round in 1 2; do
for tree in after head main; do
  dir=/tmp/$tree; [ $tree = main ] && dir=/work/main
  cd $dir
  PYTHONPATH=$dir $PY -m pdserve bench engine --model smollm2-135m-instruct --threads 2 \
    --batch-sizes 1,8 --prompt-len 1024 --max-tokens 32 --breakdown 8:512 > $out/engine-$tree-$round.txt 2>&1
done; done
echo done > $out/DONE
