#!/bin/bash
# One served round of the peer workload on `pdserve up` (colocated, the peer's
# pod flags) from the clone REPO: a 16-request warm-up, then 48 requests twice.
# usage: DTYPE=bfloat16 ab.sh REPO LABEL     (alternate two clones, A B A B)
repo=$1; label=$2
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python}
cd "$repo"
$py -m pdserve up --prefill 0 --decode 0 --colocated 1 --model smollm2-135m-instruct \
    --host 127.0.0.1 --port 28111 --grpc-port 28112 --pod-arg=--dtype=${DTYPE:-float32} \
    --pod-arg=--kv-cache-memory=2GiB --pod-arg=--max-num-seqs=64 \
    --pod-arg=--max-model-len=2048 > /tmp/ab-$label.log 2>&1 &
up=$!
for _ in $(seq 90); do curl -sf http://127.0.0.1:28111/v1/models > /dev/null && break; sleep 1; done
$py "$here/load.py" http://127.0.0.1:28111 16 > /dev/null
for _ in 1 2; do echo -n "$label "; $py "$here/load.py" http://127.0.0.1:28111 48; done
kill -INT $up; wait $up
