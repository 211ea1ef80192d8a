"""Mixtral: the Mistral decoder (sliding window and all) with a sparse MoE
block (engine/layers/moe.py) in place of each layer's MLP."""

from __future__ import annotations

from engine.layers.moe import SparseMoE
from engine.model import LlamaDecoderLayer, LlamaForCausalLM


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_cls = SparseMoE


class MixtralForCausalLM(LlamaForCausalLM):
    """Each layer's `mlp` is a `SparseMoE` (HF's `block_sparse_moe`)."""

    decoder_layer_cls = MixtralDecoderLayer
    cuda_graph_blocker = ("the sparse MoE groups tokens by expert on the host "
                          "(data-dependent shapes)")
