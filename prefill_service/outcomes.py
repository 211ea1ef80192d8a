"""One request's transfer outcome from several: a prefill rank's own
transfers (one per decode rank it sends to) and, on rank 0, every worker's
OUTCOME. The first failure decides at once (the request cannot complete
once any part of its KV is lost); COMPLETE only when every part is."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError

from kv_transfer.base import TransferOutcome


def first_failure(parts: Sequence[Future[TransferOutcome]],
                  on_failure: Callable[[str], object] | None = None
                  ) -> Future[TransferOutcome]:
    """A future resolving with the first failed part's outcome as soon as
    one fails, else COMPLETE once every part completed. `on_failure(reason)`
    runs once, on the thread that resolved the failing part (to abort the
    other parts). A part that raised counts as failed with its exception."""
    result: Future[TransferOutcome] = Future()
    if not parts:
        result.set_result(TransferOutcome.complete())
        return result
    lock = threading.Lock()
    left, decided = [len(parts)], [False]

    def settle(part: Future[TransferOutcome]) -> None:
        try:
            outcome = part.result()
        except Exception as exc:  # noqa: BLE001 - a part that raised is a failed part
            outcome = TransferOutcome.failed(f"{type(exc).__name__}: {exc}")
        with lock:
            left[0] -= 1
            if decided[0] or (outcome.ok and left[0]):
                return
            decided[0] = True
        try:
            result.set_result(outcome)  # outside the lock: its callbacks run here
        except InvalidStateError:  # the awaiting RPC gave up (cancelled): nobody waits
            pass
        if not outcome.ok and on_failure is not None:
            on_failure(outcome.reason)

    for part in parts:
        part.add_done_callback(settle)
    return result
