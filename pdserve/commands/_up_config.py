"""`UpConfig`: the validated settings of `pdserve up` (pdserve/commands/up.py
turns its flags into one and runs the life cycle from it), and the pod roles
it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_source import DEFAULT_MODEL
from pdserve.commands._cpus import format_cpu_list, parse_cpu_list
from pdserve.commands._supervisor import RestartPolicy
from proto.roles import PodRole

# The pdserve subcommand that runs each pod role.
POD_COMMANDS = {PodRole.PREFILL: "prefill", PodRole.DECODE: "decode", PodRole.COLOCATED: "serve"}
# Roles `--{role}-cpus` pins.
CPU_ROLES = (*POD_COMMANDS, "router")
# `--pin` (pdserve/commands/_up_pinning.py)
PIN_CHOICES = ("auto", "off")


@dataclass(frozen=True, slots=True)
class UpConfig:
    """Validated `pdserve up` settings (built from the flags by `config_from_args`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50050
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    model_dir: str = DEFAULT_MODEL  # a --model value (engine.model_source)
    redis_url: str | None = None
    grace_period_s: float = 10.0
    startup_timeout_s: float = 300.0
    log_level: str = "WARNING"
    pod_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    # extra flags for the pods of one role only ("prefill", "decode", "colocated")
    role_args: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # CPU list per role ("prefill", "decode", "colocated", "router"), as given:
    # one list (every pod of the role) or several split by "/" (pod i gets the
    # i-th, cyclically: one pod per NUMA node or core); pdserve/commands/_cpus.py
    cpus: tuple[tuple[str, str], ...] = ()
    ready_file: str | None = None
    router_workers: int = 1
    # restarts of one child allowed within restart_window_s (0: an exit stops everything)
    max_restarts: int = 5
    restart_window_s: float = 60.0
    # tensor-parallel size per pod role (--{role}-tp); a role not listed runs at 1
    tensor_parallel: tuple[tuple[str, int], ...] = ()
    # "auto": CPU pods on disjoint CPUs when there are enough (_up_pinning.py); "off"
    pin: str = "auto"

    def __post_init__(self) -> None:
        for name in ("port", "grpc_port"):
            value = getattr(self, name)
            if not 0 < value < 65536:
                raise ValueError(f"--{name.replace('_', '-')} must be in 1..65535; got {value}")
        for name, value in (("prefill", self.num_prefill), ("decode", self.num_decode),
                            ("colocated", self.num_colocated)):
            if not 0 <= value <= 16:
                raise ValueError(f"--{name} must be between 0 and 16 pods; got {value}")
        if self.num_colocated == 0 and (self.num_prefill == 0 or self.num_decode == 0):
            raise ValueError("need at least one prefill and one decode pod, or --colocated >= 1")
        if not 1 <= self.router_workers <= 64:
            raise ValueError(f"--router-workers must be between 1 and 64; got "
                             f"{self.router_workers}")
        if self.grace_period_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError("--grace-period and --startup-timeout must be > 0 seconds")
        for role, text in self.cpus:
            if role not in CPU_ROLES:
                raise ValueError(f"no CPU list for role {role!r}; roles: {', '.join(CPU_ROLES)}")
            if role == "router" and "/" in text:
                raise ValueError(f"--router-cpus {text!r}: one list for the router's "
                                 "processes, not one per pod ('/')")
            try:
                for part in text.split("/"):
                    parse_cpu_list(part)
            except ValueError as exc:
                raise ValueError(f"--{role}-cpus: {exc}") from None
        for role, size in self.tensor_parallel:
            if role not in POD_COMMANDS:
                raise ValueError(f"no tensor-parallel size for role {role!r}; roles: "
                                 f"{', '.join(POD_COMMANDS)}")
            if not 1 <= size <= 64:
                raise ValueError(f"--{role}-tp must be between 1 and 64; got {size}")
        if self.pin not in PIN_CHOICES:
            raise ValueError(f"--pin must be one of {', '.join(PIN_CHOICES)}; got {self.pin!r}")
        self.restart_policy()  # validates the restart flags

    def tensor_parallel_of(self, role: str) -> int:
        """The tensor-parallel size of `role`'s pods (1 unless --{role}-tp)."""
        return dict(self.tensor_parallel).get(role, 1)

    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(max_restarts=self.max_restarts, window_s=self.restart_window_s,
                             startup_timeout_s=self.startup_timeout_s)

    def cpus_of(self, role: str, index: int = 0) -> str | None:
        """The canonical CPU list of `role`'s pod number `index` (from 0), or
        None (not pinned)."""
        for name, text in self.cpus:
            if name == role:
                lists = text.split("/")
                return format_cpu_list(parse_cpu_list(lists[index % len(lists)]))
        return None
