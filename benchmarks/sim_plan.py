"""P:D pod counts checked against the simulator (issue 43, third bullet):
`pdserve bench scale --plan-ttft-ms T --plan-itl-ms I`.

Who uses it: benchmarks/scale.py's `main`, which hands `search` a `measure`
function (one short `bench scale` run at given pod counts: a simulated
cluster, one router, bench serve's workload) and prints `explain(plan)`.

How:

1. estimate   benchmarks/capacity.py's arithmetic (`pdserve plan`), with
              the workload's token rates from its requests and arrival
              times, and one pod's rates from the profile (`pod_capacity`):
              a prefill pod computes a mean prompt in one step; a decode pod
              runs the largest batch whose step fits the ITL target
2. up         while a run misses a target, add a pod to the side it points
              at: TTFT p90 over its target -> one more prefill pod, ITL p90
              over its target -> one more decode pod
3. down       from the counts that met both, take a pod off either side
              (prefill first) while a run still meets both

at most `max_runs` runs; every run is kept in the plan. A run's p90s are
its own (short, simulated), so treat the answer as a starting point, and
rerun at the answer with a longer workload before sizing a deployment.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks.capacity import PodCapacity, Sizing, Workload
from sim.engine import SimEngineConfig
from sim.perf_model import PerfModel

# a simulated pod's batch limit (pdserve sim's --max-num-seqs default)
SIM_MAX_NUM_SEQS = next(f.default for f in dataclasses.fields(SimEngineConfig)
                        if f.name == "max_num_seqs")


@dataclass(frozen=True, slots=True)
class Targets:
    """TTFT and ITL p90 targets, in milliseconds."""

    ttft_p90_ms: float
    itl_p90_ms: float

    def __post_init__(self) -> None:
        for flag, value in (("--plan-ttft-ms", self.ttft_p90_ms),
                            ("--plan-itl-ms", self.itl_p90_ms)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} must be > 0 milliseconds, got {value}")


@dataclass(frozen=True, slots=True)
class Run:
    """One simulated run at `prefill`:`decode` pods: its TTFT and ITL p90
    (ms; None when it measured none) and its failed requests."""

    prefill: int
    decode: int
    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    errors: int = 0

    def misses_ttft(self, t: Targets) -> bool:
        return self.errors > 0 or self.ttft_p90_ms is None or self.ttft_p90_ms > t.ttft_p90_ms

    def misses_itl(self, t: Targets) -> bool:
        # a run whose outputs are one token long has no ITL: nothing to miss
        return self.errors > 0 or (self.itl_p90_ms is not None and
                                   self.itl_p90_ms > t.itl_p90_ms)

    def meets(self, t: Targets) -> bool:
        return not (self.misses_ttft(t) or self.misses_itl(t))


@dataclass(frozen=True, slots=True)
class Plan:
    """The estimate, every run in order, and the smallest counts that met
    both targets (None: none within the runs allowed)."""

    targets: Targets
    estimate: Sizing
    runs: tuple[Run, ...]
    answer: tuple[int, int] | None


Measure = Callable[[int, int], Run]


def pod_capacity(perf: PerfModel, mean_prompt: float, mean_output: float,
                 itl_target_s: float, max_batch: int = SIM_MAX_NUM_SEQS) -> PodCapacity:
    """One prefill and one decode pod's token rates under `perf`: a prompt
    per prefill step; the largest decode batch (<= max_batch) whose step, at
    the mean context (prompt + half the output), fits the ITL target."""
    prefill_step = perf.step_overhead_s + mean_prompt * perf.prefill_s_per_token
    context = mean_prompt + mean_output / 2
    per_row = perf.decode_s_per_seq + context * perf.decode_s_per_context_token
    batch = min(max_batch, math.floor((itl_target_s - perf.step_overhead_s) / per_row)
                if per_row > 0 else max_batch)
    if batch < 1:
        one = 1e3 * (perf.step_overhead_s + per_row)
        raise ValueError(f"the ITL target {1e3 * itl_target_s:g} ms is below profile "
                         f"{perf.name!r}'s one-sequence decode step ({one:.2f} ms)")
    return PodCapacity(mean_prompt / prefill_step,
                       batch / (perf.step_overhead_s + batch * per_row))


def workload_rates(arrivals_s: Sequence[float], prompt_tokens: Sequence[int],
                   output_tokens: Sequence[int]) -> Workload:
    """Prompt and output tokens per second over the arrivals' span (no
    prefix hit assumed: the simulator's runs count what the cache saves)."""
    span = max(arrivals_s) - min(arrivals_s) if arrivals_s else 0.0
    if span <= 0:
        raise ValueError("the plan search needs arrivals spread in time: give --request-rate "
                         "or a trace (with every request at once there is no rate to size for)")
    return Workload(sum(prompt_tokens) / span, sum(output_tokens) / span)


def search(estimate: Sizing, measure: Measure, targets: Targets, max_runs: int = 8) -> Plan:
    """Steps from the estimate's counts as the module docstring says."""
    if max_runs < 1:
        raise ValueError(f"--plan-max-runs must be >= 1, got {max_runs}")
    runs: dict[tuple[int, int], Run] = {}

    def run(counts: tuple[int, int]) -> Run:
        if counts not in runs:
            runs[counts] = measure(*counts)
        return runs[counts]

    def done() -> Plan:
        met = [c for c, r in runs.items() if r.meets(targets)]
        best = min(met, key=lambda c: (c[0] + c[1], c)) if met else None
        return Plan(targets, estimate, tuple(runs.values()), best)

    counts = (estimate.prefill_pods, estimate.decode_pods)
    while not (last := run(counts)).meets(targets):
        if len(runs) >= max_runs:
            return done()
        counts = (counts[0] + last.misses_ttft(targets), counts[1] + last.misses_itl(targets))
    while len(runs) < max_runs:
        smaller = [c for c in ((counts[0] - 1, counts[1]), (counts[0], counts[1] - 1))
                   if min(c) >= 1 and c not in runs]
        for c in smaller:
            if len(runs) < max_runs and run(c).meets(targets):
                counts = c
                break
        else:
            break
    return done()


def explain(plan: Plan) -> str:
    """The estimate, a table of the runs, then the answer."""
    t, e = plan.targets, plan.estimate

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [f"estimate (pdserve plan's arithmetic, headroom {e.headroom:g}): "
             f"{e.prefill_pods}:{e.decode_pods} from {e.workload.prompt_tokens_per_s:,.0f} "
             f"prompt and {e.workload.output_tokens_per_s:,.0f} output tok/s over "
             f"{e.capacity.prefill_tokens_per_s:,.0f} and {e.capacity.decode_tokens_per_s:,.0f} "
             f"tok/s per pod",
             f"| P | D | TTFT p90 ms (<= {t.ttft_p90_ms:g}) | ITL p90 ms (<= {t.itl_p90_ms:g}) "
             f"| errors | meets |", "|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r.prefill} | {r.decode} | {ms(r.ttft_p90_ms)} | {ms(r.itl_p90_ms)} "
              f"| {r.errors} | {'yes' if r.meets(t) else 'no'} |" for r in plan.runs]
    lines.append(f"P:D = {plan.answer[0]}:{plan.answer[1]} meets both targets" if plan.answer
                 else f"no counts met both targets within {len(plan.runs)} run(s)")
    return "\n".join(lines)


def as_json(plan: Plan) -> dict:
    """The plan for --out."""
    e = plan.estimate
    return {"targets": dataclasses.asdict(plan.targets),
            "estimate": {"prefill_pods": e.prefill_pods, "decode_pods": e.decode_pods,
                         "workload": dataclasses.asdict(e.workload),
                         "capacity": dataclasses.asdict(e.capacity), "headroom": e.headroom},
            "runs": [dataclasses.asdict(r) for r in plan.runs],
            "answer": None if plan.answer is None else list(plan.answer)}
