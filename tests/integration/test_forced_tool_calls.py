"""Forced tool calls end to end: the official `openai` client against real
routers over the session's real pods (tests/integration/conftest.py), the
tiny random-weight model sampling at temperature 1.0. Left alone it never
calls a tool; with tool_choice "required" or a named function the grammar
(router.tools.forced) makes every reply a call, which the router parses
into `tool_calls`, streamed and not: the name is one of the tools (the
named one) and the arguments validate against its schema. Both call formats
(a Qwen2.5-style template: hermes; a Llama-3.1-style one: llama3_json),
each through a disaggregated and a colocated router; same seed, same calls.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.router.router_process import start_router, wait_ready
from tests.tool_templates import LLAMA31_STYLE, QWEN25_STYLE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Short bounded arguments, so a call always completes within MAX_TOKENS.
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                      "metric": {"type": "boolean"}},
                       "required": ["city", "metric"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "set_alarm", "description": "Set an alarm",
        "parameters": {"type": "object",
                       "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                      "label": {"type": "string", "maxLength": 4}},
                       "required": ["hour", "label"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Wake me when it is sunny in Paris."}]
MAX_TOKENS = 256
SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def routers(tiny_model_dir, prefill_pod, decode_pods, colocated_pod, tmp_path_factory):
    root = tmp_path_factory.mktemp("forced")
    started = {}
    try:
        for parser, template in (("hermes", QWEN25_STYLE), ("llama3_json", LLAMA31_STYLE)):
            model_dir = root / parser
            shutil.copytree(tiny_model_dir, model_dir)
            config_path = model_dir / "tokenizer_config.json"
            config = json.loads(config_path.read_text())
            config["chat_template"] = template
            config_path.write_text(json.dumps(config))
            started[parser, "pd"] = start_router(
                model_dir, prefill=[prefill_pod.address],
                decode=[pod.address for pod in decode_pods.values()], tool_call_parser=parser)
            started[parser, "co"] = start_router(model_dir, colocated=[colocated_pod.address],
                                                 tool_call_parser=parser)
        for router in started.values():
            wait_ready(router)
        yield {key: openai.OpenAI(base_url=r.base_url, api_key="unused", max_retries=0,
                                  timeout=120) for key, r in started.items()}
    finally:
        for router in started.values():
            router.terminate()


def _ask(client: openai.OpenAI, stream: bool, seed: int, **request):
    """(finish_reason, [(name, arguments JSON text)]) of one forced reply."""
    common = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                  max_tokens=MAX_TOKENS, **request)
    if not stream:
        choice = client.chat.completions.create(**common).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.finish_reason, calls
    finish, calls = None, {}
    for chunk in client.chat.completions.create(stream=True, **common):
        choice = chunk.choices[0]
        assert not choice.delta.content  # a forced reply has no text
        for call in choice.delta.tool_calls or ():
            name, fragments = calls.setdefault(call.index, [call.function.name, []])
            fragments.append(call.function.arguments or "")
        finish = choice.finish_reason or finish
    return finish, [(name, "".join(fragments)) for name, fragments in calls.values()]


def _check_calls(finish: str, calls: list[tuple[str, str]], names: set[str],
                 single: bool) -> None:
    assert finish == "tool_calls" and calls, (finish, calls)
    if single:
        assert len(calls) == 1, calls
    for name, arguments in calls:
        assert name in names, calls
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_required_and_named_tool_choice_force_valid_calls(routers, parser) -> None:
    # parallel_tool_calls false: exactly one call, the grammar then lets the model only stop
    cases = [({"tool_choice": "required", "parallel_tool_calls": False}, {"get_weather",
                                                                          "set_alarm"}),
             ({"tool_choice": {"type": "function", "function": {"name": "set_alarm"}}},
              {"set_alarm"})]
    jobs = [(mode, stream, seed, i) for mode in ("pd", "co") for stream in (False, True)
            for seed in SEEDS for i in range(len(cases))]

    def run(job):
        mode, stream, seed, i = job
        return _ask(routers[parser, mode], stream, seed, **cases[i][0])

    with ThreadPoolExecutor(8) as pool:
        results = dict(zip(jobs, pool.map(run, jobs), strict=True))
    for (_, _, seed, i), (finish, calls) in results.items():
        request, names = cases[i]
        _check_calls(finish, calls, names, single=request.get("parallel_tool_calls") is False)
        # same seed: the disaggregated hand-off and streaming change nothing
        assert (finish, calls) == results["co", False, seed, i]


def test_a_forced_call_with_response_format_is_refused(routers) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        routers["hermes", "co"].chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
            response_format={"type": "json_object"})
    assert info.value.body["param"] == "response_format"
    assert "cannot be combined with 'tool_choice' 'required'" in info.value.body["message"]
