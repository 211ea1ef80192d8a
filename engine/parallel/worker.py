"""A tensor-parallel worker: rank r > 0 of a pod, started by rank 0's
`TPLeader.start` as

    python -m engine.parallel.worker '<WorkerSpec as JSON>'

Life of a worker:

    start    PR_SET_PDEATHSIG (killed when the thread of rank 0 that started
             it exits), join the group, build its rank (shard, KV cache with
             the pod's block count, runner and CUDA graphs: the same order
             as rank 0, `engine.parallel.rank`).
    idle     blocked reading its socket: no collective is pending, so no
             timeout runs while the pod has nothing to do.
    service  with a rank service (`WorkerSpec.rank_service`): imported by
             name and started on the built rank; its `layer_kv_hook`
             becomes the runner's, and a control thread applies rank 0's
             control messages to it (engine/parallel/control.py).
    step     a STEP message: `StepMirror` updates the block tables and gives
             the rows (and the spans a hook sees, request ids included),
             `ModelRunner.build` the very tensors rank 0 built; the step
             waits until the control thread applied the header's
             `control_seq` messages; `forward` runs the shard (its
             all-reduces) and takes part in the lm_head gathers; then, when
             the header says so, the broadcast of the step's sampled
             tokens, kept for the next step's placeholder rows.
    end      a STOP message or the end of the stream (rank 0 is gone): exit
             0. Any error (a collective that timed out, a malformed message):
             logged, exit 1, which rank 0's watchdog turns into the pod going
             down.

Steps run on the main thread, control messages on the control thread (and
whatever threads the rank service starts); nothing is ever pickled.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys

import torch

from engine.host_copy import to_device
from engine.model_runner import ModelRunner
from engine.parallel.control import RankService, WorkerControl, load_rank_service
from engine.parallel.group import TPGroup, join_store
from engine.parallel.launch import WorkerSpec
from engine.parallel.placement import place
from engine.parallel.rank import RankModel, build_rank
from engine.parallel.step_wire import Kind, StepMessage, StepMirror, WireError, receive
from engine.prompt_logprobs import PromptLogprobsPlan

log = logging.getLogger("engine.parallel.worker")

_PR_SET_PDEATHSIG = 1


def serve(runner: ModelRunner, group: TPGroup, sock: socket.socket,
          control: WorkerControl | None = None, control_timeout_s: float = 60.0) -> int:
    """Run steps until STOP or end of stream; returns the steps run. With
    `control`, each step's forward waits (up to `control_timeout_s`) until
    the control messages rank 0 sent before it were applied."""
    mirror = StepMirror()
    previous_tokens: torch.Tensor | None = None
    with torch.inference_mode():
        while (message := receive(sock)) is not None and message.kind is Kind.STEP:
            rows = mirror.apply(message)
            step = runner.build(rows, prompt_logprobs=prompt_plan(message, runner.device),
                                spans=mirror.spans(message, runner.block_size, runner.device))
            if message.control_seq:
                if control is None:
                    raise WireError(f"step {message.step} follows control message "
                                    f"{message.control_seq}; this worker has no control channel")
                control.wait_processed(message.control_seq, control_timeout_s)
            if step.graph_bucket != message.graph_bucket:
                raise WireError(f"step {message.step}: rank 0 runs graph bucket "
                                f"{message.graph_bucket}, this rank chose {step.graph_bucket}")
            runner.forward(step, previous_tokens)
            previous_tokens = None
            if message.broadcast_sampled:
                previous_tokens = group.broadcast_from_first(torch.empty(
                    message.num_sampled, dtype=torch.long, device=runner.device))
    return mirror.next_step


def prompt_plan(message: StepMessage, device: torch.device) -> PromptLogprobsPlan | None:
    """A worker's prompt-logprobs plan of a step: only the rows (this rank
    takes part in their lm_head gathers; rank 0 scores them)."""
    if not message.prompt_rows:
        return None
    return PromptLogprobsPlan(
        rows=to_device(torch.tensor(message.prompt_rows, dtype=torch.long), device),
        targets=torch.empty(0, dtype=torch.long, device=device), spans=(), num_top=0)


def _start_service(spec: WorkerSpec, rank: RankModel, group: TPGroup
                   ) -> tuple[WorkerControl | None, RankService | None]:
    """The rank service and its control thread (none without a service).
    Started on the built rank (it needs the KV cache), so its hook is bound
    to the runner afterwards: rank 0 made every rank eager when it has a
    hook itself (TPLeader.start), so no graph was captured without it."""
    if spec.control_fd < 0:
        return None, None
    control = WorkerControl(socket.socket(fileno=spec.control_fd))
    service = load_rank_service(spec.rank_service)(spec, rank, group, control)
    rank.runner.layer_kv_hook = service.layer_kv_hook
    control.start(service, on_failure=lambda reason: _exit_at_once(spec.rank, reason))
    return control, service


def _exit_at_once(rank: int, reason: str) -> None:
    """The control thread: the rank service failed; exit now (rank 0's
    watchdog takes the pod down) rather than at the next step, which an idle
    pod may never send."""
    log.error("tensor-parallel rank %d: its rank service failed (%s); exiting", rank, reason)
    sys.stderr.flush()
    os._exit(1)


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when rank 0's starting thread exits (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d); relying on the socket's "
                        "end of stream", ctypes.get_errno())
    if os.getppid() != parent_pid:  # rank 0 died before the prctl took effect
        os._exit(1)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m engine.parallel.worker '<WorkerSpec JSON>'", file=sys.stderr)
        return 2
    spec = WorkerSpec.from_json(argv[0])
    _die_with_parent(spec.parent_pid)
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    place(spec.cpus)
    sock = socket.socket(fileno=spec.socket_fd)
    try:
        store = join_store(spec.init_method, spec.config.tp_timeout_s)
        group = TPGroup.initialize(rank=spec.rank, size=spec.size, store=store,
                                   device=spec.config.device, timeout_s=spec.config.tp_timeout_s)
        rank = build_rank(spec.config, group)
        log.info("rank %d of %d ready on %s: %d KV blocks", spec.rank, spec.size,
                 spec.config.device, rank.num_blocks)
        control, service = _start_service(spec, rank, group)
        try:
            steps = serve(rank.runner, group, sock, control, spec.config.tp_timeout_s)
        finally:
            if service is not None:
                service.close()
    except Exception:
        log.exception("tensor-parallel rank %d failed", spec.rank)
        return 1
    log.info("rank %d stopping after %d steps", spec.rank, steps)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stderr.flush()
    # Not sys.exit: a process group's threads must not hold up the exit of a
    # rank whose peers are gone.
    os._exit(code)
