"""`pdserve up --pin auto` (the default): on CPU, each pod on its own cores.

Disaggregation's point is that a prompt computed on a prefill pod never
stalls a decode pod's running batch. Pods whose torch threads share every
core undo that on a CPU: the prefill pod's threads take the decode pod's
cores for a whole prompt, and the decode pod's inter-token tail becomes a
prompt's compute time (at light load on two shared cores, 2.8-7.2x colocated
serving's ITL p99, against 1.2-2.7x with a core each; docs/defaults.md).

So when the pods run on CPU, no pod role has a `--{role}-cpus` list, and
there are CPUs enough for every pod process (a pod of tensor-parallel size N
counts N: its ranks split the pod's list, engine/parallel/placement.py),
each pod gets a disjoint, contiguous share, N equal parts per pod of size N;
the CPUs left over go one at a time to the pods in start order, prefill pods
first (their prompts are the compute-bound work). The router stays unpinned:
it relays bytes and makes one short decision per request. Otherwise the pods
share every CPU, and `up` says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.commands._cpus import allowed_cpus, format_cpu_list
from pdserve.commands._up_config import UpConfig
from proto.roles import PodRole


@dataclass(frozen=True, slots=True)
class Pinning:
    """What `--pin auto` decided: per pod role the `--{role}-cpus` text
    (lists split by "/", pod i the i-th), empty when the pods share, and the
    sentence `up` prints either way."""

    cpus: tuple[tuple[str, str], ...]
    message: str


def plan_pinning(pods: list[tuple[str, int]], cpus: tuple[int, ...], *, on_cuda: bool,
                 pinned_roles: set[str]) -> Pinning:
    """Disjoint CPU lists for `pods` ((role, tensor-parallel size) in start
    order) out of `cpus` (ascending), or none with the reason."""
    if on_cuda:
        return Pinning((), "pods on a GPU: their host threads share the CPUs (--pin auto "
                           "pins only CPU pods)")
    if pinned_roles:
        return Pinning((), f"--{'/'.join(sorted(pinned_roles))}-cpus given: other pods "
                           "share the CPUs")
    units = sum(size for _, size in pods)
    if len(cpus) < units:
        cpu_count = f"{len(cpus)} CPU" + ("" if len(cpus) == 1 else "s")
        return Pinning((), f"{cpu_count} for {units} pod processes: they share them "
                           "(--pin auto needs one CPU per process)")
    base, extra = divmod(len(cpus), units)
    shares: dict[str, list[str]] = {}
    start = 0
    described = []
    for role, size in sorted(pods, key=lambda pod: pod[0] != "prefill"):  # prefill first
        take = size * base + min(extra, size)
        extra -= min(extra, size)
        text = format_cpu_list(cpus[start:start + take])
        start += take
        lists = shares.setdefault(role, [])
        lists.append(text)
        described.append(f"{role}-{len(lists) - 1} on CPU {text}")
    return Pinning(tuple((role, "/".join(lists)) for role, lists in shares.items()),
                   f"pods pinned to disjoint CPUs: {', '.join(described)} "
                   "(--pin off shares them)")


def pods_on_cuda(pod_args: list[str]) -> bool:
    """Whether the pods will run on CUDA: their last `--device` flag, else
    `auto`'s answer (a visible CUDA device)."""
    device = "auto"
    for i, arg in enumerate(pod_args):
        if arg.startswith("--device="):
            device = arg.partition("=")[2]
        elif arg == "--device" and i + 1 < len(pod_args):
            device = pod_args[i + 1]
    from pdserve.commands._pod_flags import resolve_device  # the pods' own rule (engine imports)

    return resolve_device(device) == "cuda"


def pin_pods(config: UpConfig, say: Callable[[str], None]) -> UpConfig:
    """`config` with --pin auto's CPU lists added (none with --pin off); says
    what it decided."""
    if config.pin == "off":
        return config
    pods = [(role, config.tensor_parallel_of(role))
            for role, count in ((PodRole.PREFILL, config.num_prefill),
                                (PodRole.DECODE, config.num_decode),
                                (PodRole.COLOCATED, config.num_colocated))
            for _ in range(count)]
    every_pod_arg = [*config.pod_args, *(a for _, args in config.role_args for a in args)]
    pinning = plan_pinning(pods, allowed_cpus(), on_cuda=pods_on_cuda(every_pod_arg),
                           pinned_roles={role for role, _ in config.cpus if role != "router"})
    say(pinning.message)
    return replace(config, cpus=config.cpus + pinning.cpus)
