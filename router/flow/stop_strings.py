"""`StopMatcher`: stop strings honoured across token (and delta) boundaries.

The router detokenizes in the disaggregated path, so it is the one that
stops on a stop string (docs/architecture.md): the `OutputAssembler`
(router.flow.output) feeds every piece of new text to `push()` and sends the
client only what it returns.
Text that could still become the start of a stop string is held back until
the next piece decides it; at the end `flush()` releases it.

Invariant: the text held back is the longest suffix of everything pushed
that is a proper prefix of some stop string. So a match can never start
inside text already released, and searching from the release point finds
the earliest match.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.sampling import check_stop_strings


class StopMatcher:
    """One per request; used from the request's task only."""

    def __init__(self, stops: Sequence[str]) -> None:
        check_stop_strings(stops)  # SamplingError (a ValueError), as for a client's request
        self._stops = tuple(stops)
        self._pending = ""
        self.stopped = False

    @property
    def has_stops(self) -> bool:
        return bool(self._stops)

    def push(self, text: str) -> str:
        """Add new text; return the part safe to show. After a match, `stopped`
        is True, the returned text ends right before the stop string, and
        further pushes return ''."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buffer = self._pending + text
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return buffer[: min(hits)]
        hold = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), hold, -1):
                if buffer.endswith(stop[:n]):
                    hold = n
                    break
        self._pending = buffer[len(buffer) - hold:] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """The held-back text, released when generation ended without a match."""
        text, self._pending = ("" if self.stopped else self._pending), ""
        return text
