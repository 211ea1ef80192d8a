"""`SparseMoE`: Mixtral's sparse mixture-of-experts block, in place of the MLP.

Per token: router logits `gate(x)` [E], softmax in float32, the top k
experts, their probabilities renormalised to sum to 1 (as transformers
does for Mixtral); the output is the sum over those experts of weight *
expert(x), each expert a SwiGLU MLP (`LlamaMLP`: w1 = gate, w3 = up,
w2 = down). Every token is computed only by its k experts: the rows are
grouped by expert (one sort, one host read of the per-expert counts), and
each expert with rows runs its two matmuls on them and adds its weighted
output back with `index_add_`, experts in increasing order (transformers'
order too, so each token's sum is added in the same order).

Under tensor parallelism every expert holds this rank's slice of its
intermediate dim (the router is replicated, so every rank routes alike),
each expert's down projection stays partial, and the block all-reduces its
summed output once.

The host read of the counts makes a step's shapes data-dependent, so a
model with this block never captures CUDA graphs (`cuda_graph_blocker`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.model import LlamaMLP
from engine.model_config import ModelConfig
from engine.parallel.group import TPGroup
from kernels.dispatch import Backend


class SparseMoE(nn.Module):
    """Parameters: `router.weight` [E, hidden] (HF's `block_sparse_moe.gate`),
    `experts.{e}.gate_up_proj.weight` [2I, hidden] = [w1; w3],
    `experts.{e}.down_proj.weight` [hidden, I] = w2."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype,
                 device: torch.device | str, kernel_backend: Backend,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.router = Linear(config.hidden_size, self.num_experts, bias=False, dtype=dtype,
                             device=device)
        self.experts = nn.ModuleList(
            # partial sums (no all-reduce of their own): the block reduces once
            LlamaMLP(config, dtype=dtype, device=device, kernel_backend=kernel_backend)
            for _ in range(self.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden] in x's dtype."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)          # [N, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        rows_in_order = order // self.top_k
        weights_in_order = weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = rows_in_order[start:start + count]  # distinct: top-k picks distinct experts
            y = self.experts[expert](x.index_select(0, rows))
            # The product in float32, added in x's dtype (transformers' rounding).
            out.index_add_(0, rows, (y * weights_in_order[start:start + count, None]).to(x.dtype))
            start += count
        return out if self.tp is None else self.tp.all_reduce(out)
