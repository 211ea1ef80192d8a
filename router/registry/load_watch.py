"""`LoadWatch`: one pod's `WatchLoad` stream, held open by the router's pod
pool (router/registry/poller.py) instead of polling the pod's `GetLoad`.

The pod pushes a `LoadReport` at once, on every change (at most one per
`min_interval`) and as a heartbeat (at least one per `max_interval`;
pod/load.py). The watch hands each report to the pool and says when the
stream ends and why; the pool decides what that means for the pod's state:

* a report: applied as a successful poll's would be;
* UNIMPLEMENTED: an older pod without the RPC (a rolling upgrade): the pool
  polls it as before, for as long as it lives;
* any other end (the pod crashed, restarted, drained, or the connection
  broke): the pool polls it at its next interval, and opens a new watch once
  a poll succeeds;
* silence past `stale_after` (a stuck pod, a half-open connection): the
  pool's next round sees `stale()` and treats it as a slow poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from proto import pdserve_pb2, pdserve_pb2_grpc

log = logging.getLogger(__name__)


class LoadWatch:
    """One `WatchLoad` call on `channel` (a role's stub), run as a task on the
    router's event loop. `on_report(report)` per report; `on_end(reason,
    unsupported)` once, when the stream ends other than by `cancel()`."""

    def __init__(self, channel: grpc.aio.Channel, role: str, *, min_interval: float,
                 max_interval: float, on_report: Callable[[pdserve_pb2.LoadReport], None],
                 on_end: Callable[[str, bool], None]) -> None:
        stub_class = (pdserve_pb2_grpc.PrefillStub if role == "prefill"
                      else pdserve_pb2_grpc.DecodeStub)
        self._method = stub_class(channel).WatchLoad
        self._request = pdserve_pb2.WatchLoadRequest(min_interval_s=min_interval,
                                                     max_interval_s=max_interval)
        # a heartbeat may be late by one change check and a busy router loop
        self.stale_after = 2 * max_interval + min_interval + 1.0
        self._on_report, self._on_end = on_report, on_end
        self.last_report_at = time.monotonic()
        self.reports = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.last_report_at = time.monotonic()
        self._task = asyncio.create_task(self._run(), name="pod-load-watch")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def stale(self, now: float) -> bool:
        """Whether the pod has been silent past its heartbeat deadline."""
        return now - self.last_report_at > self.stale_after

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        call = self._method(self._request)
        try:
            async for report in call:
                self.last_report_at = time.monotonic()
                self.reports += 1
                self._on_report(report)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code is grpc.StatusCode.CANCELLED:
                return
            self._on_end(f"load stream {code.name} {exc.details()}",
                         code is grpc.StatusCode.UNIMPLEMENTED)
            return
        except Exception as exc:  # a report handler's bug must not kill the loop silently
            log.exception("load watch failed")
            self._on_end(f"load stream failed: {exc!r}", False)
            return
        self._on_end("load stream ended", False)
