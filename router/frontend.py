"""`Frontend`: what the HTTP and gRPC front doors share.

Built once by `router.server.RouterServer`; its methods run on the router's
event loop, called by the handlers in router.http.server and
router.grpc_server. It turns a validated `ParsedRequest` into a tokenized
`GenerationRequest` (tokenize once — the chat template is applied here — and
check the context limit), and starts a `RequestFlow` for it.
"""

from __future__ import annotations

import time
import uuid

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from router.api_error import bad_request
from router.flow.deps import FlowDeps
from router.flow.request_flow import RequestFlow
from router.generation import GenerationRequest, ParsedRequest
from router.sampling import fit_context


class Frontend:
    """Tokenizer + limits + flow factory for one served model."""

    def __init__(
        self,
        *,
        model_name: str,
        max_model_len: int,
        tokenizer: Tokenizer,
        deps: FlowDeps,
    ) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.deps = deps
        self.created = int(time.time())

    def tokenize(self, parsed: ParsedRequest) -> list[int]:
        """The prompt's token ids; ApiError 400 when the template or the ids are bad."""
        if parsed.prompt_token_ids is not None:
            vocab = self.tokenizer.vocab_size
            bad = [t for t in parsed.prompt_token_ids if t >= vocab]
            if bad:
                raise bad_request(
                    f"'prompt' token id {bad[0]} is outside the vocabulary (size {vocab})",
                    "prompt",
                )
            return list(parsed.prompt_token_ids)
        if parsed.kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in parsed.messages]
            try:
                return self.tokenizer.encode_chat(messages)
            except ValueError as exc:
                raise bad_request(str(exc), "messages") from None
        assert parsed.prompt is not None
        return self.tokenizer.encode(parsed.prompt)

    def prepare(self, parsed: ParsedRequest, session_id: str | None) -> GenerationRequest:
        """Tokenize and check limits; raise ApiError 400 on any problem."""
        token_ids = self.tokenize(parsed)
        sampling = fit_context(parsed.sampling, chat=parsed.kind == "chat",
                               num_prompt_tokens=len(token_ids),
                               max_model_len=self.max_model_len)
        return GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=tuple(token_ids),
            sampling=sampling,
            session_id=session_id or parsed.user,
        )

    def flow(self, request: GenerationRequest) -> RequestFlow:
        return RequestFlow(
            request, deps=self.deps, detokenizer=IncrementalDetokenizer(self.tokenizer)
        )

    def token_text(self, token_id: int) -> str:
        """One token's text, for logprobs (special tokens shown, not skipped)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
