"""`tokens_message`: the decode pod's `DecodeTokens` stream messages, built
from engine outputs by `DecodeServicer` on the pod's event loop."""

from __future__ import annotations

from engine.outputs import RequestOutput
from pod.messages import logprob_to_proto
from proto import pdserve_pb2


def tokens_message(output: RequestOutput, first_index: int) -> pdserve_pb2.DecodeGenerateResponse:
    """One engine output as a `DecodeTokens` stream message; `first_index` is
    the output index of `output.new_token_ids[0]` (0 = first generated token)."""
    return pdserve_pb2.DecodeGenerateResponse(tokens=pdserve_pb2.DecodeTokens(
        first_index=first_index,
        token_ids=list(output.new_token_ids),
        logprobs=[logprob_to_proto(lp) for lp in output.new_logprobs],
        finish_reason=output.finish_reason or "",
        num_prompt_tokens=output.num_prompt_tokens,
        num_cached_tokens=output.num_cached_tokens,
        prompt_logprobs=[logprob_to_proto(lp) for lp in output.prompt_logprobs or ()],
    ))
