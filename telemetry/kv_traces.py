"""The traceparents KV BEGIN frames carried, from a decode pod's receiver to its servicer.

A receiver thread that reads a BEGIN with FLAG_TRACE (kv_transfer/tcp/
receiver.py, the gRPC connector's receiver) `note`s its traceparent under
the request id; the decode servicer `take`s it once the KV is in, so the
pod's spans for a request that came over the Session stream (no per-call
metadata) join the request's trace. Only traced requests are noted; the
map is bounded, so transfers that never finish cannot grow it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_NOTED = 4096  # traced transfers in flight on one pod, far more than a pod holds

_lock = threading.Lock()
_noted: OrderedDict[str, str] = OrderedDict()


def note(request_id: str, traceparent: str) -> None:
    """A BEGIN for `request_id` carried `traceparent` ("" = none: ignored)."""
    if not traceparent:
        return
    with _lock:
        _noted[request_id] = traceparent
        _noted.move_to_end(request_id)
        while len(_noted) > MAX_NOTED:
            _noted.popitem(last=False)


def take(request_id: str) -> str:
    """The traceparent noted for `request_id`, forgotten now; "" when none."""
    if not _noted:  # the common case with tracing off: no lock
        return ""
    with _lock:
        return _noted.pop(request_id, "")
