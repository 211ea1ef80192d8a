"""Offline use of an engine (`LLMEngine.generate`): a batch of prompts run to
completion on the caller's thread. Text and stop strings come from the model
directory's tokenizer when it has one (`TextStream`): a request whose text
contains a stop string is aborted there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from engine.outputs import GenerationResult, RequestOutput
from engine.sampling_params import SamplingParams
from engine.text_stream import TextStream


class SteppedEngine(Protocol):
    """What `generate_batch` drives (an `LLMEngine`)."""

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def abort_request(self, request_id: str) -> bool: ...


def generate_batch(engine: SteppedEngine, prompts: list[list[int]],
                   sampling_params: SamplingParams | Sequence[SamplingParams], *,
                   tokenizer: Any, request_ids: Iterator[str]) -> list[GenerationResult]:
    """Add every prompt (ids from `request_ids`), step until all are done, and
    return one result per prompt, in order. `tokenizer` (None: no text)."""
    params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
              else list(sampling_params))
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    streams: dict[str, TextStream] = {}
    for prompt, p in zip(prompts, params, strict=True):
        request_id = next(request_ids)
        engine.add_request(request_id, prompt, p)
        streams[request_id] = TextStream(request_id, tuple(prompt), p, tokenizer)
    while engine.has_unfinished_requests():  # also drains a step still in flight
        for output in engine.step():
            stream = streams.get(output.request_id)
            if stream is None or stream.finish_reason is not None:
                continue
            if stream.add(output):  # a stop string matched: the text is final
                engine.abort_request(output.request_id)
    return [s.result() for s in streams.values()]


def model_dir_tokenizer(model_dir: str) -> Any:
    """The model directory's tokenizer, or None when it has no tokenizer.json."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return None
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(model_dir)
