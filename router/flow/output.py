"""`OutputAssembler`: one request's output as the client sees it.

`router.flow.pod_caller.PodCaller` feeds it every batch of tokens a pod reports, tagged with the
output index of its first token (`first_index`). The assembler keeps the
client stream exact across retries and migrations:

* tokens it already has (index below `len(output_ids)`) are dropped, so a
  pod that repeats tokens after a move never duplicates text;
* a batch that starts past the next index is a gap: `OutputGap` is raised
  and the flow treats the pod as failed (it moves the request on);
* accepted tokens are detokenized incrementally, then run through the stop
  matcher; the returned `Delta` holds only text safe to show;
* prompt logprobs (the first pod that computed the prompt reports them;
  `set_prompt_logprobs`) ride on the next delta, once.

Used on the event loop only: by the request's task, and by the direct
relay (router.flow.direct_relay) while that task waits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from router.flow.stop_strings import StopMatcher
from router.generation import Delta, OutputLogprobs, Usage


class Detokenizer(Protocol):
    """engine.detokenizer.IncrementalDetokenizer's interface."""

    def add(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class OutputGap(Exception):
    """A pod reported tokens starting past the next expected index."""


class OutputAssembler:
    """Accepts indexed token batches; produces deltas and the final usage."""

    def __init__(
        self,
        *,
        detokenizer: Detokenizer,
        stop: Sequence[str],
        num_prompt_tokens: int,
    ) -> None:
        self._detokenizer = detokenizer
        self._matcher = StopMatcher(stop)
        self._num_prompt_tokens = num_prompt_tokens
        self.output_ids: list[int] = []
        # Real prefix-cache hits for the client's prompt; the first pod to
        # compute it reports them (a later migration's count covers output too).
        self.cached_tokens: int | None = None
        # prompt logprobs: received (a later pod's copy is dropped); not yet sent
        self.has_prompt_logprobs = False
        self._unsent_prompt_logprobs: tuple[OutputLogprobs, ...] | None = None

    @property
    def next_index(self) -> int:
        return len(self.output_ids)

    @property
    def has_stops(self) -> bool:
        """The request has stop strings (its text may be held back or cut)."""
        return self._matcher.has_stops

    @property
    def stopped(self) -> bool:
        """A stop string matched: the flow must end the request with "stop"."""
        return self._matcher.stopped

    def set_cached_tokens(self, num_cached_tokens: int) -> None:
        if self.cached_tokens is None:
            self.cached_tokens = min(max(num_cached_tokens, 0), self._num_prompt_tokens)

    def set_prompt_logprobs(self, entries: tuple[OutputLogprobs, ...]) -> None:
        """The prompt's logprobs from the pod that computed it (the first one
        only: a migrated request's next pod may compute them again)."""
        if not self.has_prompt_logprobs:
            self.has_prompt_logprobs = True
            self._unsent_prompt_logprobs = entries

    def _take_prompt_logprobs(self) -> tuple[OutputLogprobs, ...] | None:
        entries, self._unsent_prompt_logprobs = self._unsent_prompt_logprobs, None
        return entries

    def accept(
        self,
        first_index: int,
        token_ids: Sequence[int],
        logprobs: Sequence[OutputLogprobs] = (),
    ) -> Delta | None:
        """Take a batch from a pod; return the delta to send, or None when
        the batch held nothing new. Raises OutputGap on a gap."""
        if first_index > self.next_index:
            raise OutputGap(
                f"pod sent tokens from index {first_index} but the next expected is "
                f"{self.next_index}"
            )
        skip = self.next_index - first_index
        new_ids = tuple(token_ids[skip:])
        if not new_ids or self.stopped:
            return None
        new_logprobs = tuple(logprobs[skip:]) if len(logprobs) == len(token_ids) else ()
        self.output_ids.extend(new_ids)
        text = self._matcher.push(self._detokenizer.add(new_ids))
        return Delta(text=text, token_ids=new_ids, logprobs=new_logprobs,
                     prompt_logprobs=self._take_prompt_logprobs())

    @property
    def plain(self) -> bool:
        """Every further batch is text alone: no stop strings to hold text
        back, no prompt logprobs left to send (what `accept_text` needs)."""
        return not self._matcher.has_stops and self._unsent_prompt_logprobs is None

    def accept_text(self, token_ids: Sequence[int]) -> str:
        """`accept` for the direct relay (router.flow.direct_relay): a batch
        that starts at `next_index`, while `plain`; returns its text (maybe
        "": a character still partial) without building a `Delta`."""
        self.output_ids.extend(token_ids)
        return self._detokenizer.add(token_ids)

    def finish(self, finish_reason: str) -> Delta:
        """The final delta: held-back text, the finish reason and usage."""
        if self.stopped:
            text, finish_reason = "", "stop"
        else:
            text = self._matcher.push(self._detokenizer.flush())
            text += self._matcher.flush()
            if self.stopped:
                finish_reason = "stop"
        usage = Usage(
            prompt_tokens=self._num_prompt_tokens,
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens or 0,
        )
        return Delta(text=text, finish_reason=finish_reason, usage=usage,
                     prompt_logprobs=self._take_prompt_logprobs())


def logprobs_from_proto(messages: Iterable) -> tuple[OutputLogprobs, ...]:
    """pdserve.v1.TokenLogprob messages -> OutputLogprobs."""
    return tuple(
        OutputLogprobs(m.token_id, m.logprob, tuple(m.top_token_ids), tuple(m.top_logprobs))
        for m in messages
    )


def fold_final(delta: Delta | None, final: Delta) -> Delta:
    """Fold the last batch's delta into the final one, so the client gets
    the last text and the finish reason in one message."""
    if delta is None:
        return final
    return Delta(
        text=delta.text + final.text,
        token_ids=delta.token_ids,
        logprobs=delta.logprobs,
        finish_reason=final.finish_reason,
        usage=final.usage,
        prompt_logprobs=(delta.prompt_logprobs if delta.prompt_logprobs is not None
                         else final.prompt_logprobs),
    )
