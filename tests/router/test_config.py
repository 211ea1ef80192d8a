"""RouterConfig's checks of the relay, worker and HTTP limit settings, and the flags."""

from __future__ import annotations

import pytest

from router.config import RouterConfig


def test_workers_and_relay_defaults() -> None:
    config = RouterConfig(model_dir="m")
    assert (config.workers, config.relay, config.metrics_dir) == (1, "session", None)
    assert (config.http_header_timeout, config.http_keepalive_timeout,
            config.max_concurrent_per_client) == (30.0, 75.0, 0)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("workers", 0, "workers must be in [1, 256], got 0"),
    ("workers", 257, "workers must be in [1, 256], got 257"),
    ("relay", "tokens", "relay must be one of session, stream, got 'tokens'"),
    ("http_header_timeout", 0.0, "http_header_timeout must be in (0, 3600] seconds, got 0.0"),
    ("http_keepalive_timeout", 4000.0,
     "http_keepalive_timeout must be in (0, 3600] seconds, got 4000.0"),
    ("max_concurrent_per_client", -1,
     "max_concurrent_per_client must be in [0, 1048576] (0 = off), got -1"),
])
def test_bad_values_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError) as err:
        RouterConfig(model_dir="m", **{field: value})
    assert str(err.value) == message


def test_router_flags_reach_the_config() -> None:
    import argparse

    from pdserve.commands.router import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args([
        "--model", "m", "--colocated", "127.0.0.1:1", "--http-header-timeout", "5",
        "--http-keepalive-timeout", "20", "--max-concurrent-per-client", "8",
        "--tool-call-parser", "hermes"]))
    assert (config.http_header_timeout, config.http_keepalive_timeout,
            config.max_concurrent_per_client) == (5.0, 20.0, 8)
    assert config.tool_call_parser == "hermes"
    idle = config_from_args(parser.parse_args([
        "--model", "m", "--colocated", "127.0.0.1:1", "--local-prefill-min-wait", "5",
        "--local-prefill-max-tokens", "0"]))
    assert (idle.local_prefill.min_wait, idle.local_prefill.max_tokens) == (5.0, 0)
    assert (config.local_prefill.min_wait, config.local_prefill.max_tokens) == (2.0, 2048)


def test_split_prefill_flags_reach_the_config(capsys) -> None:
    import argparse

    from pdserve.commands.router import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--model", "m", "--colocated", "127.0.0.1:1"]
    auto = config_from_args(parser.parse_args(base))
    assert (auto.split_prefill.min_tokens, auto.split_prefill.max_running) == (None, 3)
    assert config_from_args(parser.parse_args(
        [*base, "--split-prefill-min-tokens", "auto"])).split_prefill.min_tokens is None
    set_ = config_from_args(parser.parse_args(
        [*base, "--split-prefill-min-tokens", "0", "--split-prefill-max-running", "8"]))
    assert (set_.split_prefill.min_tokens, set_.split_prefill.max_running) == (0, 8)
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--split-prefill-min-tokens", "always"])
    assert "expected a token count or 'auto', got 'always'" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-migrations", "17"], "max_migrations must be in [0, 16], got 17"),
    (["--max-prefill-retries", "-1"], "max_prefill_retries must be in [0, 16], got -1"),
    (["--request-timeout", "0"], "request_timeout must be in (0, 86400] seconds, got 0.0"),
    (["--max-queue-wait", "0"], "max queue wait must be in (0, 86400] seconds, got 0.0"),
    (["--prefill-dispatch-tokens", "-1"], "prefill dispatch tokens must be in [0, 16777216], "
                                          "got -1"),
])
def test_each_group_is_checked_once_with_one_range(flags: list[str], message: str) -> None:
    """The flow and admission groups' flags, checked by their groups (router/settings.py)."""
    import argparse

    from pdserve.commands.router import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError) as err:
        config_from_args(parser.parse_args(["--model", "m", *flags]))
    assert str(err.value) == message
