"""`pdserve bench soak` for ~15 s against a live stack it starts (tiny model,
one prefill and two decode pods, a router): the report's fields, and the
properties the soak exists for — no request lost, hung or answered
differently from its first answer, every KV block free at the end, one
decode pod killed and back."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import soak

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    return parser.parse_args(argv)


def test_bad_max_tokens_is_refused():
    assert soak.main(_args(["--max-tokens", "9,3"])) == 2


def test_error_texts_group_with_ids_masked_and_count_against_the_target():
    ledger = soak.Ledger()
    for rid in ("0123456789abcdef0123", "fedcba98765432100000"):
        ledger.error("error:503", f"no decode pod can serve request {rid}")
    ledger.error("error:stream:APIError", "decode pod lost")
    assert ledger.error_messages["error:503: no decode pod can serve request <id>"]["count"] == 2
    assert ledger.outcomes == {"error:503": 2, "error:stream:APIError": 1}
    report = soak._report(ledger, 0, 1.0, 0.0, None, {}, {}, {}, {})
    assert report["target_met"] is False
    assert list(report["error_messages"])[0].startswith("error:503")


def test_the_flat_window_judges_the_tail_and_leaves_out_a_pod_restarted_in_it():
    samples = [{"t_s": 30.0 * i, "router": 70.0 + (5.0 if i < 3 else 0.0), "prefill": 300.0 + i,
                "decode0": 0.0 if i == 2 else 700.0} for i in range(1, 9)]
    flat = soak._flat_window(samples, 120.0, {"pod": "decode0", "at_s": 125.0})
    assert {name: r["from_s"] for name, r in flat.items()} == dict.fromkeys(flat, 120.0)
    assert flat["router"]["growth"] == 0.0  # the climb before the window does not count
    assert flat["prefill"]["growth"] == round(308 / 304 - 1, 4)
    assert flat["decode0"]["growth"] is None
    assert soak._flat_window(samples, 120.0, {"pod": "decode0", "at_s": 60.0})["decode0"][
        "growth"] == 0.0


def test_a_short_soak_loses_nothing(tiny_model_dir, tmp_path):
    out = tmp_path / "soak.json"
    status = soak.main(_args([
        "--model", str(tiny_model_dir), "--minutes", "0.25", "--warm-up", "4",
        "--concurrency", "3", "--max-tokens", "4,24", "--cancel-fraction", "0.3",
        "--restart-at", "0.4", "--pod-arg=--num-blocks=256", "--pod-arg=--block-size=16",
        "--rss-interval", "5", "--json-out", str(out), "--keep-logs", str(tmp_path / "logs")]))
    report = json.loads(out.read_text())
    assert status == (0 if report["target_met"] else 1)
    requests = report["requests"]
    assert set(requests) == {"total", "served", "cancelled", "lost", "lost_why", "hung",
                             "mismatch", "errors"}
    assert requests["served"] > 10 and requests["cancelled"] > 0
    assert (requests["lost"], requests["hung"], requests["mismatch"]) == (0, 0, 0), report
    assert requests["total"] == (requests["served"] + requests["cancelled"]
                                 + sum(requests["errors"].values()))
    messages = report["error_messages"]
    assert sum(m["count"] for m in messages.values()) == sum(requests["errors"].values())
    assert {p.name for p in (tmp_path / "logs").iterdir()} >= {"router.log", "prefill.log"}
    assert set(report["latency_ms"]) == {"ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99"}
    assert 0 < report["latency_ms"]["e2e_p50"] <= report["latency_ms"]["e2e_p99"]
    assert set(report["rss"]) == {"prefill", "decode0", "decode1", "router"}
    assert all(r["start_mib"] > 0 and r["end_mib"] > 0 for r in report["rss"].values())
    assert report["rss"]["decode0"]["growth"] is None  # restarted: not comparable
    assert set(report["rss_flat"]) == set(report["rss"])
    timeline = report["rss_timeline"]
    assert len(timeline) >= 2 and timeline[0]["t_s"] < timeline[-1]["t_s"]
    assert all(sample["prefill"] > 0 and sample["router"] > 0 for sample in timeline)
    assert report["restart"]["pod"] == "decode0" and report["restart"]["signal"] == "kill"
    assert report["restart"]["back_after_s"] > 0
    for name, blocks in report["kv_blocks"].items():
        assert blocks["free_start"] == blocks["free_end"] == blocks["total"] == 256, name
