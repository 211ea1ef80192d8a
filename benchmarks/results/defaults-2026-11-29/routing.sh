#!/usr/bin/env bash
# issue 42's routing default: first-tokens (today's) against cache-aware, 4
# prefill pods + 1 decode pod (5 pods on 2 cores: --pin auto shares them), on
# the synthetic trace's last 100 lines (time x 5, as the earlier routing runs)
# and on chat-overlap.jsonl (60 chats whose turns overlap, written by
#   pdserve bench multiturn-trace --out chat-overlap.jsonl --conversations 60 \
#       --conversation-rate 0.5 --turn-gap 0.2-2)
# VARIANT (the files' prefix):
#   split       the split prefill at its default (auto), its head a share of
#               the whole context: the tree before 1c16b47 (files routing-*)
#   cachedhead  the same after 1c16b47: the head keeps the prefill pod's
#               cached prefix whole (files routing-cachedhead-*)
#   nosplit     --split-prefill-min-tokens 0 (files routing-nosplit-*)
set -u
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/defaults-2026-11-29
VARIANT=${VARIANT:-cachedhead}
case $VARIANT in
  split) prefix=routing; extra=() ;;
  cachedhead) prefix=routing-cachedhead; extra=() ;;
  nosplit) prefix=routing-nosplit; extra=(--router-arg=--split-prefill-min-tokens=0) ;;
  *) echo "VARIANT: split, cachedhead or nosplit" >&2; exit 2 ;;
esac
for round in ${ROUNDS:-1}; do
  .venv/bin/pdserve bench routing --model base --prefill-counts 4 \
    --policies first-tokens,cache-aware --trace-start 3893 --trace-requests 100 \
    --trace-time-scale 5 "${extra[@]}" --out-dir /tmp/defaults/$prefix-synthetic-r$round \
    --no-progress > $OUT/$prefix-synthetic-r$round.txt 2>&1
  .venv/bin/pdserve bench routing --model base --prefill-counts 4 \
    --policies first-tokens,cache-aware --trace $OUT/chat-overlap.jsonl --trace-start 0 \
    --trace-requests 326 --trace-time-scale 1 "${extra[@]}" \
    --out-dir /tmp/defaults/$prefix-chat-r$round --no-progress > $OUT/$prefix-chat-r$round.txt 2>&1
done
