"""Named API keys: the file format and its errors, reloads that keep the
previous keys on a bad file, per-key token buckets and the client gate."""

from __future__ import annotations

import os

import pytest

from router.api_error import ApiError
from router.api_keys import KeyFile, KeyRing, parse_keys
from router.auth import ApiKeyCheck
from router.client_gate import ClientGate
from router.http.client_limits import ClientConcurrency
from router.key_limits import CURRENT_CLIENT, TokenRates, charge_current
from router.metrics import RouterMetrics

FILE = """
# name  key                 limits
team-a  sk-aaaaaaaaaaaaaaaa max_concurrent=2 tokens_per_minute=600
batch   sk-bbbbbbbbbbbbbbbb   # no limits of its own
"""


def test_the_file_names_keys_and_their_limits() -> None:
    ring = parse_keys(FILE, "keys.txt")
    assert ring.names == ("team-a", "batch")
    team = ring.find("sk-aaaaaaaaaaaaaaaa")
    assert (team.name, team.max_concurrent, team.tokens_per_minute) == ("team-a", 2, 600)
    assert ring.find("sk-bbbbbbbbbbbbbbbb").max_concurrent is None
    assert ring.find("sk-nope-nope-nope") is None
    assert "sk-aaaa" not in repr(ring)  # only digests are kept


@pytest.mark.parametrize(("text", "message"), [
    ("team-a\n", "keys.txt, line 1: expected '<name> <key>"),
    ("t@am sk-aaaaaaaaaaaa\n", "line 1: key name 't@am' must be 1-64 of"),
    ("a short\n", "line 1: the key of 'a' must be 8-256 printable characters"),
    ("a sk-aaaaaaaaaaaa rps=3\n", "line 1: unknown option 'rps=3'; the options are "
                                  "max_concurrent=N, tokens_per_minute=N"),
    ("a sk-aaaaaaaaaaaa max_concurrent=0\n", "max_concurrent must be an integer in [1, "),
    ("a sk-aaaaaaaaaaaa\na sk-bbbbbbbbbbbb\n", "line 2: key name 'a' appears twice"),
    ("a sk-aaaaaaaaaaaa\nb sk-aaaaaaaaaaaa\n", "line 2: the key of 'b' is also another"),
    ("# only a comment\n", "keys.txt: no keys"),
])
def test_a_bad_file_is_refused_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        parse_keys(text, "keys.txt")
    assert message in str(caught.value)


def _write(path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # as a Secret update swaps the file whole


def test_a_changed_file_replaces_the_keys_and_a_bad_one_keeps_them(tmp_path) -> None:
    path = tmp_path / "keys"
    _write(path, "a sk-aaaaaaaaaaaa\n")
    outcomes: list[str] = []
    keys = KeyFile(path, on_reload=outcomes.append)
    check = ApiKeyCheck(lambda: keys.ring)
    assert check.check("Bearer sk-aaaaaaaaaaaa").name == "a"
    assert not keys.poll()  # unchanged: nothing read
    _write(path, "b sk-bbbbbbbbbbbb\n")
    assert keys.poll()
    assert check.check("Bearer sk-bbbbbbbbbbbb").name == "b"
    with pytest.raises(ApiError) as removed:
        check.check("Bearer sk-aaaaaaaaaaaa")
    assert removed.value.status == 401
    _write(path, "b\n")  # broken: b stays in force
    assert not keys.poll()
    assert check.check("Bearer sk-bbbbbbbbbbbb").name == "b"
    path.unlink()  # gone: likewise
    assert not keys.poll()
    assert outcomes == ["ok", "error", "error"]
    with pytest.raises(ValueError, match="cannot read the API keys file"):
        KeyFile(tmp_path / "missing")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_token_bucket_admits_until_in_debt_and_says_when_to_retry() -> None:
    clock = Clock()
    rates = TokenRates(clock)
    key = parse_keys("a sk-aaaaaaaaaaaa tokens_per_minute=60\n", "k").keys[0]
    charge = rates.admit(key)
    charge(90)  # one request may overdraw: 60 - 90 = -30
    with pytest.raises(ApiError) as refused:
        rates.admit(key)
    assert (refused.value.status, refused.value.code, refused.value.retry_after) == (
        429, "token_rate_exceeded", 30)  # 30 tokens at 1 a second
    assert "60 tokens per minute" in refused.value.message and "'a'" in refused.value.message
    clock.now += 31
    rates.admit(key)(1)
    assert rates.available(key) == pytest.approx(0.0)
    unlimited = parse_keys("b sk-bbbbbbbbbbbb\n", "k").keys[0]
    assert rates.admit(unlimited) is None


def test_the_gate_holds_each_keys_own_limits_and_names_it() -> None:
    ring = parse_keys(FILE, "k")
    metrics = RouterMetrics()
    gate = ClientGate(ApiKeyCheck(ring), ClientConcurrency(0), TokenRates(Clock()), metrics)
    team, batch = "Bearer sk-aaaaaaaaaaaaaaaa", "Bearer sk-bbbbbbbbbbbbbbbb"
    with gate.admit(team, "10.0.0.1") as first, gate.admit(team, "10.0.0.2"):
        assert first.name == "team-a" and CURRENT_CLIENT.get().name == "team-a"
        with pytest.raises(ApiError) as busy, gate.admit(team, "10.0.0.3"):
            pass
        assert busy.value.status == 429 and busy.value.retry_after == 1
        with gate.admit(batch, "10.0.0.1"), gate.admit(batch, "10.0.0.1"), \
                gate.admit(batch, "10.0.0.1"):
            pass  # another key, no limit of its own: not held back
    assert CURRENT_CLIENT.get() is None
    with gate.admit(team, None):
        charge_current(700)  # what RequestFlow.run does when a request ends
    with pytest.raises(ApiError) as broke:
        with gate.admit(team, None):
            pass
    assert broke.value.code == "token_rate_exceeded"
    with pytest.raises(ApiError) as wrong, gate.admit("Bearer sk-unknown-key", None):
        pass
    assert wrong.value.status == 401
    text = metrics.render().decode()
    assert 'pdserve_router_key_requests_total{key="team-a"} 3.0' in text
    assert 'pdserve_router_key_tokens_total{key="team-a"} 700.0' in text
    assert 'pdserve_router_key_rejections_total{key="team-a",reason="concurrency"} 1.0' in text
    assert 'pdserve_router_key_rejections_total{key="team-a",reason="token_rate"} 1.0' in text
    assert "sk-aaaa" not in text


def test_one_key_from_the_flag_is_named_default() -> None:
    assert ApiKeyCheck("s3cret-key").check("Bearer s3cret-key").name == "default"
    assert KeyRing.single("s3cret-key").names == ("default",)
