"""Tool calls through the whole serving path with the official `openai` client:
a real colocated pod process and real router processes, serving a scripted
checkpoint (tests/router/tools/scripted_model.py) whose greedy reply after
the chat template's generation prompt is a tool call, written token by
token by the unchanged engine. One router reads it with a Qwen2.5-style
template (hermes parser, detected), one with a Llama-3.1-style template
(llama3_json parser, detected), over the same pod."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from tests.integration.pods import start_pod
from tests.router.router_process import start_router, wait_ready
from tests.router.tools.scripted_model import make_scripted_model
from tests.tool_templates import LLAMA31_STYLE, QWEN25_STYLE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HERMES_REPLY = ["I will look it up.", "\n<tool_call>\n", '{"name": "get_weather", ',
                '"arguments": {"city": ', '"Paris"}}', "\n</tool_call>",
                '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>']
LLAMA_REPLY = ['{"name": "get_weather", "parameters": ', '{"city": "Paris"', "}}"]
CHAINS = {"<|im_start|>assistant\n": HERMES_REPLY,
          "<|start_header_id|>assistant<|end_header_id|>\n\n": LLAMA_REPLY}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def routers(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    hermes_dir = make_scripted_model(tiny_model_dir, root / "hermes", CHAINS,
                                     chat_template=QWEN25_STYLE)
    llama_dir = root / "llama"
    shutil.copytree(hermes_dir, llama_dir)
    config = json.loads((llama_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAMA31_STYLE
    (llama_dir / "tokenizer_config.json").write_text(json.dumps(config))
    pod = start_pod("colocated", hermes_dir)
    started = {}
    try:
        started["hermes"] = start_router(hermes_dir, colocated=[pod.address])
        started["llama"] = start_router(llama_dir, colocated=[pod.address])
        for router in started.values():
            wait_ready(router)
        yield {name: openai.OpenAI(base_url=r.base_url, api_key="unused", max_retries=0,
                                   timeout=60) for name, r in started.items()}
    finally:
        for router in started.values():
            router.terminate()
        pod.kill()


def _stream(client: openai.OpenAI, **request):
    """(content, {index: [id, name, [argument fragments]]}, finish_reason) of a stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="tiny", stream=True, temperature=0,
                                                **request):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or ():
            if call.index not in calls:
                # the first entry of each call carries its id, type and name
                assert call.id.startswith("call_") and call.type == "function"
                calls[call.index] = [call.id, call.function.name, []]
            else:
                assert call.id is None and call.function.name is None
            calls[call.index][2].append(call.function.arguments)
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_hermes_tool_calls(routers) -> None:
    client = routers["hermes"]
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look it up."
    calls = [(c.function.name, json.loads(c.function.arguments), c.type)
             for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}, "function"),
                     ("get_time", {"zone": "CET"}, "function")]
    assert len({c.id for c in choice.message.tool_calls}) == 2

    content, streamed, finish = _stream(client, messages=ASK, tools=TOOLS)
    assert (content, finish) == ("I will look it up.", "tool_calls")
    assert [(name, "".join(fragments)) for _, name, fragments in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    # the arguments arrive in pieces, as the model writes them
    assert streamed[0][2] == ['{"city": ', '"Paris"}']


def test_llama3_json_tool_call(routers) -> None:
    client = routers["llama"]
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                           temperature=0)
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})
    content, streamed, finish = _stream(client, messages=ASK, tools=TOOLS)
    assert (content, finish) == ("", "tool_calls")
    [(_, name, fragments)] = streamed.values()
    assert (name, "".join(fragments)) == ("get_weather", call.function.arguments)


def test_parallel_tool_calls_false_keeps_the_first(routers) -> None:
    reply = routers["hermes"].chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, temperature=0, parallel_tool_calls=False)
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_weather"]


def test_tool_results_render_and_none_means_text(routers) -> None:
    """A conversation with a call and its result renders through the
    template; tool_choice "none" and no tools leave the reply as text."""
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    reply = routers["hermes"].chat.completions.create(model="tiny", messages=messages,
                                                      tools=TOOLS, temperature=0)
    assert reply.choices[0].finish_reason == "tool_calls"
    for extra in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        reply = routers["hermes"].chat.completions.create(model="tiny", messages=ASK,
                                                          temperature=0, **extra)
        choice = reply.choices[0]
        assert (choice.finish_reason, choice.message.tool_calls) == ("stop", None)
        assert choice.message.content == "".join(HERMES_REPLY)


def test_forced_tool_choice_overrides_the_text_reply(routers) -> None:
    """The scripted reply opens with text; tool_choice "required" makes the
    grammar (router.tools.forced) start a call at once (more in
    tests/integration/test_forced_tool_calls.py). The tools' schemas bound
    the arguments: the grammar holds the model to a schema, however long a
    permissive one lets it write."""
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": name, "parameters": city}}
             for name in ("get_weather", "get_forecast")]
    for client in routers.values():
        reply = client.chat.completions.create(model="tiny", messages=ASK, tools=tools,
                                               tool_choice="required", temperature=0,
                                               parallel_tool_calls=False, max_tokens=100)
        choice = reply.choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        [call] = choice.message.tool_calls
        assert call.function.name in {"get_weather", "get_forecast"}
        assert json.loads(call.function.arguments)["city"] in {"Paris", "Rome"}
