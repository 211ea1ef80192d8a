#!/usr/bin/env bash
# Issue 42: the decode pods' prefix cache off (`first-tokens`: bench routing
# pins --no-prefix-cache) against on (`first-tokens+miss-only`), same run, on
# the overlapping-chats trace (benchmarks/results/defaults-2026-11-29/chat-overlap.jsonl),
# 2 prefill + 2 decode pods (--pin auto shares the 2 cores), at the router's
# defaults (A) and with --local-prefill-below 128 (B: a next turn with fewer
# new tokens than that past the decode pod's cached prefix is computed there).
# Run from a clone of the commit (the README names it), one at a time.
set -u
OUT=${OUT:-/work/main/benchmarks/results/decode-prefix-2026-11-29}
TRACE=benchmarks/results/defaults-2026-11-29/chat-overlap.jsonl
PY=${PY:-/work/main/.venv/bin/python}
common=(--model base --prefill-counts 2 --decode 2 --policies first-tokens,first-tokens+miss-only
        --trace $TRACE --trace-start 0 --trace-requests 326 --trace-time-scale 1 --no-progress)
echo "== $(date -u +%H:%M:%S) A at $(git rev-parse --short HEAD)" >> $OUT/runs.log
$PY -m pdserve bench routing "${common[@]}" --out-dir /tmp/decode-prefix/A > $OUT/A-defaults.txt 2>&1
echo "== $(date -u +%H:%M:%S) rc=$? B" >> $OUT/runs.log
$PY -m pdserve bench routing "${common[@]}" --router-arg=--local-prefill-below=128 \
    --out-dir /tmp/decode-prefix/B > $OUT/B-local-below-128.txt 2>&1
echo "== $(date -u +%H:%M:%S) rc=$? done" >> $OUT/runs.log
