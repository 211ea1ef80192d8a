"""`Sampler`: next tokens for a batch of logits rows, vectorized over the batch.

Called by `LLMEngine.step()` on the engine loop thread with one float32
logits row per sequence that samples this step.

Per row: greedy (argmax) when temperature == 0; otherwise logits /
temperature, then top-k, then top-p (nucleus) filtering, then a draw by the
exponential race: `argmax(probs / E)` with `E ~ Exp(1)` per vocab entry,
which picks token t with probability probs[t]. Only the noise E is random,
so a row's token depends on its logits and its noise alone, never on the
batch around it.

Noise source (docs/architecture.md "Sampling determinism"): a seeded
request's noise for output index i comes from a CPU `torch.Generator`
seeded with `xxhash64(seed, i)`, so the same request samples the same
tokens alone, in any batch, after preemption, and on whichever pod samples
index i. Unseeded rows share the engine's generator (seeded by
`EngineConfig.seed`).

Logprobs are of the raw distribution: log_softmax of the unmodified logits,
as (x - max) - log(sum exp(x - max)) from one reduction per row
(`kernels.dispatch.logit_stats`), with no log-softmax rows materialised.

Penalties, logit bias and min_tokens (engine/logits_processors.py) adjust
the logits first when the step has a `LogitsAdjustments`; without one (no
row asks for any) the path is exactly the unadjusted one.

`sample` leaves everything on the logits' device and reads nothing back
(async scheduling launches step N+1 with step N's token tensor before the
host has seen it); `SampledTensors.output()` is the host read.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from engine.grammar_batch import TokenMask
from engine.host_copy import to_device
from engine.logits_processors import LogitsAdjustments
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from kernels import dispatch as kernel_ops


def seed_for_index(seed: int, output_index: int) -> int:
    """The generator seed of output token `output_index` of a seeded request."""
    return xxhash.xxh64_intdigest(struct.pack("<QQ", seed, output_index))


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...]  # None for rows that did not ask


@dataclass(frozen=True, slots=True)
class SampledTensors:
    """A step's sampled tokens and the logprobs rows asked for, as tensors
    (on CUDA possibly still being computed). `logprob_rows[i]` is the row of
    `chosen[i]`, `top_values[i]`, `top_ids[i]`."""

    token_ids: torch.Tensor  # [n] int64
    logprob_rows: tuple[int, ...]
    chosen: torch.Tensor | None  # [len(logprob_rows)] float32
    top_values: torch.Tensor | None  # [len(logprob_rows), max n]
    top_ids: torch.Tensor | None

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> SampledTensors:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return SampledTensors(move(self.token_ids), self.logprob_rows, move(self.chosen),
                              move(self.top_values), move(self.top_ids))

    def output(self, params: Sequence[SamplingParams]) -> SamplerOutput:
        """Read the tensors on the host (a device sync when they are not there)."""
        tokens = tuple(self.token_ids.tolist())
        out: list[TokenLogprobs | None] = [None] * len(tokens)
        if self.logprob_rows:
            chosen = self.chosen.tolist()
            for i, r in enumerate(self.logprob_rows):
                n = params[r].logprobs
                ids = tuple(self.top_ids[i, :n].tolist()) if n else ()
                values = tuple(self.top_values[i, :n].tolist()) if n else ()
                out[r] = TokenLogprobs(tokens[r], chosen[i], ids, values)
        return SamplerOutput(tokens, tuple(out))


class Sampler:
    """Stateless apart from the engine generator used by unseeded rows."""

    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 output_indices: Sequence[int]) -> SamplerOutput:
        """logits [n, V] float32; `params[r]` and `output_indices[r]` (the
        index of the token being sampled among the request's outputs) per row."""
        return self.sample(logits, params, output_indices).output(params)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               output_indices: Sequence[int], *, token_mask: TokenMask | None = None,
               adjustments: LogitsAdjustments | None = None,
               previous_tokens: torch.Tensor | None = None) -> SampledTensors:
        """Like `__call__`, but the result stays on the logits' device: no
        host sync (the unseeded and seeded noise is drawn on the CPU and
        copied over, in row order, so the generators are used as before).
        `token_mask` (grammar rows, engine/grammar_batch.py) sets disallowed
        tokens to -inf first: what is sampled and the logprobs see the mask.
        `adjustments` (with the previous step's `previous_tokens` when it
        has pending rows) then changes the logits the tokens are drawn from,
        not the logprobs reported."""
        if logits.dim() != 2 or not logits.shape[0] == len(params) == len(output_indices):
            raise ValueError(
                f"logits {tuple(logits.shape)} must be [n, V] with n == "
                f"{len(params)} params == {len(output_indices)} indices"
            )
        logits = logits.float()
        if token_mask is not None:
            logits = token_mask.apply(logits)
        drawn_from = logits if adjustments is None else adjustments.apply(logits, previous_tokens)
        # One pass gives the greedy tokens and, when the logprobs are of the
        # same logits, what they need too.
        same = drawn_from is logits
        stats = kernel_ops.logit_stats(
            drawn_from, logsum=same and any(p.logprobs is not None for p in params))
        token_ids = stats[0]
        if not all(p.greedy for p in params):
            greedy = to_device(torch.tensor([p.greedy for p in params]), logits.device)
            sampled = self._sample(drawn_from, params, output_indices)
            token_ids = torch.where(greedy, token_ids, sampled)
        return _with_logprobs(logits, params, token_ids, stats if same else None)

    def _sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                output_indices: Sequence[int]) -> torch.Tensor:
        device = logits.device
        temperature = to_device(torch.tensor([p.temperature if p.temperature > 0 else 1.0
                                              for p in params]), device)
        scaled = logits / temperature[:, None]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            scaled = _filter_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = to_device(self._exponential_noise(probs.shape, params, output_indices), device)
        return (probs / noise).argmax(dim=-1)

    def _exponential_noise(self, shape: torch.Size, params: Sequence[SamplingParams],
                           output_indices: Sequence[int]) -> torch.Tensor:
        noise = torch.empty(shape, dtype=torch.float32)
        unseeded = [r for r, p in enumerate(params) if p.seed is None]
        if unseeded:
            rows = torch.empty((len(unseeded), shape[1]), dtype=torch.float32)
            noise[unseeded] = rows.exponential_(generator=self._generator)
        # One small generator per seeded row: a loop over rows, never over the vocab.
        for r, p in enumerate(params):
            if p.seed is not None:
                gen = torch.Generator(device="cpu")
                gen.manual_seed(seed_for_index(p.seed, output_indices[r]))
                noise[r].exponential_(generator=gen)
        # An exact 0 draw would turn a filtered token's 0 / 0 into NaN, which
        # argmax would pick; the smallest normal float keeps 0-probability tokens at 0.
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: list[int],
                        top_p: list[float]) -> torch.Tensor:
    """Sets filtered-out logits to -inf. top_k 0 and top_p 1.0 mean off."""
    vocab = scaled.shape[1]
    device = scaled.device
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    k = to_device(torch.tensor([t if 0 < t < vocab else vocab for t in top_k]), device)
    ranks = torch.arange(vocab, device=device)[None, :]
    remove = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Mass strictly before each token; the most likely token is always kept.
    mass_before = probs.cumsum(dim=-1) - probs
    p = to_device(torch.tensor(top_p), device)
    remove |= mass_before >= p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, sorted_ids, sorted_logits)


def _with_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
                   token_ids: torch.Tensor,
                   stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None
                   ) -> SampledTensors:
    """The logprobs rows asked for, from `kernel_ops.logit_stats` of `logits`
    (`stats`, when the caller has them): log-softmax x_j is (x_j - max) -
    logsum, so the chosen token's needs one element of its row, the best
    one's is -logsum at the argmax, and only n > 1 reads a row again (topk
    of the raw logits: the same order)."""
    wanted = tuple(r for r, p in enumerate(params) if p.logprobs is not None)
    if not wanted:
        return SampledTensors(token_ids, (), None, None, None)
    if stats is None or stats[2] is None:
        stats = kernel_ops.logit_stats(logits, logsum=True)
    argmax, top, logsum = stats
    every_row = len(wanted) == len(params)
    rows = None if every_row else to_device(torch.tensor(wanted), logits.device)

    def of_rows(t: torch.Tensor) -> torch.Tensor:
        return t if rows is None else t[rows]

    top, logsum, chosen_ids = of_rows(top), of_rows(logsum), of_rows(token_ids)
    chosen = (of_rows(logits).gather(1, chosen_ids[:, None]).squeeze(1) - top) - logsum
    max_n = max(params[r].logprobs for r in wanted)
    if max_n == 0:
        return SampledTensors(token_ids, wanted, chosen, None, None)
    if max_n == 1:
        return SampledTensors(token_ids, wanted, chosen, (-logsum)[:, None],
                              of_rows(argmax)[:, None])
    values, top_ids = of_rows(logits).topk(max_n, dim=-1)
    return SampledTensors(token_ids, wanted, chosen, (values - top[:, None]) - logsum[:, None],
                          top_ids)
