"""`pdserve bench engine` runs end to end on the tiny model: both tables, with
the decode-step breakdown beside the weight-read bound (figures are for
docs/benchmarks.md; here only that the parts add up and the bound is sane)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import engine as engine_bench
from benchmarks import engine_breakdown

pytestmark = pytest.mark.timeout(180)


def test_engine_benchmark_prints_throughput_and_breakdown(capsys, tiny_model_dir):
    parser = argparse.ArgumentParser()
    engine_bench.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir), "--batch-sizes", "1,2",
                              "--prompt-len", "8", "--max-tokens", "4", "--threads", "1",
                              "--breakdown", "2:24"])
    assert engine_bench.main(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    modes = [(row.split("|")[1].strip(), row.split("|")[2].strip()) for row in rows
             if row.split("|")[2].strip() in ("sequential", "batched")]
    assert modes == [("1", "sequential"), ("1", "batched"), ("2", "sequential"), ("2", "batched")]
    breakdown = rows[-1].split("|")
    assert breakdown[1].strip() == "2" and breakdown[2].strip() == "24"
    step = float(breakdown[3].split()[0])
    parts = [float(breakdown[i]) for i in (4, 5, 6)]
    assert step > 0 and all(p >= 0 for p in parts)
    assert sum(parts) == pytest.approx(step, abs=0.15)
    assert breakdown[10].strip().endswith("x")


def test_dense_weight_bytes_counts_every_linear_once(tiny_model_dir):
    from engine.loader import load_model

    model, config = load_model(tiny_model_dir, dtype="float32")
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    qkv = h * (config.q_size + 2 * config.kv_size) + (
        (config.q_size + 2 * config.kv_size) if config.attention_bias else 0)
    per_layer = qkv + config.q_size * h + 2 * inter * h + inter * h
    assert engine_breakdown.dense_weight_bytes(model) == 4 * (
        layers * per_layer + config.vocab_size * h)
    # bfloat16 counts 2 bytes a weight, also where prepacking widened it to float32
    from engine.layers.linear import Linear, MatmulBackend, prepack

    half, _ = load_model(tiny_model_dir, dtype="bfloat16")
    prepack(half, MatmulBackend.ONEDNN)
    assert any(m.prepacked for m in half.modules() if isinstance(m, Linear))
    assert engine_breakdown.dense_weight_bytes(half) == 2 * (
        layers * per_layer + config.vocab_size * h)


def test_a_cuda_row_has_no_split_and_sub_millisecond_steps_keep_their_digits():
    nan = float("nan")
    row = engine_breakdown.StepBreakdown(
        batch=8, context=300, step_ms=0.6, step_spread_ms=(0.52, 0.61), matmul_ms=nan,
        attention_ms=nan, other_ms=nan, weight_bytes=183_000_000, read_gb_s=3650.0)
    line = engine_breakdown.format_table([row]).splitlines()[-1]
    assert line == ("| 8 | 300 | 0.600 (0.520-0.610) | - | - | - | 183 | 3650.0 | 0.050 "
                    "| 11.97x |")


def test_the_header_says_whether_graphs_and_async_scheduling_are_on(capsys, tiny_model_dir):
    parser = argparse.ArgumentParser()
    engine_bench.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir), "--batch-sizes", "1",
                              "--prompt-len", "8", "--max-tokens", "2", "--threads", "1",
                              "--breakdown", "none", "--enforce-eager", "--async-scheduling"])
    assert engine_bench.main(args) == 0
    assert "cuda graphs off, async scheduling on" in capsys.readouterr().out


def test_decode_gemm_benchmark_prints_a_row_per_batch(capsys, tiny_model_dir):
    from benchmarks import decode_gemm
    from kernels import native

    if not native.gemm_available():
        pytest.skip("native GEMM unavailable (no compiler, or no AVX2 + FMA)")
    parser = argparse.ArgumentParser()
    decode_gemm.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir), "--rows", "1,3", "--repeats", "1",
                              "--threads", "1"])
    assert decode_gemm.main(args) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [r[1].strip() for r in rows] == ["1", "3"]
    assert all(float(r[2].split()[0]) > 0 and r[7].strip().endswith("x") for r in rows)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_gemm_benchmark_prints_a_row_per_row_count(capsys, tiny_model_dir, dtype):
    from benchmarks import prefill_gemm
    from kernels import native

    if not (native.gemm_available() if dtype == "float32" else native.gemm_bf16_available()):
        pytest.skip("native GEMM unavailable (no compiler, or no AVX2 + FMA)")
    parser = argparse.ArgumentParser()
    prefill_gemm.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir), "--rows", "16,40", "--rounds", "2",
                              "--threads", "1", "--by-shape", "--engine-prompt-len", "20",
                              "--dtype", dtype])
    assert prefill_gemm.main(args) == 0
    out = capsys.readouterr().out
    assert f"MB {dtype}" in out
    rows = [line.split("|") for line in out.splitlines()
            if line.startswith("| ") and line[2].isdigit() and "[" not in line]
    assert [r[1].strip() for r in rows] == ["16", "40"]
    assert all(float(r[2].split()[0]) > 0 and r[6].strip().endswith("x") for r in rows)
    assert "| 40, [" in out  # the per-shape rows
    # float32: the same token (rounding only); bfloat16's two paths round differently
    same = "True" if dtype == "float32" else ""
    assert f"prefill of a 20-token prompt, 1 token generated, 2 rounds (same greedy token: {same}" \
        in out
    assert "| native |" in out and "| oneDNN |" in out
