"""`decode_service.messages`: the decode pod's token stream messages."""

from __future__ import annotations

from decode_service.messages import tokens_message
from engine.outputs import RequestOutput, TokenLogprobs


def test_tokens_message_carries_index_logprobs_and_reason():
    output = RequestOutput("r", (7, 8), (TokenLogprobs(7, -0.5, (7, 2), (-0.5, -1.5)),
                                         TokenLogprobs(8, -0.25, (8,), (-0.25,))),
                           "length", num_prompt_tokens=12, num_cached_tokens=4,
                           num_output_tokens=5)
    tokens = tokens_message(output, first_index=3).tokens
    assert (tokens.first_index, list(tokens.token_ids), tokens.finish_reason) == (3, [7, 8],
                                                                                  "length")
    assert (tokens.num_prompt_tokens, tokens.num_cached_tokens) == (12, 4)
    assert [(lp.token_id, lp.logprob, list(lp.top_token_ids)) for lp in tokens.logprobs] == [
        (7, -0.5, [7, 2]), (8, -0.25, [8])]
