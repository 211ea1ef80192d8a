#!/usr/bin/env bash
# The design change tried after light.sh: the two pods share both cores and
# the prefill pod runs at niceness N (--prefill-arg=--nice=N), so a decode
# step's threads take the cores back whenever they run; against the pinned
# pods and one colocated pod in the same run. Round "idle" (ROUNDS=idle) ran
# with an uncommitted change that also set SCHED_IDLE on the prefill pod's
# threads in pin_process; it did not help and was not kept (README.md).
set -u
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/defaults-2026-11-29
NICE=${NICE:-19}
for round in ${ROUNDS:-1}; do
  for model in base smollm2-135m-instruct; do
    for dtype in float32 bfloat16; do
      name=light-nice$NICE-$model-$dtype-r$round
      .venv/bin/pdserve bench disagg --model $model --workloads light-c8 --light-requests 48 \
        --topologies disaggregated-shared,disaggregated,colocated \
        --prefill-arg=--nice=$NICE --pod-arg=--dtype=$dtype --out-dir /tmp/defaults/$name \
        --no-progress > $OUT/$name.txt 2>&1
      cp /tmp/defaults/$name/comparison.json $OUT/$name-comparison.json 2>/dev/null
    done
  done
done
