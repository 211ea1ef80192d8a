"""`pdserve bench prefill-split` runs end to end on the tiny model: one row
per prompt length, the head rounded down to whole blocks, the tail timed
over the head found in the prefix cache (the benchmark checks the hits),
and an estimate no shorter than the longer part."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import prefill_split

pytestmark = pytest.mark.timeout(180)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    prefill_split.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_split_estimate_is_printed_for_each_prompt(capsys, tiny_model_dir):
    args = _args("--model", str(tiny_model_dir), "--prompt-lens", "40,96", "--split", "0.6",
                 "--repeats", "1", "--threads", "1")
    assert prefill_split.main(args) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "(head" in line]
    assert [row[0].strip() for row in rows] == ["40 (head 16)", "96 (head 48)"]
    for row in rows:
        base, whole, head, tail, estimate = (float(cell) for cell in row[1:6])
        assert min(base, whole, head, tail) >= 0
        assert estimate >= max(head, tail)
        assert row[6].strip().endswith("x") and row[7].strip().endswith("x")


@pytest.mark.parametrize("argv", [["--split", "1"], ["--prompt-lens", "16"], ["--repeats", "0"]])
def test_bad_arguments_say_what_is_wrong(argv, tiny_model_dir):
    with pytest.raises(SystemExit, match="--split must be in"):
        prefill_split.main(_args("--model", str(tiny_model_dir), *argv))
