"""CUDA graphs for pure-decode steps: one captured forward pass per batch-size bucket.

A decode step launches a few hundred small kernels whose host-side launch
cost, at small batches, exceeds their run time. Capturing the forward pass
once per batch size and replaying it turns those launches into one.

Who calls what: `ModelRunner.__init__` (engine start, after the KV cache is
allocated) builds `DecodeGraphs` and calls `capture()`; `ModelRunner.execute`
(engine loop thread) asks `bucket_for(batch)` and, for a pure-decode step
that fits, writes the step into `StepInputs` and calls `run(bucket)`.

- **Buckets** (`capture_sizes`): 1, 2, 4, 8, then every 8 up to 256, then
  every 32 up to `MAX_CAPTURE_SIZE` = 512, cut at `max_num_seqs`, which is
  added as the largest bucket when it is not one already. Small batches
  get exact sizes (padding a batch of 1 to 8 would multiply its attention
  work); above 8 the padding waste stays under 8 rows (under 32 above 256).
- **Padding**: a batch of B runs as its bucket's size. Rows `[B, bucket)`
  hold the `StepInputs` fill values (its invariant): token 0 at position 0,
  slot -1, which `kernels.inject_kv` skips (torch and Triton alike), and
  context length 0, for which decode attention returns zeros without
  reading the cache. A padding row thus writes no cache slot and reads
  none; rows of a batch never mix (every op here is row-wise), so real
  rows compute what the unpadded batch computes.
- **Static buffers**: the graph reads `StepInputs`' tensors (ids,
  positions, slots, and the decode block tables at their full width of
  `max_blocks_per_seq` columns, so the Triton decode launch -- grid and
  split plan from the table's shape, masking by `context_lens` on the
  device -- is the same on every replay whatever the step's longest
  context). Its output, the final hidden states [bucket, hidden], lives in
  the graph's memory and is overwritten by the next replay.
- **Memory**: all buckets share one memory pool; they are captured largest
  first, so the smaller ones reuse the largest one's blocks. The cost is
  about one forward pass's activations at the largest bucket plus the
  decode-attention split buffers, logged at capture.

`capture=False` builds the same object without capturing: `run(bucket)`
then executes the padded forward eagerly, exactly the work a replay does.
The CPU tests use it to check padding against the unpadded batch.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch

from engine.model import LlamaForCausalLM
from engine.paged_attention_context import PagedAttentionContext
from engine.step_inputs import StepInputs
from kernels import Backend, cuda_graph_unsupported_reason

log = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
# Forward passes on a side stream before each capture: the first compiles the
# Triton kernels and warms the allocator; none of that may happen in capture.
WARMUP_RUNS = 2


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch-size buckets captured for `max_num_seqs` (see module docstring)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    largest = min(max_num_seqs, MAX_CAPTURE_SIZE)
    ladder = [1, 2, 4, *range(8, 257, 8), *range(288, MAX_CAPTURE_SIZE + 1, 32)]
    sizes = [s for s in ladder if s <= largest]
    if sizes[-1] != largest:
        sizes.append(largest)
    return tuple(sizes)


def bucket_for(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding `batch` rows, or None (empty, or above the largest)."""
    if batch < 1:
        return None
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def eager_reason(*, device: torch.device, kernel_backend: Backend, enforce_eager: bool,
                 has_layer_kv_hook: bool, model_blocker: str | None = None) -> str | None:
    """Why an engine runs every step eagerly, or None when it captures decode
    graphs; `model_blocker` is the model's own reason (`cuda_graph_blocker`)."""
    if enforce_eager:
        return "enforce_eager is set"
    if model_blocker is not None:
        return model_blocker
    if has_layer_kv_hook:
        # A prefill pod's steps stream KV through the hook (host code inside
        # the forward pass); its requests never decode, so graphs would be
        # memory spent for nothing.
        return "a layer-KV hook is attached (prefill pod)"
    return cuda_graph_unsupported_reason(device, kernel_backend)


class DecodeGraphs:
    """The padded decode forward pass of each bucket, captured (or run eagerly)."""

    def __init__(self, model: LlamaForCausalLM, inputs: StepInputs,
                 context_for: Callable[[int], PagedAttentionContext], sizes: Sequence[int],
                 *, capture: bool = True) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[-1] > inputs.max_num_seqs:
            raise ValueError(f"bucket sizes {tuple(sizes)} must be increasing, distinct and "
                             f"at most max_num_seqs {inputs.max_num_seqs}")
        self.model = model
        self.inputs = inputs
        self.sizes = tuple(sizes)
        self.captured = capture
        self._contexts = {size: context_for(size) for size in self.sizes}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_runs = dict.fromkeys(self.sizes, 0)  # per bucket, for tests and logs
        if capture:
            self._capture_all()

    def bucket_for(self, batch: int) -> int | None:
        return bucket_for(batch, self.sizes)

    def run(self, size: int) -> torch.Tensor:
        """The final hidden states [size, hidden] of the batch now in `inputs`.
        With graphs, a view of graph memory valid until the next `run`."""
        self.num_runs[size] += 1
        if not self.captured:
            return self._forward(size)
        graph, hidden = self._graphs[size]
        graph.replay()
        return hidden

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.inputs.input_ids.buffer[:size],
                          self.inputs.positions.buffer[:size], self._contexts[size])

    def _capture_all(self) -> None:
        device = self.model.device
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: the others reuse its pool
                side.wait_stream(current)
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        self._forward(size)
                current.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: pod threads (gRPC, KV receivers) may touch CUDA meanwhile.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    hidden = self._forward(size)
                self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize(device)
        log.info("captured decode CUDA graphs for batch sizes %s in %.1f s, %.1f MiB",
                 self.sizes, time.perf_counter() - start,
                 (torch.cuda.memory_reserved(device) - reserved) / 2**20)
