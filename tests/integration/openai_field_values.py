"""Sample values and one extension's check for the per-field tables of
tests/integration/openai_schema_table.py (kept apart so that table stays
one module's size): the request the checks send, chat's fields with values
that would change something if honoured, vLLM's fields this server does not
honour, and `return_tokens_as_token_ids`."""

from __future__ import annotations

from typing import Any

import openai

PROMPT_IDS = [20, 21, 22, 23, 24, 25]
MESSAGES = [{"role": "user", "content": "Hi!"}]

# chat's fields and sample values that would change something if honoured
CHAT_VALUES: dict[str, Any] = {
    "messages": MESSAGES, "max_completion_tokens": 3, "top_logprobs": 2,
    "metadata": {"k": "v"}, "store": True, "service_tier": "auto", "safety_identifier": "id-1",
    "prompt_cache_key": "k", "prompt_cache_options": {}, "prompt_cache_retention": "24h",
    "prediction": {"type": "content", "content": "x"},
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "moderation": {"policy": {}}, "reasoning_effort": "high", "verbosity": "low",
    "web_search_options": {}, "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto", "parallel_tool_calls": True, "functions": [{"name": "f"}],
    "function_call": "auto", "documents": [{"title": "t", "text": "d"}],
}
# vLLM's request fields this server does not honour, and typos: a 400 on both endpoints.
UNKNOWN_FIELDS: dict[str, Any] = {
    "min_p": 0.1, "use_beam_search": True, "skip_special_tokens": False,
    "chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": False,
    "guided_decoding_backend": "xgrammar", "typo_field": 1, "temprature": 0.5,
    "session_id": "s1",
}


def tokens_as_ids(kind: str) -> Any:
    """Honoured: logprobs name each output token `token_id:<id>` (ids in the
    tiny model's 1,100-token vocabulary), and the output is the one without it."""
    def check(client: openai.OpenAI, name: str) -> None:
        outputs = []
        for extra in ({}, {name: True}):
            common = dict(model="tiny", temperature=0, max_tokens=6,
                          extra_body={"ignore_eos": True, **extra})
            if kind == "completion":
                choice = client.completions.create(prompt=PROMPT_IDS, logprobs=0,
                                                   **common).choices[0]
                outputs.append((choice.logprobs.tokens, choice.text))
            else:
                choice = client.chat.completions.create(messages=MESSAGES, logprobs=True,
                                                        **common).choices[0]
                outputs.append(([c.token for c in choice.logprobs.content],
                                choice.message.content))
        (texts, text), (ids, same_text) = outputs
        assert same_text == text and len(ids) == len(texts) == 6
        assert all(t.startswith("token_id:") and 0 <= int(t[9:]) < 1100 for t in ids), ids
        assert ids != texts
    return check
