"""The sweeper: a daemon thread that sweeps transfer tables on a fixed period (the
"garbage collector" of DESIGN.md; named apart from the stdlib `gc` and from
Prometheus's `Collector`).

Receivers use it to fail transfers past their deadline and to free landing
buffers nobody released within the claim grace period; senders use it to fail
outcomes whose verdict never came. The sweep function runs on the sweeper's
own thread; it must not block on the network.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Sweeper:
    def __init__(self, sweep: Callable[[float], None], interval_s: float, name: str) -> None:
        if not 0 < interval_s <= 60:
            raise ValueError(f"collector interval must be in (0, 60] seconds, got {interval_s}")
        self._sweep = sweep
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._sweep(time.time())
            except Exception:  # a sweep bug must not stop collection forever
                log.exception("kv_transfer collector sweep failed")
