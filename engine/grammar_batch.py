"""`GrammarBatch`: the grammar state of the engine's structured-output
requests, and `TokenMask`, the one mask a step's sampler applies.

Owned by `LLMEngine`, called on the engine loop thread only:

    add_request / reserve_remote -> start(request)   matcher copied from the
                                                     compiled grammar, advanced
                                                     over output_token_ids (a
                                                     migration's tokens so far)
    step start       -> tokens_in_flight()          (async scheduling)
    step launch      -> mask(sampling_requests)     one bitmask for the step's
                                                     grammar rows (llguidance
                                                     fills the rows in parallel,
                                                     in Rust, GIL released)
    token appended   -> accept(request, token)      (commit_remote's first token too)
    stop check       -> finished(request)           the grammar can take no more
    finish / abort   -> drop(request_id)

Requests without a grammar are not in the batch; with none in it every
method returns at once, so an engine that serves no grammar pays one
`len()` per step.

A mask row allows the tokens the grammar can take next, and the eos ids
only where the grammar accepts the text so far; once the grammar is
finished only eos is allowed, and the engine stops the request anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import torch

from engine.grammar import GrammarCompiler
from engine.host_copy import to_device
from engine.request import Request

# Bit b of an int32 word (bit 31 is the sign bit).
_BITS = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32)


@dataclass(frozen=True, slots=True)
class TokenMask:
    """Allowed tokens for some rows of a step's logits: `bitmask[i]` (32
    tokens per int32, bit t % 32 of word t // 32) applies to logits row
    `rows[i]`; the other rows are not constrained. Built on the engine
    thread, applied where the sampler runs."""

    rows: tuple[int, ...]
    bitmask: torch.Tensor  # [len(rows), ceil(V / 32)] int32, on the host

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [n, V] with the disallowed tokens of the masked rows set
        to -inf: a new tensor (the model's logits are inference tensors),
        one masked_fill over those rows."""
        vocab = logits.shape[1]
        disallowed = ~unpack_bitmask(to_device(self.bitmask, logits.device), vocab)
        if len(self.rows) == logits.shape[0]:  # every row is masked (rows are 0..n-1)
            return logits.masked_fill(disallowed, float("-inf"))
        rows = to_device(torch.tensor(self.rows), logits.device)
        return logits.index_put((rows,), logits[rows].masked_fill(disallowed, float("-inf")))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[k, W] int32 bitmask -> [k, vocab_size] bool (True = allowed)."""
    bits = (bitmask.unsqueeze(-1) & _bits_on(bitmask.device)) != 0
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size]


@functools.cache
def _bits_on(device: torch.device) -> torch.Tensor:
    """`_BITS` on `device`, copied once (a plain copy to CUDA would wait for the stream)."""
    return _BITS.to(device)


class GrammarBatch:
    """Matchers of the engine's requests that follow a grammar, by request id."""

    def __init__(self, compiler: GrammarCompiler, vocab_size: int) -> None:
        self.compiler = compiler
        self._vocab_size = vocab_size
        self._states: dict[str, tuple[Request, llguidance.LLMatcher]] = {}
        self._executor: llguidance.LLExecutor | None = None  # threads, made on first use

    def __len__(self) -> int:
        return len(self._states)

    def start(self, request: Request) -> None:
        """Give `request` (whose params have a grammar) its matcher, advanced
        over its output tokens so far; ValueError if they break the grammar."""
        spec = request.sampling_params.grammar
        assert spec is not None
        matcher = self.compiler.matcher(spec)
        outputs = request.output_token_ids
        if outputs and not matcher.consume_tokens(outputs):
            raise ValueError(f"output_token_ids do not follow the request's {spec.kind.value} "
                             f"grammar: {_first_line(matcher.get_error())}")
        self._states[request.request_id] = (request, matcher)

    def check_next(self, request_id: str, token_id: int) -> None:
        """ValueError unless the grammar of `request_id` (if any) allows `token_id` next."""
        matcher = self._matcher(request_id)
        if matcher is not None and matcher.validate_tokens([token_id]) != 1:
            raise ValueError(f"token {token_id} does not follow request {request_id!r}'s grammar")

    def accept(self, request_id: str, token_id: int) -> None:
        """Advance the request's matcher over a token it sampled (the mask
        allowed it, so this cannot fail unless the engine has a bug)."""
        matcher = self._matcher(request_id)
        if matcher is not None and not matcher.consume_token(token_id):
            raise RuntimeError(f"request {request_id!r}: sampled token {token_id} outside its "
                               f"grammar: {_first_line(matcher.get_error())}")

    def finished(self, request_id: str) -> bool:
        """Whether the request's grammar is complete and can take no more tokens."""
        matcher = self._matcher(request_id)
        return matcher is not None and matcher.is_stopped()

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _matcher(self, request_id: str) -> llguidance.LLMatcher | None:
        state = self._states.get(request_id)
        return None if state is None else state[1]

    def tokens_in_flight(self) -> bool:
        """Whether a step in flight (async scheduling) samples a token of a
        grammar request: the request's next mask needs that token, so the
        engine completes the step before it schedules the next."""
        return any(r.num_output_placeholders for r, _ in self._states.values())

    def mask(self, requests: Sequence[Request]) -> TokenMask | None:
        """The step's mask for the rows of `requests` (a step's sampling rows,
        in order) that follow a grammar; None when none does."""
        if not self._states:
            return None
        rows = tuple(i for i, r in enumerate(requests) if r.request_id in self._states)
        if not rows:
            return None
        words = -(-self._vocab_size // 32)
        bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        matchers = [(self._states[requests[r].request_id][1], i) for i, r in enumerate(rows)]
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, len(rows))
        return TokenMask(rows, bitmask)


def _first_line(error: str) -> str:
    return error.strip().split("\n", 1)[0]
