#!/bin/bash
PY=/work/main/.venv/bin/python
for spec in after:3 before:3 after:4 before:4; do
  side=${spec%:*}; round=${spec#*:}
  dir=/tmp/$side
  cd $dir
  PYTHONPATH=$dir $PY -m pdserve bench disagg --model base --workloads light-c8 --topologies disaggregated --out-dir /tmp/b37/disagg-$side-$round > /tmp/b37/disagg-$side-$round.txt 2>&1
done
echo done > /tmp/b37/DONE2
