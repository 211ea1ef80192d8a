"""Named API keys on a real router over a real pod, through the openai
client: a key added to the file works and a removed one gets 401 within a
second, with no restart and no stream dropped; a key over its own
concurrency or token rate gets 429 with Retry-After while another key's
requests go on."""

from __future__ import annotations

import os
import threading
import time

import grpc
import openai
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.integration.pods import start_pods
from tests.router.router_process import start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

KEY_A, KEY_B = "sk-aaaaaaaaaaaaaaaa", "sk-bbbbbbbbbbbbbbbb"
SMALL, BIG = "sk-ssssssssssssssss", "sk-gggggggggggggggg"


def _write(path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def pod(tiny_model_dir):
    pods = start_pods({"pod": ("colocated", {"num_blocks": 512})}, tiny_model_dir)
    yield pods["pod"]
    pods["pod"].kill()


def _client(router, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key=key, max_retries=0, timeout=60)


def _complete(router, key: str, max_tokens: int = 4) -> str:
    return _client(router, key).completions.create(
        model="tiny", prompt="Hello there", max_tokens=max_tokens,
        temperature=0).choices[0].text


def _until(predicate, what: str, timeout: float) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, what
        time.sleep(0.02)
    return time.monotonic() - start


def _refused(router, key: str) -> bool:
    try:
        _complete(router, key)
    except openai.AuthenticationError:
        return True
    return False


def test_keys_rotate_without_a_restart_or_a_dropped_stream(pod, tiny_model_dir, tmp_path):
    keys = tmp_path / "keys"
    _write(keys, f"a {KEY_A}\n")
    router = start_router(tiny_model_dir, colocated=[pod.address], api_keys_file=str(keys))
    try:
        wait_ready(router)
        assert _complete(router, KEY_A)
        assert _refused(router, KEY_B)
        # a long stream of key a runs across the rotation
        chunks: list[str] = []
        errors: list[BaseException] = []

        def stream() -> None:
            try:
                for chunk in _client(router, KEY_A).completions.create(
                        model="tiny", prompt="Once upon a time", max_tokens=400,
                        temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    chunks.append(chunk.choices[0].text if chunk.choices else "")
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        _until(lambda: len(chunks) >= 5, "the stream did not start", 60)
        _write(keys, f"b {KEY_B}\n")  # a out, b in
        assert _until(lambda: _refused(router, KEY_A), "key a still accepted", 5) < 1.5
        assert _complete(router, KEY_B)
        thread.join(120)
        assert not thread.is_alive() and not errors, errors
        assert len(chunks) >= 100  # the stream of the removed key finished
        _write(keys, "b\n")  # a broken file: b stays in force
        time.sleep(0.6)
        assert _complete(router, KEY_B)
        assert router.metric("pdserve_router_api_key_reloads_total", outcome="error") == 1
        assert router.metric("pdserve_router_key_requests_total", key="b") >= 2
        assert KEY_A not in router.log_path.read_text()  # names only, never a key
    finally:
        router.terminate()


def _running(pod) -> int:
    with grpc.insecure_channel(pod.address) as channel:
        return pdserve_pb2_grpc.DecodeStub(channel).GetLoad(
            pb.LoadRequest(), timeout=10).num_running


def test_a_key_over_its_limits_gets_429_while_another_goes_on(pod, tiny_model_dir, tmp_path):
    keys = tmp_path / "keys"
    _write(keys, f"small {SMALL} max_concurrent=1 tokens_per_minute=60\nbig {BIG}\n")
    router = start_router(tiny_model_dir, colocated=[pod.address], api_keys_file=str(keys))
    try:
        wait_ready(router)
        done = threading.Event()

        def hold() -> None:  # small's one slot, held by a long stream
            for _ in _client(router, SMALL).completions.create(
                    model="tiny", prompt="Once upon a time", max_tokens=300, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}):
                pass
            done.set()

        thread = threading.Thread(target=hold, daemon=True)
        thread.start()
        _until(lambda: _running(pod) == 1, "the first stream did not start", 60)
        with pytest.raises(openai.RateLimitError) as busy:
            _complete(router, SMALL)
        assert busy.value.response.headers["Retry-After"] == "1"
        assert "max_concurrent of API key 'small'" in busy.value.message
        assert _complete(router, BIG)  # the other key is not held back
        thread.join(120)
        assert done.is_set()
        # the stream's 300 output tokens and its prompt overdrew 60 a minute
        with pytest.raises(openai.RateLimitError) as broke:
            _complete(router, SMALL)
        assert int(broke.value.response.headers["Retry-After"]) >= 200
        assert "60 tokens per minute" in broke.value.message
        assert _complete(router, BIG)
        assert router.metric("pdserve_router_key_rejections_total", key="small",
                             reason="concurrency") == 1
        assert router.metric("pdserve_router_key_rejections_total", key="small",
                             reason="token_rate") == 1
    finally:
        router.terminate()
