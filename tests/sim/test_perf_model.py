"""`PerfModel`: the shipped profiles load, a bad profile is refused by
name, and a plan's step time and a transfer's time follow the formula."""

from __future__ import annotations

import json

import pytest

from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from sim.perf_model import PROFILES_DIR, load_profile, profile_from_dict

BASE = json.loads((PROFILES_DIR / "cpu-base.json").read_text())


@pytest.mark.parametrize("name", ["cpu-base", "h100-llama3-8b"])
def test_shipped_profiles_load_and_name_their_sources(name):
    profile = load_profile(name)
    assert profile.name == name and profile.sources


def test_unknown_missing_and_out_of_range_coefficients_are_refused():
    with pytest.raises(ValueError, match=r"unknown keys \['decode_s_per_sequence'\]"):
        profile_from_dict({**BASE, "decode_s_per_sequence": 1.0})
    with pytest.raises(ValueError, match=r"missing keys \['link_bytes_per_s'\]"):
        profile_from_dict({k: v for k, v in BASE.items() if k != "link_bytes_per_s"})
    with pytest.raises(ValueError, match="step_overhead_s must be a number of seconds"):
        profile_from_dict({**BASE, "step_overhead_s": -1})
    with pytest.raises(ValueError, match="not found: give a JSON file or one of: cpu-base"):
        load_profile("no-such-profile")


def test_step_time_counts_prompt_tokens_decode_rows_and_their_context():
    model = profile_from_dict({**BASE, "step_overhead_s": 0.01, "prefill_s_per_token": 0.001,
                               "decode_s_per_seq": 0.002, "decode_s_per_context_token": 1e-5})
    scheduler = Scheduler(BlockManager(64, 16, enable_prefix_caching=False), max_num_seqs=8,
                          max_num_batched_tokens=100)
    decoding = Request("a", list(range(30)), SamplingParams(max_tokens=4))
    scheduler.add(decoding)
    first = scheduler.schedule()  # 30 prompt tokens
    assert model.step_seconds(first) == pytest.approx(0.01 + 30 * 0.001)
    scheduler.update_computed(first)
    decoding.append_output_token(7)
    scheduler.add(Request("b", list(range(50)), SamplingParams(max_tokens=4)))
    mixed = scheduler.schedule()  # a's decode row at context 31, b's 50 prompt tokens
    assert model.step_seconds(mixed) == pytest.approx(0.01 + 50 * 0.001 + 0.002 + 31 * 1e-5)


def test_transfer_time_is_what_the_link_could_not_hide_behind_compute():
    model = profile_from_dict({**BASE, "link_bytes_per_s": 1e9, "link_latency_s": 0.001})
    # 100 ms on the wire, 30 ms of it overlapped with compute
    assert model.transfer_seconds(100_000_000, 10, 0.03) == pytest.approx(0.001 + 0.07)
    # compute hides all but the last of 10 layers
    assert model.transfer_seconds(100_000_000, 10, 5.0) == pytest.approx(0.001 + 0.01)
