"""`TailWorker`: split prefills' tails computed beside the engine's steps
(docs/architecture.md, "One prompt on both pods").

A split prefill's tail waits, layer by layer, for the head's KV to arrive
from the prefill pod (engine.layer_gate). Computed inside an engine step,
those waits hold the whole step, so a running batch would stall for the
prompt's time. Here the tail's forward runs on its own thread instead:
context tokens [head, n - 1) of the request, their KV written into the
request's reserved blocks, every layer behind the head's. The engine's
steps go on decoding meanwhile (torch and the native kernels release the
GIL, so on a CPU pod the two share its cores). Once the forward is done,
the request joins the next step with one context token left: that step
computes it over the whole context and samples token 0, as any prompt's
last chunk would. A tail of that one token alone has no forward here: the
job waits for the whole head, so the step finds every layer in.

Threads: `start` and `finished` from the engine thread; the worker thread
runs one forward at a time, in the order started, and calls the job's
`on_done` after each (the engine loop's `wake`), so an idle engine loop
steps again. The forward writes only the
request's own slots, which nothing else touches until `finished` has
reported it: an abort meanwhile waits for that (LLMEngine.abort_request).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.layer_gate import HeadLost, LayerGate
from engine.paged_attention_context import PagedAttentionContext
from kernels.omp_pool import release_this_threads_pool

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TailJob:
    """One tail: the forward's inputs (input ids, positions, context; None
    for a tail of one token), who to tell when it is done (called on the
    worker thread), and what became of it."""

    request_id: str
    gate: LayerGate
    inputs: tuple[torch.Tensor, torch.Tensor, PagedAttentionContext] | None
    on_done: Callable[[], object] | None = None
    # set by the engine thread: the request was aborted while its tail ran
    aborted: bool = False
    # set by the worker: the forward ran every layer over a whole head
    ok: bool = False


class TailWorker:
    """Runs `forward(input_ids, positions, context)` for each started job."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, PagedAttentionContext],
                                         object]) -> None:
        self._forward = forward
        self._jobs: queue.SimpleQueue[TailJob] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[TailJob] = queue.SimpleQueue()
        self._running: dict[str, TailJob] = {}  # engine thread only
        self._thread: threading.Thread | None = None

    def start(self, job: TailJob) -> None:
        self._running[job.request_id] = job
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tail-worker", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def job(self, request_id: str) -> TailJob | None:
        """The request's tail while it is computed (engine thread)."""
        return self._running.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_finished(self) -> bool:
        return not self._done.empty()

    def finished(self) -> list[TailJob]:
        """Jobs done since the last call (engine thread)."""
        jobs = []
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                return jobs
            del self._running[job.request_id]
            jobs.append(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job.inputs is None:
                    job.gate.wait(job.gate.num_layers - 1)
                else:
                    self._forward(*job.inputs)
                    if job.inputs[0].is_cuda:
                        torch.cuda.current_stream().synchronize()
                job.ok = not job.gate.failed
            except HeadLost:
                job.ok = False
            except Exception:  # noqa: BLE001 - the request fails, the pod serves on
                log.exception("split prefill tail of %s failed", job.request_id)
                job.ok = False
            if self._jobs.empty():
                # idle now: its OpenMP workers would throttle the steps' (kernels/omp_pool.py)
                release_this_threads_pool()
            self._done.put(job)
            if job.on_done is not None:
                job.on_done()
