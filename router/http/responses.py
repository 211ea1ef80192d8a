"""OpenAI response bodies and SSE chunks, built from the flow's `Delta`s.

Used by router.http.server on the event loop: one `ResponseShaper` per
request. Shapes follow OpenAI's API exactly (field names, `object` values,
`usage.prompt_tokens_details.cached_tokens`, `data: [DONE]`), so the official
client and tools written against it parse them unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.generation import Delta, OutputLogprobs, ToolCallDelta, Usage
from router.http.echo import EchoPrompt, echo_logprobs, vllm_prompt_logprobs

DONE_EVENT = b"data: [DONE]\n\n"
_TEXT_SLOT = "\x01pdserve-text\x01"  # stands for the text while the event template is built
# json.dumps(text) of a str is this function's result (ensure_ascii, the default),
# without dumps' encoder set-up: text_event calls it once per relayed token
_json_string = json.encoder.encode_basestring_ascii


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass(slots=True)
class _Collected:
    """What a non-streaming response accumulates over the deltas."""

    text: list[str] = field(default_factory=list)
    logprobs: list[OutputLogprobs] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # by index
    prompt_logprobs: tuple[OutputLogprobs, ...] | None = None


def _stream_tool_call(call: ToolCallDelta) -> dict[str, Any]:
    """A `delta.tool_calls` entry: id, type and name only in a call's first one."""
    entry: dict[str, Any] = {"index": call.index}
    function: dict[str, Any] = {"arguments": call.arguments}
    if call.id is not None:
        entry.update(id=call.id, type="function")
        function = {"name": call.name, "arguments": call.arguments}
    entry["function"] = function
    return entry


def token_id_text(token_id: int) -> str:
    """A token as `return_tokens_as_token_ids` shows it in logprobs (vLLM's
    form): its id, so a client without the tokenizer can send it back."""
    return f"token_id:{token_id}"


class ResponseShaper:
    """Builds the chunks and the final body of one completion or chat request.

    `token_text(id)` renders one token for logprobs (the tokenizer's decode
    of that id alone). `prompt` (completions with `echo` or `prompt_logprobs`
    m, router.http.echo) puts the prompt before the output of the first
    chunk (or the body). Not thread-safe; one per request, on the event loop.
    """

    def __init__(
        self,
        *,
        kind: str,
        response_id: str,
        model: str,
        created: int,
        token_text: Callable[[int], str],
        include_usage: bool = False,
        top_logprobs: int | None = None,
        index: int = 0,
        prompt: EchoPrompt | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        if kind not in ("completion", "chat"):
            raise ValueError(f"kind must be 'completion' or 'chat', got {kind!r}")
        self._kind = kind
        self._index = index  # the choice's index (n > 1: router.http.choices)
        self._id = response_id
        self._model = model
        self._created = created
        self._token_text = token_text
        self._include_usage = include_usage
        # None = logprobs off; n = show n alternatives per token
        self._top_logprobs = top_logprobs
        self._text_offset = 0
        self._collected = _Collected()
        # `event` of a text-only delta: the serialized chunk around its JSON string
        self._text_event: tuple[bytes, bytes] | None = None
        self._prompt = prompt
        self._prompt_logprobs = prompt_logprobs
        self._prompt_pending = prompt is not None  # not yet shown

    # ------------------------------------------------------------ logprobs

    def _completion_logprobs(self, entries: Sequence[OutputLogprobs]) -> Any:
        if self._top_logprobs is None:
            return None
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            text = self._token_text(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            top = zip(entry.top_token_ids[: self._top_logprobs], entry.top_logprobs, strict=False)
            tops.append({self._token_text(t): lp for t, lp in top})
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_logprobs(self, entries: Sequence[OutputLogprobs]) -> Any:
        if self._top_logprobs is None:
            return None

        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for entry in entries:
            top = zip(entry.top_token_ids[: self._top_logprobs], entry.top_logprobs, strict=False)
            alternatives = [item(t, lp) for t, lp in top]
            content.append({**item(entry.token_id, entry.logprob), "top_logprobs": alternatives})
        return {"content": content}

    def _logprobs(self, entries: Sequence[OutputLogprobs]) -> Any:
        if self._kind == "chat":
            return self._chat_logprobs(entries)
        return self._completion_logprobs(entries)

    def _with_prompt(self, choice: dict[str, Any], entries: Sequence[OutputLogprobs] | None,
                     outputs: Sequence[OutputLogprobs]) -> dict[str, Any]:
        """A completion choice with the prompt in front (once): echo's text and
        logprobs, and vLLM's `prompt_logprobs`. Sets the output's text offsets
        to start after the prompt's tokens."""
        prompt, self._prompt_pending = self._prompt, False
        assert prompt is not None
        echoed = None
        if prompt.echo:
            choice["text"] = prompt.text + choice["text"]
            if self._top_logprobs is not None:
                echoed = echo_logprobs(prompt, entries, self._top_logprobs, self._token_text)
                self._text_offset = sum(len(t) for t in prompt.token_texts)
        if echoed is not None:
            after = self._completion_logprobs(outputs)
            choice["logprobs"] = {key: echoed[key] + after[key] for key in echoed}
        if self._prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                prompt, entries, self._prompt_logprobs, self._token_text)
        return choice

    # ------------------------------------------------------------ streaming

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion.chunk" if self._kind == "chat" else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": choices,
        }
        if self._include_usage:
            payload["usage"] = None
        return payload

    def role_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role and empty content."""
        if self._kind != "chat":
            return None
        return self._envelope(
            [{"index": self._index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None}]
        )

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        """The SSE payload for one delta, or None when it carries nothing to show."""
        if (not delta.text and not delta.logprobs and delta.finish_reason is None
                and not delta.tool_calls and not self._prompt_pending):
            return None
        logprobs = self._logprobs(delta.logprobs) if delta.logprobs else None
        if self._kind == "chat":
            # the closing chunk carries an empty delta, as OpenAI's does
            message: dict[str, Any] = {"content": delta.text} if delta.text else {}
            if delta.tool_calls:
                message["tool_calls"] = [_stream_tool_call(c) for c in delta.tool_calls]
            choice: dict[str, Any] = {
                "index": self._index,
                "delta": message,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
            }
        else:
            choice = {
                "index": self._index,
                "text": delta.text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
            }
            if self._prompt_pending:
                choice = self._with_prompt(choice, delta.prompt_logprobs, delta.logprobs)
        return self._envelope([choice])

    def event(self, delta: Delta) -> bytes | None:
        """`sse_event(chunk(delta))`, or None when the delta shows nothing. Most
        deltas are text only (no logprobs, not the last); those are one JSON
        string put into a template built once per request, the same bytes
        `sse_event` would give, at a fraction of the per-token cost."""
        if not delta.text or delta.logprobs or delta.finish_reason is not None \
                or self._top_logprobs is not None or delta.tool_calls or self._prompt_pending:
            chunk = self.chunk(delta)
            return None if chunk is None else sse_event(chunk)
        return self.text_event(delta.text)

    def text_event(self, text: str) -> bytes:
        """The event of a delta that is non-empty `text` alone (the direct
        relay's, router.http.stream_sink): `event(Delta(text=text))`."""
        if self._top_logprobs is not None or self._prompt_pending:
            return sse_event(self.chunk(Delta(text=text)))
        if self._text_event is None:
            quoted = json.dumps(_TEXT_SLOT).encode()
            before, after = sse_event(self.chunk(Delta(text=_TEXT_SLOT))).split(quoted)
            self._text_event = (before, after)
        before, after = self._text_event
        return before + _json_string(text).encode() + after

    def usage_chunk(self, usage: Usage) -> dict[str, Any] | None:
        """The trailing `choices: []` chunk with usage, when the client asked for it."""
        if not self._include_usage:
            return None
        payload = self._envelope([])
        payload["usage"] = usage_body(usage)
        return payload

    # ------------------------------------------------------------ non-streaming

    def collect(self, delta: Delta) -> None:
        """Accumulate one delta for `final_body`."""
        self._collected.text.append(delta.text)
        self._collected.logprobs.extend(delta.logprobs)
        for call in delta.tool_calls:
            if call.id is not None:
                self._collected.tool_calls[call.index] = {
                    "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}
            else:
                self._collected.tool_calls[call.index]["function"]["arguments"] += call.arguments
        if delta.prompt_logprobs is not None:
            self._collected.prompt_logprobs = delta.prompt_logprobs

    def final_body(self, finish_reason: str, usage: Usage) -> dict[str, Any]:
        """The whole non-streaming response after the last delta was collected."""
        text = "".join(self._collected.text)
        logprobs = self._logprobs(self._collected.logprobs)
        if self._kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self._collected.tool_calls:
                # as OpenAI: content null when the reply is only calls
                message["content"] = text or None
                message["tool_calls"] = list(self._collected.tool_calls.values())
            choice: dict[str, Any] = {
                "index": self._index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": self._index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            if self._prompt_pending:
                choice = self._with_prompt(choice, self._collected.prompt_logprobs,
                                           self._collected.logprobs)
            obj = "text_completion"
        return {
            "id": self._id,
            "object": obj,
            "created": self._created,
            "model": self._model,
            "choices": [choice],
            "usage": usage_body(usage),
        }
