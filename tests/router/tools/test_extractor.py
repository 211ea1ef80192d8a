"""Deltas with tool calls taken out, and the OpenAI chunks and body built from them."""

from __future__ import annotations

import itertools

from router.generation import Delta, ToolCallDelta, Usage
from router.http.responses import ResponseShaper
from router.tools.extractor import ToolCallExtractor
from router.tools.hermes import HermesParser

USAGE = Usage(prompt_tokens=5, completion_tokens=9)
PIECES = ["Checking.", " <tool_", 'call>{"name": "get_weather", "arguments": {"city":',
          ' "Paris"}}</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>']


def _extractor() -> ToolCallExtractor:
    ids = itertools.count()
    return ToolCallExtractor(HermesParser(), new_id=lambda: f"call_{next(ids)}")


def _deltas(pieces: list[str], finish: str) -> list[Delta]:
    out = [Delta(text=p, token_ids=(i,)) for i, p in enumerate(pieces[:-1])]
    return out + [Delta(text=pieces[-1], finish_reason=finish, usage=USAGE)]


def _shaper() -> ResponseShaper:
    return ResponseShaper(kind="chat", response_id="chatcmpl-1", model="tiny", created=1,
                          token_text=str)


def test_deltas_carry_calls_and_finish_with_tool_calls() -> None:
    extractor = _extractor()
    out = [extractor.convert(d) for d in _deltas(PIECES, "stop")]
    assert [d.text for d in out] == ["Checking.", "", "", ""]
    assert out[1].tool_calls == ()
    assert out[2].tool_calls == (ToolCallDelta(0, '{"city":', "call_0", "get_weather"),)
    assert out[3].tool_calls == (ToolCallDelta(0, ' "Paris"}'),
                                 ToolCallDelta(1, "{}", "call_1", "get_time"))
    assert (out[3].finish_reason, out[3].usage) == ("tool_calls", USAGE)


def test_length_stays_length() -> None:
    extractor = _extractor()
    out = [extractor.convert(d) for d in _deltas(PIECES[:3], "length")]
    assert out[-1].finish_reason == "length"
    extractor = _extractor()
    out = [extractor.convert(d) for d in _deltas(["no calls here"], "stop")]
    assert (out[0].text, out[0].finish_reason) == ("no calls here", "stop")


def test_stream_chunks_and_final_body_agree() -> None:
    extractor, shaper, collector = _extractor(), _shaper(), _shaper()
    chunks = []
    for delta in _deltas(PIECES, "stop"):
        delta = extractor.convert(delta)
        collector.collect(delta)
        chunk = shaper.chunk(delta)
        if chunk is not None:
            chunks.append(chunk["choices"][0])
    assert chunks[0]["delta"] == {"content": "Checking."}
    assert chunks[1]["delta"] == {"tool_calls": [{
        "index": 0, "id": "call_0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":'}}]}
    assert chunks[2]["delta"] == {"tool_calls": [
        {"index": 0, "function": {"arguments": ' "Paris"}'}},
        {"index": 1, "id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": "{}"}}]}
    assert chunks[2]["finish_reason"] == "tool_calls"
    body = collector.final_body("tool_calls", USAGE)
    assert body["choices"][0]["message"] == {
        "role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}}]}
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_only_calls_give_null_content() -> None:
    extractor, collector = _extractor(), _shaper()
    for delta in _deltas(PIECES[1:], "stop"):
        collector.collect(extractor.convert(delta))
    message = collector.final_body("tool_calls", USAGE)["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 2
