"""`EngineConfig`: the one validated configuration of an `LLMEngine`.

Built by command modules (`pdserve generate`, the pod services) from their
flags, never from the environment. Values that depend on the model
(`max_model_len`'s default and upper limit) and on the device (the number of
KV blocks that fit a memory budget) are resolved when the engine starts, in
`LLMEngine.__init__` / `engine.kv_cache.num_blocks_for_budget`, because the
config alone does not know the model.

The `LayerKVHook` of a prefill pod is a runtime object, not configuration: it
is a keyword argument of `LLMEngine(config, layer_kv_hook=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.itl_budget import parse_budget
from engine.layers.linear import DecodeMatmul, MatmulBackend
from engine.parallel.control import check_rank_service_name
from engine.prefix_wait import DEFAULT_MAX_WAIT_S
from kernels.dispatch import Backend

_DTYPES = ("float32", "float16", "bfloat16")
SCHEDULING_POLICIES = ("decode-first", "fcfs")
MIN_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 256
# KV budget on CPU when neither kv_cache_memory nor num_blocks is given:
# there is no "free device memory" to take a fraction of.
DEFAULT_CPU_KV_CACHE_MEMORY = 512 * 1024 * 1024
# Async scheduling's default on CPU, from the measurement in docs/engine.md.
ASYNC_SCHEDULING_ON_CPU = False
# Ranks of one tensor-parallel pod (one process and device each): the most
# GPUs a node holds, a few times over; KV head replication caps it in practice.
MAX_TENSOR_PARALLEL_SIZE = 64
# Seconds a collective (or joining the group at start) may take before it
# fails and takes the pod down (docs/tensor_parallel.md, Workers in lockstep).
DEFAULT_TP_TIMEOUT_S = 60.0
MAX_TP_TIMEOUT_S = 3600.0
# A prefix wait longer than this is a stall, not a wait (engine/prefix_wait.py).
MAX_PREFIX_WAIT_S = 600.0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an `LLMEngine` needs besides the runtime hook.

    KV cache size, in order of precedence: `num_blocks` (exact),
    `kv_cache_memory` (bytes for all layers' K and V), else on CUDA
    `gpu_memory_fraction` of the free device memory after the weights are
    loaded, on CPU `DEFAULT_CPU_KV_CACHE_MEMORY`.
    """

    model_dir: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_blocks: int | None = None
    gpu_memory_fraction: float = 0.9
    max_num_seqs: int = 64
    # Tokens computed per step over all sequences; a longer prompt is
    # prefilled in chunks over several steps (chunked prefill).
    max_num_batched_tokens: int = 2048
    # Which running requests get the step's token budget first:
    # "decode-first" (decoding requests, then prompts' chunks) or "fcfs"
    # (oldest first, whatever they compute). See engine/scheduler.py.
    scheduling_policy: str = "decode-first"
    # With decode-first: waiting prompts with at most this many tokens left
    # to compute after their cached prefix are admitted before the running
    # prompts' chunks, within half the budget; 0 = off. See engine/scheduler.py.
    short_prefill_tokens: int = 0
    # With decode-first: a step that decodes computes at most this many
    # prompt tokens (chunks and new prompts); 0, or a value at or above
    # max_num_batched_tokens, = the whole budget. See engine/scheduler.py.
    mixed_prefill_tokens: int = 0
    # With decode-first: prompt work beside decodes only while the step's
    # predicted time fits this inter-token budget: "off", "auto" (1.5x the
    # pod's own plain decode step) or milliseconds. See engine/itl_budget.py.
    itl_budget: str = "off"
    # A waiting request whose next uncached prompt block a running request is
    # computing waits for it at most this many seconds; 0 = off. See
    # engine/prefix_wait.py.
    prefix_wait_s: float = DEFAULT_MAX_WAIT_S
    # None: the model's max_position_embeddings (resolved by the engine).
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Seeds the pod generator used by unseeded sampled requests.
    seed: int = 0
    # Kernels (RMSNorm, RoPE, paged attention, KV copies): auto|triton|torch,
    # see kernels/dispatch.py. The CLI's --kernel-backend (default from
    # PDSERVE_KERNEL_BACKEND) sets it; nothing below the CLI reads the environment.
    kernel_backend: str = "auto"
    # Dense projections: auto|onednn|torch, see engine/layers/linear.py.
    matmul_backend: str = "auto"
    # A float32 (or, where oneDNN upcasts it, bfloat16) model's dense
    # projections on CPU, decode and prefill rows: auto|native|off, see
    # engine/layers/linear.py (DecodeMatmul). auto: the native panel GEMM (in
    # place of oneDNN's copy) on AVX2 + FMA.
    decode_matmul: str = "auto"
    # Plan and launch step N+1 while step N computes (docs/engine.md, Async
    # scheduling). None: on for CUDA, ASYNC_SCHEDULING_ON_CPU on CPU.
    async_scheduling: bool | None = None
    # True: never capture CUDA graphs, run every step eagerly. Graphs are
    # only ever captured on CUDA (engine/cuda_graphs.py).
    enforce_eager: bool = False
    # Processes (one device each) that run the model's shards; rank 0 is the
    # engine, the others follow its steps (docs/tensor_parallel.md).
    tensor_parallel_size: int = 1
    # A collective not done within this many seconds raises: a dead or
    # stalled rank takes the pod down in bounded time.
    tp_timeout_s: float = DEFAULT_TP_TIMEOUT_S
    # "package.module:function" each worker rank (TP > 1) imports and runs
    # beside its steps, talking to rank 0 over the control channel (a decode
    # rank's KV receiver, a prefill rank's sender); "" = none. A name, not an
    # object: the worker is another process (engine/parallel/control.py).
    rank_service: str = ""

    @property
    def use_async_scheduling(self) -> bool:
        """`async_scheduling`, with None resolved by device."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device.startswith("cuda") or ASYNC_SCHEDULING_ON_CPU

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir must name a model directory")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        bs = self.block_size
        if not (MIN_BLOCK_SIZE <= bs <= MAX_BLOCK_SIZE) or bs & (bs - 1):
            raise ValueError(
                f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
                f"got {bs}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not 0 <= self.short_prefill_tokens <= self.max_num_batched_tokens:
            raise ValueError(f"short_prefill_tokens must be in [0, max_num_batched_tokens "
                             f"{self.max_num_batched_tokens}], got {self.short_prefill_tokens}")
        if not 0.0 <= self.prefix_wait_s <= MAX_PREFIX_WAIT_S:
            raise ValueError(f"prefix_wait_s must be in [0, {MAX_PREFIX_WAIT_S:g}] seconds "
                             f"(0: off), got {self.prefix_wait_s}")
        if not 0 <= self.mixed_prefill_tokens <= 1 << 24:  # at or above the budget: no cap
            raise ValueError(f"mixed_prefill_tokens must be in [0, {1 << 24}], "
                             f"got {self.mixed_prefill_tokens}")
        parse_budget(self.itl_budget)  # ValueError naming the value
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        Backend.parse(self.kernel_backend)  # ValueError naming the allowed values
        MatmulBackend.parse(self.matmul_backend)
        DecodeMatmul.parse(self.decode_matmul)
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        tp = self.tensor_parallel_size
        if type(tp) is not int or not 1 <= tp <= MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(f"tensor_parallel_size must be an integer in [1, "
                             f"{MAX_TENSOR_PARALLEL_SIZE}], got {tp!r}")
        check_rank_service_name(self.rank_service)
        if not 0 < self.tp_timeout_s <= MAX_TP_TIMEOUT_S:
            raise ValueError(f"tp_timeout_s must be in (0, {MAX_TP_TIMEOUT_S:g}] seconds, "
                             f"got {self.tp_timeout_s}")
