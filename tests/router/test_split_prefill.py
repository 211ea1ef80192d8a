"""The split-prefill rule (router/routing/split_prefill.py): by default
(auto) onto decode pods on CPU only; only contexts of at least M tokens
not cached at the prefill pod, onto a decode pod with no queue (a small
running batch is no bar: it gets a longer head; one over the cap is), the
head the prefill pod's cached prefix plus a share of the rest that leaves
the tail at least one token; bad settings name their limits."""

from __future__ import annotations

import pytest

from router.config import RouterConfig
from router.routing.split_prefill import AUTO_MIN_TOKENS, SplitPrefill, SplitSettings
from tests.router.test_local_prefill import DECODE_A, _load, _Pool


def _ids(count: int) -> list[int]:
    """A context of `count` tokens."""
    return list(range(count))


def _rule(min_tokens: int | None = 256, head_share: float = 0.55, busy_head_share: float = 0.7,
          max_running: int = 3, cached: dict[str, int] | None = None, **report) -> SplitPrefill:
    """The rule over one decode pod; `cached`: each prefill pod's cached
    prefix of every prompt (the prefix index's answer)."""
    pool = _Pool(_load(DECODE_A, "decode", **{"in_flight": 1, **report}))
    return SplitPrefill(pool, SplitSettings(min_tokens=min_tokens, head_share=head_share,
                                            busy_head_share=busy_head_share,
                                            max_running=max_running),
                        cached_prefix=lambda address, ids: (cached or {}).get(address, 0))


def test_an_idle_decode_pod_splits_a_long_context():
    assert _rule().split_at(DECODE_A, _ids(1000)) == 550
    assert _rule(head_share=0.5).split_at(DECODE_A, _ids(301)) == 150
    assert _rule(min_tokens=2, head_share=0.95).split_at(DECODE_A, _ids(2)) == 1  # a tail token


@pytest.mark.parametrize("report", [{"num_running": 1}, {"in_flight": 2}],
                         ids=["running", "another-request-of-this-router"])
def test_a_decoding_pod_takes_the_busy_share(report):
    assert _rule(**report).split_at(DECODE_A, _ids(1000)) == 700
    assert _rule(busy_head_share=0.8, **report).split_at(DECODE_A, _ids(301)) == 241


def test_a_decode_pod_with_a_queue_is_not_split_onto():
    assert _rule(num_waiting=1).split_at(DECODE_A, _ids(1000)) == 0


@pytest.mark.parametrize("count", ["num_running", "in_flight"])
def test_a_decode_pod_running_more_than_the_cap_is_not_split_onto(count):
    # in_flight counts the request being placed, num_running does not
    at_cap = {"num_running": 3} if count == "num_running" else {"in_flight": 4}
    over = {"num_running": 4} if count == "num_running" else {"in_flight": 5}
    assert _rule(**at_cap).split_at(DECODE_A, _ids(1000)) == 700
    assert _rule(**over).split_at(DECODE_A, _ids(1000)) == 0
    assert _rule(max_running=4, **over).split_at(DECODE_A, _ids(1000)) == 700
    assert _rule(max_running=0, num_running=1).split_at(DECODE_A, _ids(1000)) == 0
    assert _rule(max_running=0).split_at(DECODE_A, _ids(1000)) == 550  # only onto an idle pod


@pytest.mark.parametrize("device", ["cpu", "cuda", ""])
def test_auto_splits_onto_a_cpu_decode_pod_only(device):
    on_cpu = device == "cpu"
    assert _rule(None, device=device).split_at(DECODE_A, _ids(AUTO_MIN_TOKENS)) == (
        round(AUTO_MIN_TOKENS * 0.55) if on_cpu else 0)
    assert _rule(None, device=device).split_at(DECODE_A, _ids(AUTO_MIN_TOKENS - 1)) == 0
    # a number is the operator's choice, whatever the device
    assert _rule(128, device=device).split_at(DECODE_A, _ids(200)) == 110
    assert SplitSettings().min_tokens is None  # auto is the default
    assert RouterConfig(model_dir="m", prefill=["127.0.0.1:1"],
                        decode=["127.0.0.1:2"]).split_prefill.min_tokens is None


def test_off_short_or_unknown_is_not_split():
    assert _rule(min_tokens=0).split_at(DECODE_A, _ids(10_000)) == 0
    assert _rule().split_at(DECODE_A, _ids(255)) == 0
    assert _rule().split_at("127.0.0.1:9999", _ids(1000)) == 0


def test_the_prefill_pods_cached_prefix_belongs_to_the_head():
    """A next turn of 1,000 tokens whose first 800 the prefill pod holds: the
    split shares the 200 uncached ones (the head 800 + 0.55 x 200), so the
    history is not computed again on the decode pod (issue 42)."""
    rule = _rule(min_tokens=128, cached={"prefill-a": 800})
    assert rule.split_at(DECODE_A, _ids(1000), "prefill-a") == 800 + 110
    assert rule.split_at(DECODE_A, _ids(1000), "prefill-b") == 550  # nothing cached there
    assert rule.split_at(DECODE_A, _ids(1000)) == 550  # no prefill pod known yet
    # the minimum counts the uncached tokens: 1,000 - 800 < 256 is not split at all
    assert _rule(min_tokens=256, cached={"prefill-a": 800}).split_at(
        DECODE_A, _ids(1000), "prefill-a") == 0
    # a busy decode pod's share, of the uncached part
    busy = _rule(min_tokens=100, num_running=1, cached={"prefill-a": 800})
    assert busy.split_at(DECODE_A, _ids(1000), "prefill-a") == 800 + 140
    # the tail keeps at least one token; a prompt cached but for its last token
    # (or wholly, as an index may say) has nothing worth splitting
    assert _rule(min_tokens=1, cached={"prefill-a": 998}).split_at(
        DECODE_A, _ids(1000), "prefill-a") == 999
    assert _rule(min_tokens=1, cached={"prefill-a": 5000}).split_at(
        DECODE_A, _ids(1000), "prefill-a") == 0


def test_bad_settings_say_their_limits():
    with pytest.raises(ValueError, match=r"head share must be in \[0.05, 0.95\], got 1.0"):
        SplitSettings(min_tokens=1, head_share=1.0)
    with pytest.raises(ValueError, match=r"busy head share must be in \[0.05, 0.95\], got 0.0"):
        SplitSettings(min_tokens=1, busy_head_share=0.0)
    with pytest.raises(ValueError, match=r"min tokens must be in \[0, 1048576\], got -1"):
        SplitSettings(min_tokens=-1)
    with pytest.raises(ValueError, match=r"max running must be in \[0, 65536\], got -1"):
        SplitSettings(min_tokens=1, max_running=-1)
    with pytest.raises(ValueError, match="head share"):
        _config_from_flags("--split-prefill-min-tokens", "256",
                           "--split-prefill-head-share", "0.0")


def _config_from_flags(*flags: str) -> RouterConfig:
    import argparse

    from pdserve.commands.router import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(
        ["--model", "m", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", *flags]))
