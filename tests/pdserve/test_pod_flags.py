"""pdserve/commands/_pod_flags.py: the pods' engine flags become EngineConfig,
and the CLI is the one place that reads PDSERVE_KERNEL_BACKEND."""

from __future__ import annotations

import argparse

import pytest

from pdserve.commands import _pod_flags


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _pod_flags.add_engine_arguments(parser, block_size=16, prefix_cache_default=True)
    return parser.parse_args(["--model", "/m", "--device", "cpu", "--dtype", "float32", *argv])


def test_defaults_on_cpu(monkeypatch):
    monkeypatch.delenv("PDSERVE_KERNEL_BACKEND", raising=False)
    config = _pod_flags.engine_config_from_args(_parse([]))
    assert config.max_num_batched_tokens == _pod_flags.STEP_TOKENS == 2048
    assert config.scheduling_policy == "decode-first"
    assert config.kernel_backend == "auto" and config.matmul_backend == "auto"
    assert config.enforce_eager is False
    assert config.async_scheduling is None and not config.use_async_scheduling


def test_flags_override_and_the_environment_sets_the_kernel_default(monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "torch")
    config = _pod_flags.engine_config_from_args(_parse([]))
    assert config.kernel_backend == "torch"
    config = _pod_flags.engine_config_from_args(_parse([
        "--kernel-backend", "triton", "--matmul-backend", "torch",
        "--scheduling-policy", "fcfs", "--max-num-batched-tokens", "64", "--enforce-eager"]))
    assert (config.kernel_backend, config.matmul_backend, config.scheduling_policy,
            config.max_num_batched_tokens, config.enforce_eager) == (
        "triton", "torch", "fcfs", 64, True)


def test_a_bad_value_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        _parse(["--matmul-backend", "mkl"])
    assert "invalid choice: 'mkl'" in capsys.readouterr().err


def test_async_scheduling_flag_and_its_device_default():
    on = _pod_flags.engine_config_from_args(_parse(["--async-scheduling"]))
    off = _pod_flags.engine_config_from_args(_parse(["--no-async-scheduling"]))
    assert (on.async_scheduling, off.async_scheduling) == (True, False)
    assert on.use_async_scheduling and not off.use_async_scheduling
    cuda = _pod_flags.engine_config_from_args(_parse(["--device", "cuda"]))
    assert cuda.async_scheduling is None and cuda.use_async_scheduling


def test_mixed_prefill_tokens_default_is_per_role():
    from pdserve.commands import decode, prefill, serve

    def parsed(module, argv=()):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        args = parser.parse_args(["--model", "/m", "--device", "cpu", "--dtype", "float32",
                                  *argv])
        return _pod_flags.engine_config_from_args(args)

    assert parsed(decode).mixed_prefill_tokens == decode.DECODE_MIXED_PREFILL_TOKENS["cpu"] == 64
    cuda = parsed(decode, ["--device", "cuda", "--dtype", "bfloat16"])
    assert cuda.mixed_prefill_tokens == decode.DECODE_MIXED_PREFILL_TOKENS["cuda"] == 128
    assert parsed(decode, ["--mixed-prefill-tokens", "0"]).mixed_prefill_tokens == 0
    assert parsed(prefill).mixed_prefill_tokens == 0
    assert parsed(serve).mixed_prefill_tokens == 0
    assert parsed(serve, ["--mixed-prefill-tokens", "64"]).mixed_prefill_tokens == 64
    # a smaller step budget than the decode default is fine: the cap is then moot
    small = parsed(decode, ["--max-num-batched-tokens", "32"])
    assert (small.max_num_batched_tokens, small.mixed_prefill_tokens) == (32, 64)


def test_tensor_parallel_size_flag_reaches_the_engine_of_every_role():
    from decode_service.config import DecodeConfig
    from pod.config import ServerConfig
    from prefill_service.config import PrefillConfig

    assert _pod_flags.engine_config_from_args(_parse([])).tensor_parallel_size == 1
    engine = _pod_flags.engine_config_from_args(_parse(["--tensor-parallel-size", "2"]))
    assert engine.tensor_parallel_size == 2
    # prefill and decode pods run at any size: every rank moves its own KV heads
    for make in (PrefillConfig, DecodeConfig):
        assert make(engine=engine, server=ServerConfig()).engine.tensor_parallel_size == 2


def test_the_prefix_wait_timeout_reaches_the_scheduler_and_is_bounded():
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler

    assert _pod_flags.engine_config_from_args(_parse([])).prefix_wait_s == 5.0
    config = _pod_flags.engine_config_from_args(_parse(["--prefix-wait-timeout", "0.25"]))
    scheduler = Scheduler.from_config(BlockManager(8, 16, enable_prefix_caching=True), config, None)
    assert scheduler.prefix_wait.max_wait_s == 0.25
    off = _pod_flags.engine_config_from_args(_parse(["--prefix-wait-timeout", "0"]))
    blocks = BlockManager(8, 16, enable_prefix_caching=True)
    assert Scheduler.from_config(blocks, off, None).prefix_wait.max_wait_s == 0
    with pytest.raises(ValueError, match=r"prefix_wait_s must be in \[0, 600\] seconds"):
        _pod_flags.engine_config_from_args(_parse(["--prefix-wait-timeout", "601"]))
