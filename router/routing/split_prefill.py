"""`SplitPrefill`: when one prompt is computed on both pods (the split
prefill, docs/architecture.md "One prompt on both pods").

Why: with equal hardware, the colocated baseline computes a prompt on all
of its cores, a prefill pod on its share, so at low load disaggregated TTFT
is about the ratio of the two. Split at s, the prefill pod computes the
head [0, s) and streams each layer's KV as always; the decode pod computes
the tail [s, n) layer by layer behind it and samples token 0 itself.

Consulted by `router.flow.pod_caller.PodCaller` (for `pd_path`) when it
builds the decode pod's reservation (`DecodeGenerateRequest.split_at`), on
the router's event loop. A request is split when:

1. the rule is on: `--split-prefill-min-tokens` M > 0, and its context
   (prompt, and no output yet: a migrated request is not split) has at
   least M tokens. The default, `auto`, is M = 256 onto a decode pod on
   CPU, where it was measured to pay, and never onto one on another device
   (its `LoadReport.device`), where a prompt's prefill is a few
   milliseconds of a step and the split's speed is unmeasured;
2. the decode pod has no queue (no waiting sequences in its last load
   report) and runs at most `--split-prefill-max-running` sequences
   (default 3; the larger of its report's and this router's own count).
   A small running batch is no bar: the pod computes the tail on its tail
   worker (engine/tail_worker.py), beside the decode steps, which go on
   while the tail waits for the head's layers. A larger one is: there the
   decode pod has no spare core, and the tail only slows its batch;
3. the request wants no prompt logprobs (no pod would compute every
   prompt position's logits).

The split shares the work left to compute, not the context: the prefill
pod's cached prefix of the prompt (the router's prefix index, fed by the
pod's KV events; 0 when the policy follows none) belongs to the head, and
rule 1 counts only the uncached tokens. The head is that prefix plus
`--split-prefill-head-share` of the rest on an idle decode pod (default
0.55: the tail attends over the head, so it costs more per token; `pdserve
bench prefill-split` measures the balance), and
`--split-prefill-busy-head-share` of it on one with running sequences
(default 0.7: there the tail shares the pod's cores with the decode steps,
so it gets less of them). Why the prefix belongs to the head: a
conversation's next turn is mostly its history, cached on the prefill pod;
a head cut from the whole context would leave part of that history in the
tail, computed again on the decode pod, and the prefill pod, which caches
only what it computed, would hold even less of the turn after
(issue 42). The decode pod may decline (its cached prefix holds the
head already): its `Reserved.split_at` says what it took, 0 for an
ordinary reservation. The measurements behind the defaults:
benchmarks/results/history/routing.md, "Split prefill".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.routing.base import PodPool
from router.routing.local_prefill import CachedPrefix, no_cached_prefix

# `auto`'s M: onto a decode pod whose LoadReport.device is this, contexts of
# at least this many tokens
AUTO_DEVICE = "cpu"
AUTO_MIN_TOKENS = 256


@dataclass(frozen=True, slots=True)
class SplitSettings:
    """`min_tokens`: M above (0 = off, None = auto). `head_share`,
    `busy_head_share`: the head's share of the uncached tokens (after the
    prefill pod's cached prefix) on an idle decode pod, on a decoding one.
    `max_running`: no split onto a decode pod running more sequences."""

    min_tokens: int | None = None
    head_share: float = 0.55
    busy_head_share: float = 0.7
    max_running: int = 3

    def __post_init__(self) -> None:
        if self.min_tokens is not None and not 0 <= self.min_tokens <= 1 << 20:
            raise ValueError(f"split prefill min tokens must be in [0, {1 << 20}], "
                             f"got {self.min_tokens}")
        for name, share in (("head share", self.head_share),
                            ("busy head share", self.busy_head_share)):
            if not 0.05 <= share <= 0.95:
                raise ValueError(f"split prefill {name} must be in [0.05, 0.95], got {share}")
        if not 0 <= self.max_running <= 1 << 16:
            raise ValueError(f"split prefill max running must be in [0, {1 << 16}], "
                             f"got {self.max_running}")


class SplitPrefill:
    """The rule above, over the router's view of the pods."""

    def __init__(self, pool: PodPool, settings: SplitSettings,
                 cached_prefix: CachedPrefix = no_cached_prefix) -> None:
        self._pool = pool
        self.settings = settings
        self._cached_prefix = cached_prefix

    def split_at(self, address: str, token_ids: Sequence[int], prefill_address: str = "") -> int:
        """The head's length for a request whose context is `token_ids`,
        reserving on decode pod `address` (this router's track of the request
        already counted there) and computed on prefill pod `prefill_address`
        ("" if not known: nothing cached counts), or 0: not split."""
        settings = self.settings
        auto = settings.min_tokens is None
        min_tokens = AUTO_MIN_TOKENS if auto else settings.min_tokens
        num_context = len(token_ids)
        if not min_tokens or num_context < max(min_tokens, 2):
            return 0
        cached = 0
        if prefill_address:
            cached = min(num_context - 1, self._cached_prefix(prefill_address, token_ids))
        uncached = num_context - cached
        if uncached < max(min_tokens, 2):
            return 0
        pod = self._pool.pod("decode", address)
        if pod is None or pod.num_waiting or (auto and pod.device != AUTO_DEVICE):
            return 0
        running = max(pod.num_running, pod.in_flight - 1)  # in_flight counts this request
        if running > settings.max_running:
            return 0
        busy = running > 0
        share = settings.busy_head_share if busy else settings.head_share
        return min(num_context - 1, cached + max(1, round(uncached * share)))
