"""OutputAssembler (router.flow.output): the client's output across pods, and
the direct relay's text-only path against the general one."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer
from router.flow.output import OutputAssembler, OutputGap
from router.generation import OutputLogprobs

# A byte-level vocabulary whose pieces split multi-byte characters: "é" is
# two tokens, "日" three, "😀" four.
PIECES = (b"a", b" b", b"\xc3", b"\xa9", b"\xe6", b"\x97", b"\xa5", b"\xf0", b"\x9f",
          b"\x98", b"\x80", b"\n")
WORDS = ((0,), (1,), (2, 3), (4, 5, 6), (7, 8, 9, 10), (11,))


class ByteTokenizer:
    def byte_pieces(self, skip_special_tokens: bool = True) -> tuple[bytes, ...]:
        return PIECES


def _assembler(stop=()) -> OutputAssembler:
    return OutputAssembler(detokenizer=IncrementalDetokenizer(ByteTokenizer()), stop=stop,
                           num_prompt_tokens=4)


def _random_batches(rng: random.Random) -> list[list[int]]:
    ids = [t for _ in range(40) for t in rng.choice(WORDS)]
    batches, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        batches.append(ids[i:i + n])
        i += n
    return batches


@pytest.mark.parametrize("seed", range(5))
def test_accept_text_gives_what_accept_gives(seed):
    batches = _random_batches(random.Random(seed))
    general, relayed = _assembler(), _assembler()
    texts = []
    for batch in batches:
        delta = general.accept(general.next_index, batch)
        assert relayed.plain
        texts.append((delta.text, relayed.accept_text(batch)))
    assert [a for a, _ in texts] == [b for _, b in texts]
    assert relayed.output_ids == general.output_ids == [t for b in batches for t in b]
    expected = b"".join(PIECES[t] for b in batches for t in b).decode()
    assert "".join(b for _, b in texts) + relayed.finish("length").text == expected


def test_plain_only_without_stops_and_once_prompt_logprobs_are_sent():
    assert not _assembler(stop=("x",)).plain
    out = _assembler()
    out.set_prompt_logprobs((OutputLogprobs(token_id=1, logprob=-0.5),))
    assert not out.plain
    first = out.accept(0, [0])
    assert first.prompt_logprobs is not None and out.plain


def test_repeats_are_dropped_and_a_gap_is_refused():
    out = _assembler()
    assert out.accept(0, [0, 1]).text == "a b"
    assert out.accept(1, [1, 0]).text == "a"  # index 1 again, then index 2
    assert out.accept(0, [0]) is None
    with pytest.raises(OutputGap, match="from index 5 but the next expected is 3"):
        out.accept(5, [0])
