"""`pdserve bench decision` runs the real policy over a real pool, and its
decode choice agrees with the full scan it is compared against (the
benchmark raises when they differ)."""

from __future__ import annotations

import argparse

from benchmarks import decision


def test_the_decision_benchmark_times_every_choice_and_agrees_with_its_baseline(capsys):
    parser = argparse.ArgumentParser()
    decision.add_arguments(parser)
    for policy in ("cache-aware", "first-tokens"):
        args = parser.parse_args(["--prefill", "5", "--decode", "40", "--iterations", "300",
                                  "--routing-policy", policy])
        assert decision.main(args) == 0
        out = capsys.readouterr().out
        for choice in ("choose_prefill", "choose_decode", "full scan (baseline)"):
            assert choice in out


def test_with_decode_pods_publishing_next_turns_go_where_their_prefix_is(capsys):
    parser = argparse.ArgumentParser()
    decision.add_arguments(parser)
    args = parser.parse_args(["--prefill", "5", "--decode", "40", "--iterations", "300",
                              "--decode-cached-blocks", "32", "--history", "10"])
    assert decision.main(args) == 0  # every choice equal to the full ranking's
    out = capsys.readouterr().out
    hits = int(out.split("conversations; ")[1].split()[0])
    # about half the prompts are next turns; the load bound turns some away
    assert 60 <= hits <= 300, out
