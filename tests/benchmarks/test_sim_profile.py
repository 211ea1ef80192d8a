"""`pdserve bench sim-profile` and `sim-check`'s pure parts: the fit recovers
known coefficients, holds a negative one at zero, counts plan rows as the
simulator does; the measured profile loads in the simulator; topologies
parse and the 15 % check compares p50s."""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

import pytest

from benchmarks import sim_check, sim_profile
from sim.perf_model import PerfModel, profile_from_dict


def _shapes() -> list[tuple[int, int, int]]:
    shapes = [(n, 0, 0) for n in (64, 256, 512, 1024)]
    shapes += [(0, b, b * c) for b in (1, 4, 8, 16) for c in (128, 512)]
    return shapes + [(128, 8, 8 * 300)]


def test_the_fit_recovers_known_coefficients_from_noisy_steps():
    truth = {"step_overhead_s": 0.02, "prefill_s_per_token": 0.0015,
             "decode_s_per_seq": 0.0012, "decode_s_per_context_token": 2.5e-6}
    rng = random.Random(7)
    samples = [(s, sim_profile.predicted(truth, s) * rng.uniform(0.99, 1.01))
               for s in _shapes() for _ in range(3)]
    fitted = sim_profile.fit(samples)
    for name, value in truth.items():
        assert fitted[name] == pytest.approx(value, rel=0.1), name


def test_a_coefficient_the_data_pushes_below_zero_is_held_at_zero():
    # steps that get faster with context: the unconstrained fit is negative there
    samples = [((0, b, b * c), 0.03 + 0.001 * b - 1e-6 * b * c)
               for b in (1, 4, 8) for c in (64, 512)]
    unconstrained = {"step_overhead_s": 0.03, "prefill_s_per_token": 0.0,
                     "decode_s_per_seq": 0.001, "decode_s_per_context_token": -1e-6}
    assert all(sim_profile.predicted(unconstrained, s) == pytest.approx(t) for s, t in samples)
    fitted = sim_profile.fit(samples)
    assert all(v >= 0 for v in fitted.values())
    assert fitted["decode_s_per_context_token"] == 0.0 or fitted["step_overhead_s"] == 0.0


def test_plan_rows_are_counted_as_the_simulator_counts_them():
    def row(new, start, end, context):
        return SimpleNamespace(num_new_tokens=new, start=start, end=end,
                               request=SimpleNamespace(num_context_tokens=context))

    plan = SimpleNamespace(scheduled=[row(100, 0, 100, 300), row(1, 300, 301, 300),
                                      row(1, 40, 41, 41)])
    # the last row is the prompt's last token (start < context): prompt work
    assert sim_profile.plan_features(plan) == (101, 1, 301)
    model = PerfModel("m", 0.01, 0.001, 0.002, 1e-5, 1e9, 0.0, 1 << 30)
    assert model.step_seconds(plan) == pytest.approx(
        sim_profile.predicted({"step_overhead_s": 0.01, "prefill_s_per_token": 0.001,
                               "decode_s_per_seq": 0.002,
                               "decode_s_per_context_token": 1e-5}, (101, 1, 301)))


def test_the_written_profile_loads_in_the_simulator():
    args = argparse.Namespace(link_from="cpu-base", kv_cache_bytes=1 << 29, name="measured-x")
    samples = [(s, sim_profile.predicted({"step_overhead_s": 0.02, "prefill_s_per_token": 0.001,
                                          "decode_s_per_seq": 0.001,
                                          "decode_s_per_context_token": 1e-6}, s))
               for s in _shapes()]
    what = {"model": "base", "layers": 8, "hidden": 1024, "dtype": "float32", "threads": 1}
    profile = sim_profile.build_profile(args, samples, what)
    model = profile_from_dict(profile)
    assert model.name == "measured-x" and model.kv_cache_bytes == 1 << 29
    assert model.link_bytes_per_s > 0
    assert len(profile["derivation"]["points"]) == len(set(_shapes()))


@pytest.mark.parametrize("name, prefill", [("1p1d", 1), ("2p1d", 2), ("4P1D", 4)])
def test_topologies_parse(name, prefill):
    assert sim_check._topology(name) == prefill


@pytest.mark.parametrize("name", ["1p2d", "0p1d", "pd", "2x1"])
def test_a_bad_topology_is_refused_naming_the_form(name):
    with pytest.raises(ValueError, match="NpMd"):
        sim_check._topology(name)


def test_the_check_compares_p50s_within_fifteen_percent():
    def result(ttft, itl):
        return {"ttft_ms": {"p50": ttft, "p90": ttft * 2}, "itl_ms": {"p50": itl, "p90": itl}}

    assert sim_check.compare(result(1000, 40), result(1140, 35))["within_15pct_at_p50"]
    off = sim_check.compare(result(1000, 40), result(1200, 40))
    assert not off["within_15pct_at_p50"]
    assert off["ttft_ms_p50"]["ratio"] == pytest.approx(1.2)
