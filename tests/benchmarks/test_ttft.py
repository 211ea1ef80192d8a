"""`pdserve bench ttft` runs end to end against real pods on loopback, pinned
where asked (its figures are for docs/benchmarks.md; here only that every
mode is timed and the table and JSON are complete)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from benchmarks import ttft

pytestmark = pytest.mark.timeout(240)


def test_ttft_benchmark_times_both_modes_with_pinned_pods(tiny_model_dir, tmp_path, capsys):
    cpus = sorted(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser()
    ttft.add_arguments(parser)
    out = tmp_path / "ttft.json"
    args = parser.parse_args(["--model", str(tiny_model_dir), "--prompt-lens", "16,48",
                              "--repeats", "2", "--kv-cache-memory", "64MiB",
                              "--prefill-cpus", str(cpus[0]), "--decode-cpus", str(cpus[-1]),
                              "--json", str(out)])
    assert ttft.main(args) == 0
    printed = capsys.readouterr().out
    assert f"prefill cpus={cpus[0]} decode cpus={cpus[-1]}" in printed
    rows = json.loads(out.read_text())
    assert [row["prompt_len"] for row in rows] == [16, 48]
    for row in rows:
        assert 0 < row["prefill_only_min_ms"] <= row["prefill_only_ms"]
        assert 0 < row["disaggregated_min_ms"] <= row["disaggregated_ms"]
        assert row["kv_bytes"] > 0
    assert rows[1]["kv_bytes"] == 3 * rows[0]["kv_bytes"]  # the whole prompt's KV, per token
