"""`LogitsAdjustments`: penalties, logit bias and min_tokens, applied to one
step's logits rows in a few batched tensor ops.

Built by `StepPipeline.launch` on the engine loop thread (it reads the
requests: prompt and output token ids) only when some row of the step has
`SamplingParams.needs_logits_processing`; a step without such a row builds
nothing and the sampler runs exactly its old path. Applied by
`Sampler.sample` (the forward worker thread on CPU) before the greedy argmax
and before temperature, so greedy rows are affected too. Logprobs stay those
of the raw logits (engine/sampler.py).

Per adjusted row, in this order (docs/router.md "Sampling parameters"):

    repetition_penalty r   every token id seen in prompt + output so far:
                           logit / r if logit > 0 else logit * r (HF/vLLM)
    frequency_penalty f    logit -= f * count(token in output so far)
    presence_penalty p     logit -= p * (count > 0)            (OpenAI)
    logit_bias             logit += bias[token]
    min_tokens m           while output index < m: EOS (unless ignore_eos)
                           and stop_token_ids -> -inf

"Output so far" is what precedes the token being sampled: the committed
output tokens (on a decode pod: the prefill pod's first token and those of a
migration) plus, with async scheduling, the one token the step still in
flight samples, which is on the device only: it is gathered from that step's
sampled-token tensor (`pending`), never read back to the host. So the same
request gets the same adjustments on whichever pod samples index i, which
keeps disaggregated output equal to colocated output.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from engine.host_copy import to_device
from engine.request import Request


@dataclass(frozen=True, slots=True)
class LogitsAdjustments:
    """One step's adjustments as index tensors on the logits' device; rows
    index the step's sampling rows. Every `*_rows`/`*_ids` pair is a sparse
    list of (row, token id) entries."""

    output_rows: torch.Tensor  # [k] int64: one entry per output token so far
    output_ids: torch.Tensor  # [k] int64
    pending_rows: torch.Tensor  # [j] rows whose last output token is still in flight
    pending_sources: torch.Tensor  # [j] that token's row in the previous step's tokens
    prompt_rows: torch.Tensor  # repetition-penalty rows' prompt tokens (repeats allowed)
    prompt_ids: torch.Tensor
    presence: torch.Tensor  # [n] float32 per row (0 = off)
    frequency: torch.Tensor  # [n]
    repetition: torch.Tensor  # [n] (1 = off)
    bias_rows: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor  # float32
    banned_rows: torch.Tensor  # min_tokens: (row, token) set to -inf
    banned_ids: torch.Tensor

    def apply(self, logits: torch.Tensor,
              previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """A new [n, V] tensor: `logits` adjusted. `previous_tokens` is the
        previous step's sampled-token tensor when some row is pending."""
        n, vocab = logits.shape
        counts = torch.zeros((n, vocab), dtype=torch.float32, device=logits.device)
        ones = torch.ones_like(self.output_ids, dtype=torch.float32)
        counts.index_put_((self.output_rows, self.output_ids), ones, accumulate=True)
        if self.pending_rows.numel():
            assert previous_tokens is not None, "a pending row needs the previous step's tokens"
            pending_ids = previous_tokens[self.pending_sources].long()
            counts.index_put_((self.pending_rows, pending_ids),
                              torch.ones_like(pending_ids, dtype=torch.float32),
                              accumulate=True)
        out = logits.float().clone()
        seen = counts > 0
        if self.prompt_rows.numel():
            seen[self.prompt_rows, self.prompt_ids] = True
        penalty = self.repetition[:, None]
        repeated = torch.where(out > 0, out / penalty, out * penalty)
        out = torch.where(seen & (penalty != 1.0), repeated, out)
        out -= self.frequency[:, None] * counts + self.presence[:, None] * (counts > 0)
        if self.bias_rows.numel():
            out.index_put_((self.bias_rows, self.bias_ids), self.bias_values, accumulate=True)
        if self.banned_rows.numel():
            out[self.banned_rows, self.banned_ids] = float("-inf")
        return out


def build_adjustments(requests: Sequence[Request], output_indices: Sequence[int],
                      pending_sources: Sequence[int | None], eos_token_ids: Collection[int],
                      vocab_size: int, device: torch.device) -> LogitsAdjustments | None:
    """The step's adjustments, or None when no row needs any (the fast path).

    `output_indices[r]`: the output index row r samples; `pending_sources[r]`:
    the row of request r's in-flight token in the previous step's sampled
    tokens, or None when all its earlier outputs are committed. Token ids
    outside the vocabulary (logit_bias, stop_token_ids) are ignored here:
    the pod refuses them at admission (`check_logit_bias`)."""
    if not any(r.sampling_params.needs_logits_processing for r in requests):
        return None
    n = len(requests)
    # Token ids go into flat int64 arrays (C-speed extend and conversion); each
    # entry's row comes from a per-row count by repeat_interleave.
    out_ids, out_counts = array("q"), [0] * n
    prompt_ids, prompt_counts = array("q"), [0] * n
    pend_rows: list[int] = []
    pend_src: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    presence, frequency, repetition = [0.0] * n, [0.0] * n, [1.0] * n
    for row, request in enumerate(requests):
        p = request.sampling_params
        if not p.needs_logits_processing:
            continue
        presence[row], frequency[row] = p.presence_penalty, p.frequency_penalty
        repetition[row] = p.repetition_penalty
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            outputs = request.all_token_ids[request.num_prompt_tokens:]
            out_ids.extend(outputs)
            out_counts[row] = len(outputs)
            if pending_sources[row] is not None:
                pend_rows.append(row)
                pend_src.append(pending_sources[row])
        if p.repetition_penalty != 1.0:
            prompt_ids.extend(request.prompt_token_ids)
            prompt_counts[row] = request.num_prompt_tokens
        for token, bias in p.logit_bias.items():
            if token < vocab_size:
                bias_rows.append(row)
                bias_ids.append(token)
                bias_values.append(bias)
        if output_indices[row] < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            stops = {t for t in stops if t < vocab_size}
            banned_ids.extend(stops)
            banned_rows.extend([row] * len(stops))

    def ids(values: list[int] | array) -> torch.Tensor:
        if isinstance(values, array):
            tensor = (torch.frombuffer(values, dtype=torch.long) if len(values)
                      else torch.empty(0, dtype=torch.long))
        else:
            tensor = torch.tensor(values, dtype=torch.long)
        return to_device(tensor, device)

    def rows_of(counts: list[int]) -> torch.Tensor:
        per_row = torch.tensor(counts, dtype=torch.long)
        return to_device(torch.repeat_interleave(torch.arange(n), per_row), device)

    def floats(values: list[float]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.float32), device)

    return LogitsAdjustments(
        rows_of(out_counts), ids(out_ids), ids(pend_rows), ids(pend_src),
        rows_of(prompt_counts), ids(prompt_ids),
        floats(presence), floats(frequency), floats(repetition),
        ids(bias_rows), ids(bias_ids), floats(bias_values), ids(banned_rows), ids(banned_ids))
