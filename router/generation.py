"""The typed messages between the API layers and the request flow.

The HTTP handlers (router.http.server) and the gRPC servicer
(router.grpc_server) build one `GenerationRequest` per client request and
consume the `Delta`s that `router.flow.RequestFlow.run()` yields; the last
delta has `finish_reason` and `usage` set. All immutable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.sampling import SamplingSpec
from telemetry.context import TraceOrigin

if TYPE_CHECKING:
    from router.tools.request import ToolRequest

# "tool_calls": a chat reply that ended by calling tools (router.tools.extractor)
FINISH_REASONS = ("stop", "length", "abort", "tool_calls")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message. `content` None only on an assistant turn that calls tools;
    `tool_calls` as the template gets them (arguments an object, see
    router.tools.request.parse_message_tool_fields)."""

    role: str
    content: str | None
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as HF's apply_chat_template passes it to a template."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [dict(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated completion or chat request, prompt not yet tokenized.

    Exactly one of `prompt` (text), `prompt_token_ids` (completions with a
    token list) and `messages` (chat) carries the input. `sampling.max_tokens`
    None means "the default for this endpoint" (see `router.sampling.fit_context`).
    """

    kind: str  # "completion" | "chat"
    model: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] = ()
    sampling: SamplingSpec = SamplingSpec()
    # the body field sampling.grammar came from (guided_json, ...), for the
    # 400s that name it; None: the kind's usual name (router.structured_output)
    grammar_field: str | None = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    tools: ToolRequest | None = None  # chat only
    documents: tuple[dict[str, Any], ...] | None = None  # chat only: the template's documents
    n: int = 1  # choices: n generations of the same prompt (router.http.choices)
    # logprobs show each token as "token_id:<id>" (vLLM's return_tokens_as_token_ids):
    # a client without the tokenizer gets the exact ids, e.g. to send an answer back
    tokens_as_ids: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.kind not in ("completion", "chat"):
            raise ValueError(f"kind must be 'completion' or 'chat', got {self.kind!r}")
        inputs = (self.prompt is not None) + (self.prompt_token_ids is not None)
        inputs += bool(self.messages)
        if inputs != 1:
            raise ValueError("exactly one of prompt, prompt_token_ids, messages must be set")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One tokenized request, ready to route. `request_id` is unique per router."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    session_id: str | None = None
    # the client's trace context and API key name (telemetry.context); None: none
    trace: TraceOrigin | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if any(t < 0 for t in self.prompt_token_ids):
            raise ValueError("prompt_token_ids must be >= 0")
        if self.sampling.max_tokens is None:
            raise ValueError("sampling.max_tokens must be set (router.sampling.fit_context)")


@dataclass(frozen=True, slots=True)
class OutputLogprobs:
    """One output token's logprob and the top alternatives (most likely first),
    as the front doors show them (engine.outputs.TokenLogprobs is the pods' own)."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.top_token_ids) != len(self.top_logprobs):
            raise ValueError(
                f"top_token_ids ({len(self.top_token_ids)}) and top_logprobs "
                f"({len(self.top_logprobs)}) must have the same length"
            )


@dataclass(frozen=True, slots=True)
class Usage:
    """`cached_tokens` counts real prefix-cache hits on the pod that computed
    the prompt, not KV that was transferred."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        if min(self.prompt_tokens, self.completion_tokens, self.cached_tokens) < 0:
            raise ValueError(f"usage counts must be >= 0, got {self}")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """Part of one tool call, as an OpenAI `delta.tool_calls` entry: the
    first part of call `index` carries its `id` and `name`, later ones only
    more `arguments` text (all parts' arguments concatenate to the JSON)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class Delta:
    """New output since the previous delta.

    `text` is the detokenized text for the client (stop strings already
    removed); `token_ids` are the tokens accepted in this step. The two need
    not line up one-to-one: the detokenizer holds back incomplete characters
    and the stop matcher holds back text that may start a stop string.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[OutputLogprobs, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()  # chat with tools (router.tools.extractor)
    # Once, on the first delta, when the request asked for prompt logprobs:
    # prompt tokens 1..P-1 (router.flow.output)
    prompt_logprobs: tuple[OutputLogprobs, ...] | None = None

    def __post_init__(self) -> None:
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason must be one of {FINISH_REASONS} or None, got {self.finish_reason!r}"
            )
        if (self.finish_reason is None) != (self.usage is None):
            raise ValueError("usage is set exactly on the final delta (the one with finish_reason)")
