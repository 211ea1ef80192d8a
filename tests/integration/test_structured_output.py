"""Structured outputs end to end: the official `openai` client against real
routers over the session's real pods (tests/integration/conftest.py), the
tiny random-weight model sampling at temperature 1.0 (left alone it emits
garbage).

50 random prompts with random seeds, each through a disaggregated router
(prefill pod samples the first token under the grammar, a decode pod
continues it) and a colocated one: every output parses as JSON and
validates against the schema, and both routers give the same text for the
same seed. A bad schema is a 400 naming response_format. vLLM's guided_json
and guided_choice constrain the output on both routers, and a field the
server does not honour is a 400 naming it, never a 200 that ignores it.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.router.router_process import start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Short minimal documents (~20 tokens), bounded strings and numbers, so a
# document always completes well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "tags", "ok"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
MAX_TOKENS = 64
NUM_PROMPTS = 50
_WORDS = ("the quick brown fox jumps over lazy dog paris sea token cache model prompt "
          "router prefill decode hello world data json").split()


@pytest.fixture(scope="module")
def routers(tiny_model_dir, prefill_pod, decode_pods, colocated_pod):
    started = {}
    try:
        started["pd"] = start_router(tiny_model_dir, prefill=[prefill_pod.address],
                                     decode=[pod.address for pod in decode_pods.values()])
        started["co"] = start_router(tiny_model_dir, colocated=[colocated_pod.address])
        for router in started.values():
            wait_ready(router)
        yield started
    finally:
        for router in started.values():
            router.terminate()


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=120)


def _requests() -> list[tuple[str, int]]:
    rng = random.Random(13)
    return [(" ".join(rng.choices(_WORDS, k=rng.randint(2, 12))), rng.randrange(2**32))
            for _ in range(NUM_PROMPTS)]


def _ask(router, kind: str, prompt: str, seed: int) -> tuple[str, str]:
    client = _client(router)
    common = dict(model="tiny", temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)
    if kind == "chat":
        reply = client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], response_format=RESPONSE_FORMAT,
            **common)
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    # /v1/completions takes response_format too (as vLLM does).
    reply = client.completions.create(prompt=prompt, extra_body={
        "response_format": RESPONSE_FORMAT}, **common)
    return reply.choices[0].text, reply.choices[0].finish_reason


def test_json_schema_outputs_validate_disaggregated_and_colocated(routers):
    requests = _requests()
    kinds = ["chat" if i % 2 == 0 else "completion" for i in range(len(requests))]
    with ThreadPoolExecutor(8) as pool:
        results = {name: list(pool.map(_ask, [router] * len(requests), kinds,
                                       *zip(*requests, strict=True)))
                   for name, router in routers.items()}
    for name, outputs in results.items():
        for (text, finish_reason), (prompt, seed) in zip(outputs, requests, strict=True):
            assert finish_reason == "stop", (name, prompt, seed, text)
            jsonschema.validate(json.loads(text), SCHEMA)
    # Same seed, same grammar: the disaggregated hand-off changes nothing.
    assert results["pd"] == results["co"]


def test_json_object_regex_and_grammar_extensions(routers):
    client = _client(routers["pd"])
    for seed in range(4):
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a JSON object"}],
            response_format={"type": "json_object"}, temperature=1.0, seed=seed, max_tokens=24)
        text, finish_reason = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert text.startswith("{")
        if finish_reason == "stop":  # else cut by max_tokens: a prefix of an object
            assert isinstance(json.loads(text), dict)
        regex = client.completions.create(model="tiny", prompt="id:", temperature=1.0,
                                          seed=seed, max_tokens=16,
                                          extra_body={"guided_regex": "[a-f0-9]{4}-(x|y)"})
        assert regex.choices[0].finish_reason == "stop"
        assert len(regex.choices[0].text) == 6 and regex.choices[0].text[4] == "-"
        grammar = client.completions.create(
            model="tiny", prompt="answer:", temperature=1.0, seed=seed, max_tokens=16,
            extra_body={"guided_grammar": 'root ::= "yes" | "no" | "maybe"'})
        assert grammar.choices[0].text in ("yes", "no", "maybe")


@pytest.mark.parametrize(("response_format", "fragment"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
     "Invalid type: objectx"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 3, "maximum": 1}}}, "minimum (3) is greater than maximum"),
    ({"type": "xml"}, "'response_format.type' must be one of text, json_object, json_schema"),
])
def test_bad_schema_is_a_400_naming_response_format(routers, response_format, fragment):
    client = _client(routers["pd"])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       response_format=response_format, max_tokens=8)
    error = info.value.body
    assert error["param"].startswith("response_format")
    assert fragment in error["message"]


def test_grpc_front_door_carries_the_grammar(routers):
    with grpc.insecure_channel(routers["pd"].grpc_address) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        sampling = pb.SamplingParams(max_tokens=16, temperature=1.0, seed=5,
                                     grammar=pb.Grammar(regex="(north|south)-[0-9]"))
        messages = list(stub.Generate(pb.GenerateRequest(prompt="go", sampling=sampling),
                                      timeout=120))
        assert messages[-1].finish_reason == "stop"
        text = "".join(m.text for m in messages)
        assert text.split("-")[0] in ("north", "south") and text[-1].isdigit(), text
        bad = pb.SamplingParams(max_tokens=4, grammar=pb.Grammar(json_schema='{"type": 3}'))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(prompt="go", sampling=bad), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "response_format" in info.value.details()


CHOICES = ["red", "green", "light blue", "a|b.*", 'say "hi"']


@pytest.mark.parametrize("seed", range(4))
def test_guided_json_and_guided_choice_disaggregated_and_colocated(routers, seed):
    """The schema as an object (chat) and as its JSON text (completions);
    the choices include regex syntax and quotes, which must come out as
    written."""
    texts = {}
    for name, router in routers.items():
        client = _client(router)
        common = dict(model="tiny", temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)
        chat = client.chat.completions.create(
            messages=[{"role": "user", "content": "a person"}],
            extra_body={"guided_json": SCHEMA}, **common)
        completion = client.completions.create(
            prompt="person:", extra_body={"guided_json": json.dumps(SCHEMA)}, **common)
        choice = client.chat.completions.create(
            messages=[{"role": "user", "content": "pick one"}],
            extra_body={"guided_choice": CHOICES}, **common)
        outputs = [(chat.choices[0].message.content, chat.choices[0].finish_reason),
                   (completion.choices[0].text, completion.choices[0].finish_reason),
                   (choice.choices[0].message.content, choice.choices[0].finish_reason)]
        assert all(reason == "stop" for _, reason in outputs), (name, outputs)
        for text, _ in outputs[:2]:
            jsonschema.validate(json.loads(text), SCHEMA)
        assert outputs[2][0] in CHOICES, (name, outputs[2][0])
        texts[name] = outputs
    assert texts["pd"] == texts["co"]


@pytest.mark.parametrize("name", ["pd", "co"])
def test_a_field_the_server_does_not_honour_is_a_400_naming_it(routers, name):
    client = _client(routers[name])
    chat = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    completion = dict(model="tiny", prompt="x", max_tokens=4)
    cases = [
        (client.chat.completions.create, chat, {"min_p": 0.1}, "min_p",
         "Unrecognized request argument supplied: 'min_p' (/v1/chat/completions refuses the "
         "fields it does not honour rather than ignore them)"),
        (client.completions.create, completion, {"use_beam_search": True}, "use_beam_search",
         "Unrecognized request argument supplied: 'use_beam_search' (/v1/completions refuses "
         "the fields it does not honour rather than ignore them)"),
        (client.chat.completions.create, chat, {"extra_body": {"top_k": 2}}, "extra_body",
         "Unrecognized request argument supplied: 'extra_body' (/v1/chat/completions refuses "
         "the fields it does not honour rather than ignore them; the openai client's "
         "extra_body={...} sends its keys as top-level fields)"),
        (client.completions.create, completion,
         {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
         "'tools' is a /v1/chat/completions field; /v1/completions does not take it"),
        (client.chat.completions.create, chat, {"prompt": "x"}, "prompt",
         "'prompt' is a /v1/completions field; /v1/chat/completions does not take it"),
    ]
    for create, args, extra, param, message in cases:
        with pytest.raises(openai.BadRequestError) as info:
            create(**args, extra_body=extra)
        assert info.value.body == {"message": message, "type": "invalid_request_error",
                                   "param": param, "code": None}
    # the honoured extensions still go through
    ok = client.completions.create(**completion, extra_body={
        "top_k": 2, "ignore_eos": True, "repetition_penalty": 1.1, "min_tokens": 4,
        "stop_token_ids": [7]})
    assert ok.usage.completion_tokens == 4
