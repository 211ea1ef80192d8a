"""The prompt in completion responses (router.http.echo through
ResponseShaper): echo's text and logprobs, vLLM's prompt_logprobs, streamed
and whole."""

from __future__ import annotations

import json

from router.generation import Delta, OutputLogprobs, Usage
from router.http.echo import EchoPrompt, echo_prompt
from router.http.responses import ResponseShaper

USAGE = Usage(prompt_tokens=3, completion_tokens=1)
PROMPT = EchoPrompt(echo=True, text="abc", token_ids=(7, 8, 9), token_texts=("a", "b", "c"))
# prompt tokens 8 and 9, scored; 9 is outside the top 1 at its position
ENTRIES = (OutputLogprobs(8, -0.5, (8, 3), (-0.5, -1.5)),
           OutputLogprobs(9, -2.0, (4, 5), (-0.25, -1.0)))
OUTPUT = OutputLogprobs(6, -0.1, (6,), (-0.1,))


def _shaper(**kw):
    return ResponseShaper(kind="completion", response_id="x", model="tiny", created=1,
                          token_text=lambda t: f"<{t}>", **kw)


def test_echo_with_logprobs_puts_the_prompt_first():
    s = _shaper(top_logprobs=1, prompt=PROMPT)
    s.collect(Delta(text="d", token_ids=(6,), logprobs=(OUTPUT,), prompt_logprobs=ENTRIES))
    s.collect(Delta(text="", finish_reason="length", usage=USAGE))
    (choice,) = s.final_body("length", USAGE)["choices"]
    assert choice["text"] == "abcd"
    assert choice["logprobs"] == {
        "tokens": ["a", "b", "c", "<6>"],
        "token_logprobs": [None, -0.5, -2.0, -0.1],
        # the top 1 and the prompt token itself
        "top_logprobs": [None, {"<8>": -0.5, "b": -0.5}, {"<4>": -0.25, "c": -2.0},
                         {"<6>": -0.1}],
        "text_offset": [0, 1, 2, 3],
    }
    assert "prompt_logprobs" not in choice


def test_echo_streams_the_prompt_in_the_first_chunk_only():
    s = _shaper(prompt=PROMPT)
    first = s.event(Delta(text="d", token_ids=(6,)))
    assert json.loads(first[6:])["choices"][0]["text"] == "abcd"
    # the direct relay's text alone, had it come first, would carry the prompt too
    assert json.loads(_shaper(prompt=PROMPT).text_event("d")[6:])["choices"][0]["text"] == "abcd"
    second = s.event(Delta(text="e", token_ids=(6,)))
    assert json.loads(second[6:])["choices"][0]["text"] == "e"
    # max_tokens 0: the one (final) chunk has the prompt
    only = _shaper(prompt=PROMPT).chunk(Delta(text="", finish_reason="length", usage=USAGE,
                                              prompt_logprobs=ENTRIES))
    assert only["choices"][0]["text"] == "abc" and only["choices"][0]["logprobs"] is None


def test_vllm_prompt_logprobs_without_echo():
    prompt = EchoPrompt(echo=False, text="", token_ids=(7, 8, 9), token_texts=("a", "b", "c"))
    s = _shaper(prompt=prompt, prompt_logprobs=1)
    chunk = s.chunk(Delta(text="d", token_ids=(6,), prompt_logprobs=ENTRIES))
    (choice,) = chunk["choices"]
    assert choice["text"] == "d"
    assert choice["prompt_logprobs"] == [
        None,
        {"8": {"logprob": -0.5, "rank": 1, "decoded_token": "<8>"}},
        {"9": {"logprob": -2.0, "rank": None, "decoded_token": "c"},
         "4": {"logprob": -0.25, "rank": 1, "decoded_token": "<4>"}},
    ]


def test_one_token_prompt_and_echo_prompt():
    one = EchoPrompt(echo=True, text="a", token_ids=(7,), token_texts=("a",))
    s = _shaper(top_logprobs=0, prompt=one)
    s.collect(Delta(text="", finish_reason="length", usage=USAGE, prompt_logprobs=()))
    (choice,) = s.final_body("length", USAGE)["choices"]
    assert choice["logprobs"]["token_logprobs"] == [None] and choice["text"] == "a"
    built = echo_prompt(True, None, [1, 2], lambda ids: "x" * len(ids), lambda t: str(t))
    assert (built.text, built.token_texts) == ("xx", ("1", "2"))
    assert echo_prompt(False, "hi", [1], str, str).text == ""
