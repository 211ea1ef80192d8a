"""`router.http.body`: the JSON nesting check on raw bytes and the Unicode
check of every string in a parsed body."""

from __future__ import annotations

import json

import pytest

from router.api_error import ApiError
from router.http.body import check_text, nests_deeper_than, parse_json


@pytest.mark.parametrize(("raw", "limit", "deeper"), [
    (b"[[[]]]", 3, False),
    (b"[[[[]]]]", 3, True),
    (b'{"a": {"b": [1, {"c": []}]}}', 5, False),
    (b'{"a": {"b": [1, {"c": []}]}}', 4, True),
    (b'{"s": "[[[[[[[[{{{{"}', 1, False),  # brackets inside a string do not count
    (b'{"s": "\\"[[[[[[[[", "t": "]]]]"}', 1, False),  # nor after an escaped quote
    (b"[" * 10_000, 64, True),  # unclosed: still too deep
    (b"[" + b"[]," * 1000 + b"[]]", 2, False),  # many brackets, shallow
])
def test_nesting_depth(raw, limit, deeper):
    assert nests_deeper_than(raw, limit) is deeper


def test_parse_json_refuses_deep_bodies_before_the_parser():
    with pytest.raises(ApiError) as err:
        parse_json(b"[" * 100 + b"]" * 100, 64)
    assert (err.value.status, err.value.code) == (400, "json_too_deep")
    assert err.value.message == ("the request body nests JSON more than 64 levels deep "
                                 "(the limit is 64)")
    assert parse_json(b"[" * 64 + b"]" * 64, 64) == json.loads(b"[" * 64 + b"]" * 64)


@pytest.mark.parametrize(("raw", "message"), [
    (b"\xff{}", "the request body is not valid UTF-8"),
    (b'{"a": 1,}', "the request body is not valid JSON"),
    (b"[" + b"9" * 5000 + b"]", "the request body is not valid JSON"),
])
def test_parse_json_refuses_bad_bytes_with_400(raw, message):
    with pytest.raises(ApiError) as err:
        parse_json(raw, 64)
    assert err.value.status == 400 and err.value.message.startswith(message)


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "ok\ud800"}, "prompt"),
    ({"stop": ["fine", "\udc00"]}, "stop[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
     "messages[0].content[0].text"),
    ({"\ud800": 1}, None),  # a key: no field to name but the body
])
def test_lone_surrogates_are_named(body, field):
    with pytest.raises(ApiError) as err:
        check_text(body)
    assert (err.value.status, err.value.param) == (400, field)
    assert "is not valid Unicode text: it holds a lone UTF-16 surrogate" in err.value.message


def test_paired_surrogates_and_plain_text_pass():
    check_text(json.loads('{"prompt": "smile \\ud83d\\ude00", "stop": ["\\u00e9"], "n": 1}'))
