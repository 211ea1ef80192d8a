"""pdserve kernels: Triton kernels with plain-torch references, behind one dispatch.

The engine imports only what is exported here (see `kernels.dispatch` for how
a backend is chosen). Importing this package never imports Triton.
"""

from kernels.dispatch import (
    Backend,
    cuda_graph_unsupported_reason,
    extract_kv,
    inject_kv,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    rotary_embedding,
    triton_available,
)
from kernels.fused import (
    DecodeQKVAttention,
    ResidualRMSNorm,
    decode_qkv_attention,
    silu_and_mul,
)

__all__ = [
    "Backend",
    "DecodeQKVAttention",
    "ResidualRMSNorm",
    "cuda_graph_unsupported_reason",
    "decode_qkv_attention",
    "extract_kv",
    "inject_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "triton_available",
]
