"""What `pdserve bench routing` reads off a Mooncake trace besides its requests.

    oracle         the share of prompt tokens whose block (a hash id at its
                   position) was seen earlier in the replayed lines: the hit
                   ratio of one unbounded prefix cache shared by all pods
                   (0.651 over the whole synthetic trace, its README says).
                   Computed on the scaled prompts: block i of a prompt of L
                   tokens counts min(B, L - i*B) tokens, B the scaled block size
    reachable      the same cache as the engine can use it: a prefill pod
                   caches the full blocks of the prompts it computed, and a
                   prompt reuses its leading cached blocks but never the one
                   holding its last token (proto/block_hash.py,
                   `reusable_blocks`); the best any routing can do with
                   unbounded caches, below the oracle by the partial blocks
    conversations  the trace has no session ids; a line whose hash ids start
                   with every full block of an earlier line (all its ids but
                   the last, which is partial and grows in the next turn)
                   continues that line's conversation, else starts one. The
                   session-sticky run sends these as session ids (`user`);
                   the other policies get none (they key on prompts or
                   nothing), so each is measured on what it routes by
"""

from __future__ import annotations

import dataclasses

from benchmarks.serve_trace import TraceRequest, TraceScaling
from benchmarks.serve_workload import Session


def oracle_hit_ratio(requests: list[TraceRequest], scaling: TraceScaling) -> float:
    """Prompt tokens in blocks seen earlier / prompt tokens, over `requests` in order."""
    block = scaling.scaled_block_size
    seen: set[int] = set()
    hits = total = 0
    for request in requests:
        length = scaling.input_length(request)
        total += length
        if not request.hash_ids:
            continue
        for i, hash_id in enumerate(request.hash_ids):
            tokens = min(block, length - i * block)
            if tokens <= 0:
                break
            if hash_id in seen:
                hits += tokens
        seen.update(request.hash_ids)
    return hits / total if total else 0.0


def reachable_hit_ratio(requests: list[TraceRequest], scaling: TraceScaling) -> float:
    """Prompt tokens an unbounded shared prefix cache could serve as the
    engine uses it (module docstring) / prompt tokens."""
    block = scaling.scaled_block_size
    cached: set[int] = set()
    hits = total = 0
    for request in requests:
        length = scaling.input_length(request)
        total += length
        full = request.hash_ids[:length // block]
        for hash_id in full[:max(0, length - 1) // block]:
            if hash_id not in cached:
                break
            hits += block
        cached.update(full)
    return hits / total if total else 0.0


def conversation_ids(requests: list[TraceRequest]) -> list[str]:
    """One conversation id per line (module docstring)."""
    owner: dict[tuple[int, ...], str] = {}  # a line's full blocks -> its conversation
    ids = []
    for index, request in enumerate(requests):
        hash_ids = request.hash_ids
        conversation = f"conversation-{index}"
        for k in range(len(hash_ids) - 1, 0, -1):
            found = owner.get(hash_ids[:k])
            if found is not None:
                conversation = found
                break
        ids.append(conversation)
        if len(hash_ids) > 1:
            owner.setdefault(hash_ids[:-1], conversation)
    return ids


def with_sessions(sessions: list[Session], ids: list[str]) -> list[Session]:
    """`sessions` (one single-turn session per trace line, as
    `trace_sessions` makes them) with each line's turn carrying its id."""
    if len(sessions) != len(ids):
        raise ValueError(f"{len(ids)} conversation ids for {len(sessions)} sessions")
    return [dataclasses.replace(s, turns=tuple(dataclasses.replace(t, session_id=conversation)
                                               for t in s.turns))
            for s, conversation in zip(sessions, ids, strict=True)]
