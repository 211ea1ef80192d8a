"""`pdserve bench multiturn-trace`: a Mooncake-format trace of multi-turn
chats whose turns overlap in time, for `pdserve bench routing --trace`.

The synthetic trace in ../shared/traces keeps each conversation's turns in
order but far apart; issue 42 asks routing to be measured also where a
conversation's next turn arrives while its previous turn may still be
computing (a user who sends a follow-up at once, an agent's next call):

    conversations  --conversations of them, starting as Poisson arrivals at
                   --conversation-rate per second; each opens with one of
                   --system-prompts shared system prompts
                   (--system-blocks blocks)
    turns          uniform in --turns (e.g. 3-8); turn k's prompt is turn
                   k-1's prompt, its answer and a new user message, so its
                   hash ids are turn k-1's full blocks followed by new ones
                   (the partial last block grows into a new id, as in the
                   Mooncake trace: benchmarks/routing_trace.py reads the
                   conversations back the same way)
    lengths        user messages --message-tokens, answers --output-tokens
                   (ranges), in the trace's 512-token blocks
    overlap        turn k arrives --turn-gap seconds (range) after turn k-1
                   arrived: gaps shorter than a turn's service time make
                   turns of one conversation overlap

Seeded (--seed): the same flags write the same file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HELP = ("Write a Mooncake-format trace of multi-turn chats whose turns overlap in time "
        "(for bench routing --trace).")
BLOCK = 512  # the Mooncake trace's block size, in tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="PATH", help="the JSONL file to write")
    parser.add_argument("--conversations", type=int, default=60)
    parser.add_argument("--conversation-rate", type=float, default=0.5, metavar="PER_S")
    parser.add_argument("--turns", default="3-8", metavar="MIN-MAX")
    parser.add_argument("--turn-gap", default="0.5-4", metavar="MIN-MAX",
                        help="seconds from a turn's arrival to the next turn's")
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-blocks", type=int, default=2)
    parser.add_argument("--message-tokens", default="100-1500", metavar="MIN-MAX")
    parser.add_argument("--output-tokens", default="64-512", metavar="MIN-MAX")
    parser.add_argument("--seed", type=int, default=0)


def _range(text: str, flag: str, kind: type = int) -> tuple:
    low, _, high = text.partition("-")
    try:
        pair = (kind(low), kind(high or low))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected MIN-MAX, e.g. 3-8") from None
    if not 0 <= pair[0] <= pair[1]:
        raise ValueError(f"{flag} {text!r}: needs 0 <= MIN <= MAX")
    return pair


def make_trace(conversations: int, rate: float, turns: tuple[int, int],
               gap_s: tuple[float, float], system_prompts: int, system_blocks: int,
               output_tokens: tuple[int, int], seed: int,
               message_tokens: tuple[int, int] = (100, 1500)) -> list[dict]:
    """The trace's lines in arrival order (module docstring)."""
    rng = random.Random(seed)
    next_id = 0

    def new_ids(count: int) -> list[int]:
        nonlocal next_id
        next_id += count
        return list(range(next_id - count, next_id))

    systems = [new_ids(system_blocks) for _ in range(system_prompts)]
    lines = []
    start_s = 0.0
    for _ in range(conversations):
        start_s += rng.expovariate(rate)
        at_s = start_s
        ids = list(rng.choice(systems))
        length = system_blocks * BLOCK
        answer = 0
        for _ in range(rng.randint(*turns)):
            grown = length + answer + rng.randint(*message_tokens)  # + the answer, a message
            full = length // BLOCK  # the previous prompt's full blocks stay the same ids
            ids = ids[:full] + new_ids(-(-grown // BLOCK) - full)
            length = grown
            answer = rng.randint(*output_tokens)
            lines.append({"timestamp": round(at_s * 1000), "input_length": length,
                          "output_length": answer, "hash_ids": ids})
            at_s += rng.uniform(*gap_s)
    return sorted(lines, key=lambda line: line["timestamp"])


def main(args: argparse.Namespace) -> int:
    try:
        if args.conversations < 1 or args.conversation_rate <= 0:
            raise ValueError("--conversations must be >= 1 and --conversation-rate > 0")
        if args.system_prompts < 1 or args.system_blocks < 0:
            raise ValueError("--system-prompts must be >= 1 and --system-blocks >= 0")
        lines = make_trace(args.conversations, args.conversation_rate,
                           _range(args.turns, "--turns"),
                           _range(args.turn_gap, "--turn-gap", float),
                           args.system_prompts, args.system_blocks,
                           _range(args.output_tokens, "--output-tokens"), args.seed,
                           _range(args.message_tokens, "--message-tokens"))
    except ValueError as exc:
        print(f"pdserve bench multiturn-trace: error: {exc}", file=sys.stderr)
        return 2
    Path(args.out).write_text("".join(json.dumps(line) + "\n" for line in lines))
    span = lines[-1]["timestamp"] / 1000
    print(f"{len(lines)} requests in {args.conversations} conversations over {span:.0f} s "
          f"-> {args.out}")
    return 0
