"""`TPLeader`: rank 0's side of a tensor-parallel pod -- the worker
processes, their step sockets, the group, the step encoder, the watchdog.

Life cycle (docs/tensor_parallel.md, Workers in lockstep):

    start      LLMEngine.__init__ (TP > 1): host the rendezvous store, start ranks
               1..N-1 as `python -m engine.parallel.worker` children (each
               with one end of a Unix socketpair, its rank's device, the
               EngineConfig as JSON), join the group (`TPGroup.initialize`),
               then every rank builds its model (`engine.parallel.rank`).
    steps      engine loop thread: `send_step` writes each launched step's
               description to every worker, in rank order, before rank 0's
               own forward; the forward thread (`StepPipeline`) takes part in
               the collectives and broadcasts the sampled tokens
               (`broadcast_sampled`) when the step's header says so.
    failure    the watchdog thread polls the workers; one that exits (killed,
               crashed, a collective timed out) makes rank 0 kill the others
               (none waits in a collective for a dead peer), record why, and
               call the failure listeners (the engine loop wakes; the next
               `LLMEngine.step()` raises `TensorParallelError` and the pod
               goes down the engine loop's fatal path, exit 1). A collective
               that fails on rank 0 first is explained by `explain`.
    close      `close()`: a STOP message to each worker, a bounded wait for
               them to exit, SIGKILL after it, then the group is destroyed.
               A worker also exits on its socket's end of stream and, through
               PR_SET_PDEATHSIG, when the thread that started it exits, so
               no rank outlives rank 0.

Worker output (stdout and stderr) is copied to rank 0's stderr, each line
prefixed `[tp rank r]`, by one reader thread per worker.

With a rank service (`EngineConfig.rank_service`) each worker also gets a
control socket (engine/parallel/control.py): `control_send` from any thread,
replies to the handler given to `on_control`, on one reader thread per
worker; each step message carries, per worker, how many control messages
rank 0 had sent it, and the worker applies them all before that forward.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from engine.config import EngineConfig
from engine.kv_hook import LayerKVHook
from engine.model_runner import PreparedStep
from engine.parallel.control import ControlHandler, ControlHub, LeaderControl
from engine.parallel.group import TPGroup, host_store
from engine.parallel.placement import Placement, cpu_shares, place, restore
from engine.parallel.processes import describe_exit, forward_output, spawn
from engine.parallel.rank import RankModel, build_rank
from engine.parallel.step_wire import CONTROL_SEQ_WORD, StepEncoder, send, stop_message

log = logging.getLogger(__name__)

WATCHDOG_PERIOD_S = 0.1
# How long `explain` waits for the watchdog to see a worker exit after a
# collective failed on rank 0 (a killed peer fails the collective at once).
EXPLAIN_WAIT_S = 2.0
CLOSE_TIMEOUT_S = 10.0


class TensorParallelError(RuntimeError):
    """A rank of the pod died or a collective failed: the pod cannot step
    any more and goes down (its requests fail; a supervisor restarts it)."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process is started with (JSON on its command line)."""

    rank: int
    size: int
    init_method: str
    socket_fd: int
    parent_pid: int
    cpus: tuple[int, ...]  # its share of the pod's CPUs (engine/parallel/placement.py)
    log_level: int
    config: EngineConfig  # this rank's: its device
    control_fd: int = -1  # its control socket (engine/parallel/control.py); -1: none

    @property
    def fds(self) -> tuple[int, ...]:
        """The descriptors the worker inherits."""
        return (self.socket_fd,) if self.control_fd < 0 else (self.socket_fd, self.control_fd)

    @property
    def rank_service(self) -> str:
        """The service this worker runs beside its steps ("module:function", or "")."""
        return self.config.rank_service

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        fields = json.loads(text)
        return cls(**{**fields, "cpus": tuple(fields["cpus"]),
                      "config": EngineConfig(**fields["config"])})


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:(i + r) for rank 0 on cuda:i; the CPU for all on CPU."""
    if not device.startswith("cuda"):
        return device
    return f"cuda:{(torch.device(device).index or 0) + rank}"


class TPLeader:
    """Rank 0's handle on the workers and the group; see the module docstring
    for which thread calls what."""

    def __init__(self, processes: Sequence[subprocess.Popen] = (),
                 sockets: Sequence[socket.socket] = (), readers: Sequence[threading.Thread] = (),
                 controls: Sequence[LeaderControl] = ()) -> None:
        """Use `start`; `TPLeader()` is a pod of one rank (no workers, no
        group: every method is a no-op)."""
        self._processes = list(processes)  # rank r at index r - 1, likewise sockets
        self._sockets = list(sockets)
        self._readers = list(readers)
        self._control = ControlHub(controls)  # no channel without a rank service
        self.size = len(self._processes) + 1
        self.group: TPGroup | None = None
        self._placement: Placement | None = None  # rank 0's, undone by close()
        self.encoder = StepEncoder()
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._closing = False
        self._listeners: list[Callable[[], object]] = []
        if self._processes:
            threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    @classmethod
    def start(cls, config: EngineConfig, *, eager: bool) -> TPLeader:
        """Start ranks 1..N-1 and join the group as rank 0. `eager`: rank 0
        captures no CUDA graphs (a layer-KV hook), so neither do the workers."""
        size = config.tensor_parallel_size
        store, init_method = host_store(config.tp_timeout_s)
        worker_config = replace(config, enforce_eager=config.enforce_eager or eager)
        processes, sockets, readers, controls = [], [], [], []
        leader = None
        on_cpu = not config.device.startswith("cuda")
        shares = (cpu_shares(size) if on_cpu else None) or [()] * size
        try:
            for rank in range(1, size):
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                sockets.append(ours)
                control = theirs_control = None
                if config.rank_service:
                    control, theirs_control = socket.socketpair(socket.AF_UNIX,
                                                                socket.SOCK_STREAM)
                    controls.append(LeaderControl(control))
                spec = WorkerSpec(rank, size, init_method, theirs.fileno(), os.getpid(),
                                  shares[rank], logging.getLogger().getEffectiveLevel(),
                                  replace(worker_config, device=rank_device(config.device, rank)),
                                  -1 if theirs_control is None else theirs_control.fileno())
                with theirs:
                    processes.append(spawn(spec.to_json(), spec.fds))
                if theirs_control is not None:
                    theirs_control.close()
                readers.append(forward_output(processes[-1], rank))
            leader = cls(processes, sockets, readers, controls)
            leader._readers += leader._control.start_readers()
            if on_cpu:
                leader._placement = place(shares[0])
            leader.group = TPGroup.initialize(rank=0, size=size, store=store,
                                              device=config.device, timeout_s=config.tp_timeout_s)
        except BaseException as exc:
            if leader is None:
                leader = cls(processes, sockets, readers, controls)
            reason = leader.explain(exc)
            leader.close()
            raise reason from exc
        log.info("tensor parallel: %d ranks joined at %s", size, init_method)
        return leader

    @property
    def pids(self) -> tuple[int, ...]:
        """The workers' process ids, rank 1 first."""
        return tuple(p.pid for p in self._processes)

    @property
    def exit_codes(self) -> tuple[int | None, ...]:
        """The workers' exit status (None while running), rank 1 first."""
        return tuple(p.poll() for p in self._processes)

    # ------------------------------------------------------------ steps

    def send_step(self, step: PreparedStep, *, broadcast_sampled: bool) -> None:
        """Engine loop thread: `step`'s description to every worker, in rank
        order. TensorParallelError when a worker is gone."""
        message = self.encoder.encode(step, broadcast_sampled=broadcast_sampled)
        self.check()
        try:
            if not self._control.size:
                for sock in self._sockets:
                    send(sock, message)
                return
            message = bytearray(message)  # each worker's copy: its own control_seq
            for sock, sent in zip(self._sockets, self._control.sent, strict=True):
                struct.pack_into("q", message, CONTROL_SEQ_WORD * 8, sent)
                send(sock, message)
        except OSError as exc:
            raise self.explain(exc) from exc

    def forget(self, request_id: str) -> None:
        """Engine loop thread: the request ended; the workers drop its table."""
        if self._processes:
            self.encoder.forget(request_id)

    def broadcast_sampled(self, token_ids: torch.Tensor) -> None:
        """Forward thread: a step's sampled token ids to the workers."""
        self.group.broadcast_from_first(token_ids)

    # ------------------------------------------------------------ control

    @property
    def has_control(self) -> bool:
        """True when the workers run a rank service (a control socket each)."""
        return self._control.size > 0

    @property
    def control_sent(self) -> tuple[int, ...]:
        """Control messages sent to each worker so far, rank 1 first."""
        return self._control.sent

    def control_send(self, rank: int, kind: int, fields: dict, payload: bytes = b"") -> int:
        """Any thread: one message to worker `rank` (1..N-1); returns its
        sequence number on that worker's channel. Every step sent after this
        returns runs on that worker only once the message was applied.
        TensorParallelError when the worker is gone."""
        self.check()
        try:
            return self._control.send(rank, kind, fields, payload)
        except OSError as exc:
            raise self.explain(exc) from exc

    def on_control(self, handler: ControlHandler) -> None:
        """`handler(rank, kind, fields, payload)` gets every message a worker
        sends, on that worker's control reader thread (`ControlHub.on_control`)."""
        self._control.on_control(handler)

    # ------------------------------------------------------------ failure

    @property
    def failure(self) -> str | None:
        """Why the pod cannot step any more, or None."""
        return self._failure

    def check(self) -> None:
        """TensorParallelError once the pod failed (a worker died, a
        collective failed)."""
        if self._failure is not None:
            raise TensorParallelError(self._failure)

    def on_failure(self, callback: Callable[[], object]) -> None:
        """`callback()` runs on the watchdog thread when a worker dies (at
        once if one has)."""
        with self._lock:
            self._listeners.append(callback)
            failed = self._failure is not None
        if failed:
            callback()

    def explain(self, exc: BaseException) -> TensorParallelError:
        """The error to raise for `exc`, a failed collective or send on rank
        0: the worker's exit when one exited (waiting briefly for the
        watchdog to see it), else a collective that failed or timed out."""
        deadline = time.monotonic() + EXPLAIN_WAIT_S
        while self._failure is None and time.monotonic() < deadline:
            self._poll()
            if self._failure is None:
                time.sleep(WATCHDOG_PERIOD_S / 2)
        reason = self._failure or (
            f"a tensor-parallel collective failed ({type(exc).__name__}: {exc}); a rank "
            f"that stalls past tp_timeout_s fails it")
        self._fail(reason)
        return TensorParallelError(reason)

    def _watch(self) -> None:
        while not self._closing and self._failure is None:
            self._poll()
            time.sleep(WATCHDOG_PERIOD_S)

    def _poll(self) -> None:
        for rank, process in enumerate(self._processes, start=1):
            returncode = process.poll()
            if returncode is not None and not self._closing:
                self._fail(f"tensor-parallel rank {rank} (pid {process.pid}) exited: "
                           f"{describe_exit(returncode)}")
                return

    def _fail(self, reason: str) -> None:
        """Record the first failure, kill every worker still running, tell
        the listeners."""
        with self._lock:
            if self._failure is not None or self._closing:
                return
            self._failure = reason
            listeners = list(self._listeners)
        log.error("%s; taking the pod down", reason)
        self._kill()
        for callback in listeners:
            callback()

    # ------------------------------------------------------------ close

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop every worker (STOP, then SIGKILL after `timeout`) and leave
        the group. Idempotent; any thread but the forward's."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self._failure is None:
            stop = stop_message(self.encoder.num_steps)
            for sock in self._sockets:
                try:
                    send(sock, stop)
                except OSError:
                    pass  # gone already: waited for below
        deadline = time.monotonic() + timeout
        for process in self._processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker pid %d did not stop; killing it", process.pid)
        self._kill()
        for sock in self._sockets:
            sock.close()
        self._control.close()
        for reader in self._readers:
            reader.join(timeout)
        if self.group is not None:
            self.group.destroy()
            self.group = None
        if self._placement is not None:
            restore(self._placement)
            self._placement = None

    def _kill(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.kill()
        for process in self._processes:
            process.wait()


def build_first_rank(config: EngineConfig, layer_kv_hook: LayerKVHook | None
                     ) -> tuple[TPLeader, RankModel]:
    """Rank 0 at start (`LLMEngine.__init__`): the workers started and the
    group joined (TP > 1), then its own shard, KV cache and runner built
    beside theirs. A failure on any rank stops them all and raises."""
    if config.tensor_parallel_size == 1:
        return TPLeader(), build_rank(config, None, layer_kv_hook=layer_kv_hook,
                                      async_inputs=config.use_async_scheduling)
    leader = TPLeader.start(config, eager=layer_kv_hook is not None)
    try:
        return leader, build_rank(config, leader.group, layer_kv_hook=layer_kv_hook,
                                  async_inputs=config.use_async_scheduling)
    except BaseException as exc:
        reason = leader.explain(exc)  # a worker that failed to load, say
        leader.close(timeout=0)
        raise reason from exc
