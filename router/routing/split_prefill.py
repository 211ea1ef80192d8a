"""`SplitPrefill`: when one prompt is computed on both pods (the split
prefill, docs/architecture.md "One prompt on both pods").

Why: with equal hardware, the colocated baseline computes a prompt on all
of its cores, a prefill pod on its share, so at low load disaggregated TTFT
is about the ratio of the two (~2x on the 2-core benchmark machine). Split
at s, the prefill pod computes the head [0, s) and streams each layer's KV
as always; the decode pod computes the tail [s, n) layer by layer behind
it and samples token 0 itself.

Consulted by `router.flow.attempt.Attempt` when it builds the decode pod's
reservation (`DecodeGenerateRequest.split_at`), on the router's event
loop. A request is split when:

1. the rule is on: `--split-prefill-min-tokens` M > 0, and its context
   (prompt, and no output yet: a migrated request is not split) has at
   least M tokens;
2. the decode pod is idle: no running or waiting sequences in its last
   load report, and no other request of this router in flight there. The
   tail's forward holds the pod's whole step while it waits for the head's
   layers, so a running batch would stall for the prompt's time;
3. the request wants no prompt logprobs (no pod would compute every
   prompt position's logits).

The head is `--split-prefill-head-share` of the context (default 0.55: the
tail attends over the head, so it costs more per token; `pdserve bench
prefill-split` measures the balance). The decode pod may decline (its
cached prefix holds the head already): its `Reserved.split_at` says what
it took, 0 for an ordinary reservation.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.routing.base import PodPool


@dataclass(frozen=True, slots=True)
class SplitSettings:
    """`min_tokens`: M above (0 = off). `head_share`: the head's share of the
    context."""

    min_tokens: int = 0
    head_share: float = 0.55

    def __post_init__(self) -> None:
        if not 0 <= self.min_tokens <= 1 << 20:
            raise ValueError(f"split prefill min tokens must be in [0, {1 << 20}], "
                             f"got {self.min_tokens}")
        if not 0.05 <= self.head_share <= 0.95:
            raise ValueError(f"split prefill head share must be in [0.05, 0.95], "
                             f"got {self.head_share}")


class SplitPrefill:
    """The rule above, over the router's view of the pods."""

    def __init__(self, pool: PodPool, settings: SplitSettings) -> None:
        self._pool = pool
        self.settings = settings

    def split_at(self, address: str, num_context: int) -> int:
        """The head's length for a request reserving `num_context` context
        tokens on decode pod `address` (this router's track of the request
        already counted there), or 0: not split."""
        min_tokens = self.settings.min_tokens
        if not min_tokens or num_context < max(min_tokens, 2):
            return 0
        pod = next((p for p in self._pool.pods("decode") if p.address == address), None)
        if pod is None or pod.num_running or pod.num_waiting or pod.in_flight > 1:
            return 0
        return min(num_context - 1, max(1, round(num_context * self.settings.head_share)))
