"""`Frontend`: what the HTTP and gRPC front doors share.

Built once by `router.server.RouterServer`; its methods run on the router's
event loop, called by the handlers in router.http.server and
router.grpc_server. It turns a validated `ParsedRequest` into a tokenized
`GenerationRequest` (tokenize once — the chat template is applied here — and
check the context limit), and starts a `RequestFlow` for it.

Tokenizing and rendering the chat template of a long prompt run on the
frontend's own small thread pool, never on the event loop: a long prompt
then delays only its own request, not every other client's (the tokenizer
is immutable and its Rust core thread-safe). A short one (at most
`INLINE_PROMPT_SIZE` characters or token ids, and `INLINE_MESSAGES`
messages) is tokenized inline: that takes well under a millisecond, less
than the hop to a thread and back, and keeps requests that arrive together
in the order they came. The prompt's length in characters is checked first
(`router.limits.InputLimits`), so no thread spends long on a prompt that
cannot fit the context anyway.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from router.api_error import bad_request
from router.flow.deps import FlowDeps
from router.flow.request_flow import RequestFlow
from router.generation import GenerationRequest, ParsedRequest
from router.limits import InputLimits
from router.sampling import SamplingError, check_vocabulary, fit_context
from router.structured_output import GrammarCheck
from router.tools.extractor import ToolCallExtractor
from router.tools.forced import with_call_grammar
from router.tools.request import check_served
from router.tools.select import make_parser, resolve_parser

T = TypeVar("T")

# Requests tokenized at once; more wait for a thread (the chat template is
# Python and holds the GIL, so more threads would not make it faster).
TOKENIZER_THREADS = 4
INLINE_PROMPT_SIZE = 4096
INLINE_MESSAGES = 64


class Frontend:
    """Tokenizer + limits + flow factory for one served model."""

    def __init__(
        self,
        *,
        model_name: str,
        max_model_len: int,
        tokenizer: Tokenizer,
        deps: FlowDeps,
        limits: InputLimits | None = None,
        tool_call_parser: str = "auto",
    ) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        tokenizer.byte_pieces()  # built now, not on the first stream's event loop turn
        self.deps = deps
        self.limits = limits or InputLimits.for_context(max_model_len)
        self.created = int(time.time())
        # None: the template shows no known call format (tool requests get a 400)
        self.tool_parser = resolve_parser(tool_call_parser, tokenizer.chat_template)
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS,
                                                  thread_name_prefix="router-tokenize")
        self._grammars = GrammarCheck(tokenizer)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenizer threads (CPU work a front door must keep
        off the event loop: tokenizing, parsing a large body)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    def close(self) -> None:
        """Stop the tokenizer threads (RouterServer.stop, after the servers closed)."""
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def tokenize(self, parsed: ParsedRequest) -> list[int]:
        """The prompt's token ids; ApiError 400 when the template or the ids are
        bad. Blocking: `prepare` runs it inline for a short prompt, else on the
        tokenizer threads."""
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
            check_served(parsed.tools, parsed.documents, self.tokenizer.template_variables,
                         self.tool_parser)
            messages = [m.to_template() for m in parsed.messages]
            try:
                return self.tokenizer.encode_chat(
                    messages, tools=parsed.tools.template_tools() if parsed.tools else None,
                    documents=list(parsed.documents) if parsed.documents is not None else None)
            except ValueError as exc:
                raise bad_request(str(exc), "messages") from None
        assert parsed.prompt is not None
        return self.tokenizer.encode(parsed.prompt)

    async def prepare(self, parsed: ParsedRequest, session_id: str | None) -> GenerationRequest:
        """Check the prompt's length, tokenize (a long prompt off the event
        loop) and check the context limit; compile a grammar (structured
        outputs or a forced tool call, on the same threads); raise ApiError
        400 on any problem."""
        sampling = with_call_grammar(parsed.sampling, parsed.tools, self.tool_parser,
                                     grammar_field=parsed.grammar_field)
        await self._grammars.check(
            sampling.grammar, self.run_blocking,
            field="tools" if sampling is not parsed.sampling else parsed.grammar_field)
        size = (self.limits.check_prompt_chars(parsed, self.max_model_len)
                or len(parsed.prompt_token_ids or ()))
        if size <= INLINE_PROMPT_SIZE and len(parsed.messages) <= INLINE_MESSAGES:
            token_ids = self.tokenize(parsed)
        else:
            token_ids = await self.run_blocking(self.tokenize, parsed)
        try:
            check_vocabulary(sampling, self.tokenizer.vocab_size)
        except SamplingError as exc:
            raise exc.to_api_error() from None
        sampling = fit_context(sampling, chat=parsed.kind == "chat",
                               num_prompt_tokens=len(token_ids),
                               max_model_len=self.max_model_len,
                               pod_capacity=self.pod_capacity())
        return GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=tuple(token_ids),
            sampling=sampling,
            session_id=session_id or parsed.user,
        )

    def pod_capacity(self) -> int:
        """KV tokens the largest healthy pod that decodes holds (0 before any
        pod has reported): the most one request may reserve."""
        pool = self.deps.pool
        pods = [*pool.pods("decode"), *pool.pods("colocated")]
        return max((p.num_total_blocks * p.block_size for p in pods), default=0)

    def flow(self, request: GenerationRequest) -> RequestFlow:
        return RequestFlow(
            request, deps=self.deps, detokenizer=IncrementalDetokenizer(self.tokenizer)
        )

    def tool_extractor(self, parsed: ParsedRequest) -> ToolCallExtractor | None:
        """The request's tool-call extractor; None when its output is not
        read for calls (no tools, or tool_choice "none")."""
        if parsed.tools is None or not parsed.tools.parses_calls:
            return None
        assert self.tool_parser is not None  # check_served refused the request otherwise
        max_calls = None if parsed.tools.parallel_tool_calls else 1
        return ToolCallExtractor(make_parser(self.tool_parser, max_calls=max_calls))

    def token_text(self, token_id: int) -> str:
        """One token's text, for logprobs (special tokens shown, not skipped)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
