"""OpenAI response shapes: chunks, final bodies, usage, logprobs."""

from __future__ import annotations

import json

import pytest

from router.generation import Delta, OutputLogprobs, Usage
from router.http.responses import DONE_EVENT, ResponseShaper, sse_event, usage_body


def _shaper(kind, **kw):
    return ResponseShaper(kind=kind, response_id="x-1", model="tiny", created=100,
                          token_text=lambda t: f"<{t}>", **kw)


USAGE = Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=4)


def test_sse_framing():
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE_EVENT == b"data: [DONE]\n\n"
    assert json.loads(sse_event({"t": "é"})[6:]) == {"t": "é"}


def test_usage_body():
    assert usage_body(USAGE) == {
        "prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_completion_chunks():
    s = _shaper("completion")
    assert s.role_chunk() is None
    assert s.chunk(Delta(text="", token_ids=(3,))) is None
    assert s.chunk(Delta(text="ab", token_ids=(1,))) == {
        "id": "x-1", "object": "text_completion", "created": 100, "model": "tiny",
        "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}],
    }
    last = s.chunk(Delta(text="", finish_reason="length", usage=USAGE))
    assert last["choices"][0] == {"index": 0, "text": "", "logprobs": None,
                                  "finish_reason": "length"}
    assert s.usage_chunk(USAGE) is None


def test_chat_chunks_with_usage():
    s = _shaper("chat", include_usage=True)
    assert s.role_chunk() == {
        "id": "x-1", "object": "chat.completion.chunk", "created": 100, "model": "tiny",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}],
        "usage": None,
    }
    assert s.chunk(Delta(text="hi"))["choices"][0]["delta"] == {"content": "hi"}
    final = s.chunk(Delta(text="", finish_reason="stop", usage=USAGE))
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] == "stop"
    usage = s.usage_chunk(USAGE)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 7


def test_non_streaming_bodies_and_logprobs():
    lp = (OutputLogprobs(7, -0.5, (7, 9, 11), (-0.5, -1.0, -3.0)),
          OutputLogprobs(8, -0.25, (8, 2, 4), (-0.25, -2.0, -4.0)))
    s = _shaper("completion", top_logprobs=2)
    s.collect(Delta(text="<7>", token_ids=(7,), logprobs=lp[:1]))
    s.collect(Delta(text="<8>", token_ids=(8,), logprobs=lp[1:], finish_reason="stop",
                    usage=USAGE))
    body = s.final_body("stop", USAGE)
    assert body["object"] == "text_completion"
    assert body["choices"] == [{
        "index": 0, "text": "<7><8>", "finish_reason": "stop",
        "logprobs": {"tokens": ["<7>", "<8>"], "token_logprobs": [-0.5, -0.25],
                     "top_logprobs": [{"<7>": -0.5, "<9>": -1.0}, {"<8>": -0.25, "<2>": -2.0}],
                     "text_offset": [0, 3]},
    }]
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    chat = _shaper("chat", top_logprobs=1)
    chat.collect(Delta(text="<7>", logprobs=lp[:1], finish_reason="length", usage=USAGE))
    body = chat.final_body("length", USAGE)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "<7>"}
    assert body["choices"][0]["logprobs"] == {"content": [{
        "token": "<7>", "logprob": -0.5, "bytes": [60, 55, 62],
        "top_logprobs": [{"token": "<7>", "logprob": -0.5, "bytes": [60, 55, 62]}],
    }]}


def test_delta_validates():
    with pytest.raises(ValueError, match="usage is set exactly on the final delta"):
        Delta(text="a", finish_reason="stop")
    with pytest.raises(ValueError, match="finish_reason must be one of"):
        Delta(text="a", finish_reason="done", usage=USAGE)


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("usage", [False, True])
def test_event_is_sse_event_of_chunk(kind, usage):
    """The per-token template (`event` of a text delta, `text_event`) gives
    exactly the bytes of the general path."""
    s = ResponseShaper(kind=kind, response_id="x-1", model="tiny", created=100,
                       token_text=str, include_usage=usage)
    deltas = [Delta(text=t, token_ids=(1,)) for t in
              ("ab", ' "q" ', "\\", "é", "日本", "\n\t", "\x01pdserve-text\x01", "😀")]
    deltas += [Delta(text="", token_ids=(2,)),
               Delta(text="z", finish_reason="length", usage=USAGE)]
    for delta in deltas:
        chunk = s.chunk(delta)
        assert s.event(delta) == (None if chunk is None else sse_event(chunk))
        if delta.text and delta.finish_reason is None:  # what the direct relay writes
            assert s.text_event(delta.text) == sse_event(chunk)
