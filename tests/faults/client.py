"""The client side of the fault tests: one streamed Router.Generate, reporting
either the tokens or the error it ended with, and how long it took."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc


@dataclass(frozen=True)
class Outcome:
    tokens: list[int]
    error: grpc.RpcError | None
    seconds: float

    def describe(self) -> str:
        if self.error is None:
            return f"{len(self.tokens)} tokens in {self.seconds:.2f}s"
        return f"{self.error.code().name}: {self.error.details()} after {self.seconds:.2f}s"


def generate(router_grpc: str, prompt: str | Sequence[int], max_tokens: int, timeout: float,
             on_tokens: Callable[[int], None] | None = None) -> Outcome:
    """Greedy, no EOS stop; a failure is returned, not raised. `prompt` is
    text or token ids. `on_tokens(n)` is called with the number of tokens
    received after each message."""
    tokens: list[int] = []
    started = time.monotonic()
    with grpc.insecure_channel(router_grpc) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        request = (pb.GenerateRequest(prompt=prompt, sampling=sampling) if isinstance(prompt, str)
                   else pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling))
        try:
            for message in stub.Generate(request, timeout=timeout):
                tokens.extend(message.token_ids)
                if on_tokens is not None:
                    on_tokens(len(tokens))
        except grpc.RpcError as exc:
            return Outcome(tokens, exc, time.monotonic() - started)
    return Outcome(tokens, None, time.monotonic() - started)
