"""Where one decode step's time goes, beside the bound of reading the weights once.

Part of `pdserve bench engine` (`--breakdown`). A decode step at batch B
reads every dense weight once; on a CPU that read is the floor of the step.
In one run this module measures:

- the **weight-read bound**: bytes of all dense weights (the linears and
  lm_head; the embedding is a lookup of B rows) divided by the read
  bandwidth of this machine measured now, with the engine's thread count,
  as the median of summing a buffer larger than the last-level cache;
- the **step**: median wall time of decode steps of B requests at a given
  context length;
- the **breakdown** of profiled steps (torch.profiler, self CPU time by op):
  matmul (oneDNN / BLAS linears), attention (the native C decode kernel,
  or SDPA and the paged gather; the KV inject), and everything else
  (norms, RoPE, sampling, Python).

On CUDA the bound is the weights over the device's own read bandwidth
(summing a device buffer, synchronised) and the step is timed to the
device's completion; the split by op is left out ("-"): CPU self time
there is launch time, and a CUDA-graph step is one replay.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

MATMUL_OPS = ("mkldnn::_linear_pointwise", "pdserve_native::gemm_panels", "aten::mm",
              "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_attention_math", "aten::index_select",
                 "aten::index_put_", "aten::index", "aten::_softmax", "aten::einsum",
                 "pdserve_native::paged_decode_attention", "pdserve_native::prefill_attention")


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    batch: int
    context: int
    step_ms: float
    step_spread_ms: tuple[float, float]
    matmul_ms: float
    attention_ms: float
    other_ms: float
    weight_bytes: int
    read_gb_s: float

    @property
    def bound_ms(self) -> float:
        return self.weight_bytes / (self.read_gb_s * 1e9) * 1e3


def dense_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight a decode step must stream, in the model's own
    dtype: all parameters but the embedding table (unless lm_head shares it,
    then it is counted once as lm_head). A bfloat16 layer that a CPU without
    bfloat16 arithmetic packs as float32 (`Linear.upcast`) counts as
    bfloat16: the bound is what the checkpoint's weights cost to read, not
    what a path that widens them in memory reads."""
    from engine.layers.linear import Linear

    def size(m: Linear) -> int:
        element = 2 if m.upcast else m.weight.element_size()
        return (m.in_features * m.out_features
                + (m.out_features if m.bias is not None else 0)) * element

    return sum(size(m) for m in model.modules() if isinstance(m, Linear))


def read_bandwidth_gb_s(megabytes: int = 512, repeats: int = 7,
                        device: torch.device | str = "cpu") -> float:
    """Median GB/s of summing a float32 buffer on `device` (reads only; larger than any LLC)."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    buf = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    buf.sum()  # touch every page
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        sync()
        times.append(time.perf_counter() - start)
    return buf.numel() * 4 / statistics.median(times) / 1e9


def measure(engine, batch: int, context: int, *, steps: int = 15,
            profiled_steps: int = 5) -> StepBreakdown:
    """Decode steps of `batch` random prompts of `context` tokens (engine must be idle)."""
    from torch.profiler import ProfilerActivity, profile

    from engine.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    params = SamplingParams(temperature=0, max_tokens=steps + profiled_steps + 8,
                            ignore_eos=True)
    ids = []
    for i in range(batch):
        request_id = f"breakdown-{time.monotonic_ns()}-{i}"
        engine.add_request(request_id, torch.randint(10, vocab, (context,),
                                                     generator=gen).tolist(), params)
        ids.append(request_id)
    while engine.stats().num_waiting or any(
            engine.scheduler.running and r.num_computed_tokens < r.num_prompt_tokens
            for r in engine.scheduler.running):
        engine.step()
    for _ in range(2):
        engine.step()  # warm: every request decoding
    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    sync()
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(profiled_steps):
            engine.step()
        profiled_ms = (time.perf_counter() - start) * 1e3 / profiled_steps
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    by_name: dict[str, float] = {}
    for event in prof.key_averages():
        by_name[event.key] = by_name.get(event.key, 0.0) + event.self_cpu_time_total / 1e3
    matmul = sum(v for k, v in by_name.items() if k in MATMUL_OPS) / profiled_steps
    attention = sum(v for k, v in by_name.items() if k in ATTENTION_OPS) / profiled_steps
    step_ms = statistics.median(times)
    # Scale the profiled split to the unprofiled step (the profiler adds overhead).
    scale = step_ms / profiled_ms if profiled_ms > 0 else 1.0
    matmul, attention = matmul * scale, attention * scale
    other = max(step_ms - matmul - attention, 0.0)
    if cuda:  # CPU self time is launch time there: no split
        matmul = attention = other = float("nan")
    return StepBreakdown(
        batch=batch, context=context, step_ms=step_ms,
        step_spread_ms=(min(times), max(times)), matmul_ms=matmul, attention_ms=attention,
        other_ms=other, weight_bytes=dense_weight_bytes(engine.model),
        read_gb_s=read_bandwidth_gb_s(device=engine.device))


def format_table(rows: list[StepBreakdown]) -> str:
    lines = ["| batch | context | step ms (min-max) | matmul | attention | other | "
             "weights MB | read GB/s | bound ms | step / bound |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    def ms(value: float) -> str:
        return "-" if value != value else (f"{value:.1f}" if value >= 1 else f"{value:.3f}")

    for r in rows:
        lines.append(
            f"| {r.batch} | {r.context} | {ms(r.step_ms)} ({ms(r.step_spread_ms[0])}-"
            f"{ms(r.step_spread_ms[1])}) | {ms(r.matmul_ms)} | {ms(r.attention_ms)} | "
            f"{ms(r.other_ms)} | {r.weight_bytes / 1e6:.0f} | {r.read_gb_s:.1f} | "
            f"{ms(r.bound_ms)} | {r.step_ms / r.bound_ms:.2f}x |")
    return "\n".join(lines)
