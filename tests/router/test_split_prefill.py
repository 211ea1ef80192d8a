"""The split-prefill rule (router/routing/split_prefill.py): off by default,
only contexts of at least M tokens, onto a decode pod with no queue (a
running batch is no bar: it gets a longer head), the head a share of the
context that leaves the tail at least one token; bad settings name their
limits."""

from __future__ import annotations

import pytest

from router.config import RouterConfig
from router.routing.split_prefill import SplitPrefill, SplitSettings
from tests.router.test_local_prefill import DECODE_A, _load, _Pool


def _rule(min_tokens: int = 256, head_share: float = 0.55, busy_head_share: float = 0.7,
          **report) -> SplitPrefill:
    pool = _Pool(_load(DECODE_A, "decode", **{"in_flight": 1, **report}))
    return SplitPrefill(pool, SplitSettings(min_tokens=min_tokens, head_share=head_share,
                                            busy_head_share=busy_head_share))


def test_an_idle_decode_pod_splits_a_long_context():
    assert _rule().split_at(DECODE_A, 1000) == 550
    assert _rule(head_share=0.5).split_at(DECODE_A, 301) == 150
    assert _rule(min_tokens=2, head_share=0.95).split_at(DECODE_A, 2) == 1  # a tail token


@pytest.mark.parametrize("report", [{"num_running": 1}, {"in_flight": 2}],
                         ids=["running", "another-request-of-this-router"])
def test_a_decoding_pod_takes_the_busy_share(report):
    assert _rule(**report).split_at(DECODE_A, 1000) == 700
    assert _rule(busy_head_share=0.8, **report).split_at(DECODE_A, 301) == 241


def test_a_decode_pod_with_a_queue_is_not_split_onto():
    assert _rule(num_waiting=1).split_at(DECODE_A, 1000) == 0


def test_off_short_or_unknown_is_not_split():
    assert _rule(min_tokens=0).split_at(DECODE_A, 10_000) == 0
    assert _rule().split_at(DECODE_A, 255) == 0
    assert _rule().split_at("127.0.0.1:9999", 1000) == 0


def test_bad_settings_say_their_limits():
    with pytest.raises(ValueError, match=r"head share must be in \[0.05, 0.95\], got 1.0"):
        SplitSettings(min_tokens=1, head_share=1.0)
    with pytest.raises(ValueError, match=r"busy head share must be in \[0.05, 0.95\], got 0.0"):
        SplitSettings(min_tokens=1, busy_head_share=0.0)
    with pytest.raises(ValueError, match=r"min tokens must be in \[0, 1048576\], got -1"):
        SplitSettings(min_tokens=-1)
    with pytest.raises(ValueError, match="head share"):
        RouterConfig(model_dir="m", prefill=["127.0.0.1:1"], decode=["127.0.0.1:2"],
                     split_prefill_min_tokens=256, split_prefill_head_share=0.0)
