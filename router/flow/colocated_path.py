"""The colocated path: one try of a request on a colocated pod.

    colocated(): Decode.Generate(remote_prefill=false) on a colocated pod
                 (over the router's Session to it) -> tokens 0..n

The pod is the first that takes the request (`PodCaller.open_stream`: full
or unreachable pods are skipped, and pods above --max-queue-wait when the
request has no output yet, router/routing/colocated_gate.py). Run by
`router.flow.request_flow.RequestFlow` over the attempt's `PodCaller`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from router.flow.pod_caller import PodCaller
from router.generation import Delta


async def colocated(caller: PodCaller) -> AsyncIterator[Delta]:
    """A generate command (remote_prefill=false) on the colocated pod's
    Session (or Decode.Generate): tokens 0..n."""
    with contextlib.ExitStack() as stack:
        address, call, first, _ = await caller.open_stream("colocated", stack)
        async with contextlib.aclosing(caller.read_tokens(address, call, first)) as deltas:
            async for delta in deltas:
                yield delta
