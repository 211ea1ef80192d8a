"""`InputLimits`: how much input one request may carry, derived from the
context limit, so the router refuses what cannot fit *before* paying for it.

Built once by `RouterServer.start` from the resolved `max_model_len` and
shared by both front doors (read-only, any task):

* `max_prompt_chars` = max_model_len x `MAX_CHARS_PER_TOKEN`. A text prompt
  (chat: the characters of every message's content) longer than this is
  refused with 400 before it is tokenized: its tokens would have to average
  more than `MAX_CHARS_PER_TOKEN` characters to fit the context, which
  natural text (3-5 characters per token) never does. Input that really is
  made of such long tokens (a long run of one repeated character) can be
  sent as token ids.
* `max_body_bytes` (HTTP) = max_model_len x `MAX_BODY_BYTES_PER_TOKEN` +
  `BODY_OVERHEAD_BYTES`: every request the character limit accepts fits,
  even with every character JSON-escaped as a surrogate pair
  (`"\\ud83d\\ude00"`, 12 bytes for one character; the official `openai`
  client escapes all non-ASCII text) and with the other fields in the
  overhead. A body over it is refused with 413 while it is read, so the
  router never holds more than this per request.
* `max_json_depth`: OpenAI bodies nest 4 levels deep (body -> messages ->
  message -> content parts); a deeper body is refused with 400 before it is
  parsed, so a hostile one cannot exhaust the parser's recursion.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.api_error import bad_request
from router.generation import ParsedRequest

MAX_CHARS_PER_TOKEN = 32
# The longest JSON spelling of one character: a surrogate pair, \\uXXXX\\uXXXX.
MAX_JSON_BYTES_PER_CHAR = 12
MAX_BODY_BYTES_PER_TOKEN = MAX_CHARS_PER_TOKEN * MAX_JSON_BYTES_PER_CHAR
BODY_OVERHEAD_BYTES = 64 * 1024
MAX_JSON_DEPTH = 64


@dataclass(frozen=True, slots=True)
class InputLimits:
    """Per-request input limits; see the module docstring for the derivation."""

    max_prompt_chars: int
    max_body_bytes: int
    max_json_depth: int = MAX_JSON_DEPTH

    def __post_init__(self) -> None:
        if self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_json_depth < 1:
            raise ValueError(f"max_json_depth must be >= 1, got {self.max_json_depth}")

    @classmethod
    def for_context(cls, max_model_len: int) -> InputLimits:
        """The limits for a model with a context of `max_model_len` tokens."""
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        return cls(max_prompt_chars=max_model_len * MAX_CHARS_PER_TOKEN,
                   max_body_bytes=max_model_len * MAX_BODY_BYTES_PER_TOKEN + BODY_OVERHEAD_BYTES)

    def check_prompt_chars(self, parsed: ParsedRequest, max_model_len: int) -> int:
        """400 when the prompt text cannot fit the context (before tokenizing);
        returns its characters (0 for token ids: fit_context counts those)."""
        if parsed.prompt is not None:
            chars, field = len(parsed.prompt), "prompt"
        elif parsed.messages:
            chars, field = sum(len(m.content or "") for m in parsed.messages), "messages"
        else:
            return 0
        if chars > self.max_prompt_chars:
            what = "'prompt'" if field == "prompt" else "the messages' content"
            raise bad_request(
                f"{what} has {chars} characters, over the limit of {self.max_prompt_chars} "
                f"(max_model_len {max_model_len} x {MAX_CHARS_PER_TOKEN} characters per "
                "token): it cannot fit the context", field)
        return chars
