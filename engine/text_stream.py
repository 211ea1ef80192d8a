"""`TextStream`: one request of `LLMEngine.generate()` (offline use): its
tokens, logprobs and text as they arrive, and where a stop string ends it.
Used on the caller's thread only, like `generate()` itself."""

from __future__ import annotations

from engine.outputs import GenerationResult, RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams


class TextStream:
    """One `generate()` request's accumulated tokens, logprobs and text."""

    def __init__(self, request_id: str, prompt: tuple[int, ...], params: SamplingParams,
                 tokenizer) -> None:
        from engine.detokenizer import IncrementalDetokenizer

        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(tokenizer)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: tuple[TokenLogprobs, ...] | None = None

    def add(self, output: RequestOutput) -> bool:
        """Take one step's output; True when a stop string just ended the request."""
        self.token_ids.extend(output.new_token_ids)
        self.logprobs.extend(output.new_logprobs)
        self.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.finish_reason = output.finish_reason
        if self.detokenizer is None:
            return False
        self.text += self.detokenizer.add(output.new_token_ids)
        if output.finished:
            self.text += self.detokenizer.flush()
        cut = min((i for i in (self.text.find(s) for s in self.params.stop) if i >= 0),
                  default=-1)
        if cut < 0:
            return False
        self.text = self.text[:cut]
        stopped_early = self.finish_reason is None
        self.finish_reason = "stop"
        return stopped_early

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None
        return GenerationResult(
            request_id=self.request_id, prompt_token_ids=self.prompt,
            token_ids=tuple(self.token_ids),
            text=None if self.detokenizer is None else self.text,
            finish_reason=self.finish_reason, logprobs=tuple(self.logprobs),
            num_cached_tokens=self.num_cached_tokens, prompt_logprobs=self.prompt_logprobs)
