"""`pdserve sim` as a process: it writes its ready file once every pod
serves, registers every pod in Redis under the real keys, and on SIGTERM
drains them all, deletes their keys and exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import redis

from proto.registry import pod_key
from tests.integration.pods import REPO_ROOT

pytestmark = pytest.mark.timeout(120)


def test_sim_registers_its_pods_and_sigterm_drains_them(tiny_model_dir, redis_url, tmp_path):
    ready, log = tmp_path / "ready.json", tmp_path / "sim.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "sim", "--prefill", "2", "--decode", "3",
             "--model", str(tiny_model_dir), "--prefill-num-blocks", "64",
             "--decode-num-blocks", "16", "--redis-url", redis_url, "--ready-file", str(ready)],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        addresses = json.loads(ready.read_text())
        assert (len(addresses["prefill"]), len(addresses["decode"])) == (2, 3)
        keys = {pod_key(role, a) for role in ("prefill", "decode") for a in addresses[role]}
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        assert set(client.keys("pdserve:pods:*")) == keys
        record = json.loads(client.get(pod_key("decode", addresses["decode"][0])))
        assert (record["role"], record["model"]) == ("decode", "tiny")
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log.read_text()
        assert client.keys("pdserve:pods:*") == []
        client.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
