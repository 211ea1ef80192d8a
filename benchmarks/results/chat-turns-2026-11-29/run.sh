#!/usr/bin/env bash
# Issue 42: multi-turn chats whose turns carry the server's real answers
# (`bench serve --turn-answers real`), through `pdserve up` at its defaults
# (1 prefill + 1 decode pod, a core each), with the decode pods' within-budget
# local rule on (the default) and off (--no-local-prefill-within-budget),
# alternating, ROUNDS rounds. Run from a clone of the commit the README
# names, on a quiet machine, one run at a time.
set -u
OUT=${OUT:-/work/main/benchmarks/results/chat-turns-2026-11-29}
PY=${PY:-/work/main/.venv/bin/python}
MODEL=${MODEL:-smollm2-135m-instruct}
ROUNDS=${ROUNDS:-2}
THINK=${THINK:-0}  # seconds between a turn's end and the next turn (bench serve --think-time)
TAG=$([ "$THINK" = 0 ] && echo "" || echo "-think$THINK")
TMP=/tmp/chat-turns
mkdir -p $TMP $OUT/json
run() {  # name, extra `pdserve up` flags...
  local name=$1; shift
  local ready=$TMP/$name.ready
  rm -f $ready
  local port grpc
  port=$($PY -c "from benchmarks.peer_servers import free_port; print(free_port())")
  grpc=$($PY -c "from benchmarks.peer_servers import free_port; print(free_port())")
  $PY -m pdserve up --model $MODEL --port $port --grpc-port $grpc --ready-file $ready "$@" \
      > $TMP/$name.up.log 2>&1 &
  local up=$!
  for _ in $(seq 600); do [ -s $ready ] && break; kill -0 $up || return; sleep 0.5; done
  echo "== $(date -u +%H:%M:%S) $name at $(git rev-parse --short HEAD)" >> $OUT/runs.log
  $PY -m pdserve bench serve --base-url http://127.0.0.1:$port --up-ready-file $ready \
      --num-prompts 8 --turns 6 --turn-answers real --input-len 48 --range-ratio 0.5 \
      --output-len 96 --concurrency 8 --seed 1 --think-time $THINK --label $name --no-progress \
      --out $OUT/json/$name.json > $OUT/$name.txt 2>&1
  echo "== $(date -u +%H:%M:%S) rc=$? $name done" >> $OUT/runs.log
  kill -INT $up; wait $up
}
VARIANTS=${VARIANTS:-on,off}  # on: the defaults; off: the within-budget rule off;
                             # answers: --warm-session-answers as well
for round in $(seq $ROUNDS); do
  for variant in ${VARIANTS//,/ }; do
    case $variant in
      on) run on$TAG-r$round ;;
      off) run off$TAG-r$round --router-arg=--no-local-prefill-within-budget ;;
      answers) run answers$TAG-r$round --router-arg=--warm-session-answers ;;
    esac
  done
done
