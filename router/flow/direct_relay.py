"""`DeltaSink`: where the direct relay writes a request's deltas.

The request's task relays a decode pod's tokens by pulling them: the
session's reader queues an event, wakes the task, and the delta climbs the
flow's generators (attempt, verdict, flow) to the handler that writes it.
That costs a future, a task switch and a generator resume per level, per
token. Once a request is decoding steadily, `Attempt` instead gives its
`StreamCall` a relay callback: an event that arrives while the task sits
idle in `read()` (so everything before it is written already) is put
through the assembler and written to the client by the session's reader
itself, in the same loop iteration (docs/router.md, "Relay"). A plain
batch goes from the assembler to the sink as text, with no `Delta` built.

The task keeps every case that is not plain: the first decode delta
(until then a failed transfer verdict still wins), the final one, stop
strings, logprobs, a stream that repeats or skips indices, a client whose
socket is not keeping up (`ready()` False: the task's write waits for
the socket to drain), and errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class DeltaSink(Protocol):
    """One client stream, written synchronously on the event loop."""

    def ready(self) -> bool:
        """True when `send_text` may write now (the stream is open and its
        socket's buffer is below the high-water mark)."""

    def send_text(self, text: str, token_ids: Sequence[int]) -> None:
        """Write a plain delta to the client: `text` ("" when the tokens
        complete no character yet) of output tokens `token_ids`; never the
        first or the final delta, never logprobs."""
