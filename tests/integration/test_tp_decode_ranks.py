"""A decode pod at tensor_parallel_size 2 (a real `pdserve decode` process
and its worker rank, gloo, the tiny model: 2 KV heads) fed by two real KV
senders on loopback (TCP; gRPC too in the first two tests), one per decode
rank, as prefill ranks would: heads [0, 1) to rank 0's receiver, heads
[1, 2) to rank 1's, each a head-ranged layout of its own. The KV and first
token come from a TP=1 engine's prefill of the same prompt (its layer
hook's extract), so the pod's generated tokens must equal that engine's
greedy tokens.

* the Reserved target lists both ranks (endpoints, heads), one ticket;
  both transfers succeed and the pod commits and generates the reference;
* only rank 0's heads sent: the request waits (no commit on half the KV),
  and its cancel frees every block (the worker forgot it first);
* kill -9 of rank 1 while requests stream and one waits for its KV: the
  pod goes down (the watchdog), every call ends with an error, nothing
  hangs.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

import kernels
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kv_transfer.base import KVLayout, KVSender
from kv_transfer.grpc import GrpcKVSender
from kv_transfer.target_wire import target_from_proto
from kv_transfer.tcp import TcpKVSender
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.integration.pods import start_pod

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_TOKENS = 12
LONG = 3900  # the tiny model's 4,096 positions: a stream still running at the kill
DEATH_BOUND_S = 20.0
# (a decode pod's prefix cache is off by default: every prompt is sent whole)
# no prefix cache: the tests send each rank's KV themselves, whole, for
# prompts they repeat (a cached prefix would shrink the reservation)
DECODE = {"tensor_parallel_size": 2, "block_size": 16, "num_blocks": 512,
          "no_prefix_cache": True}


class _CaptureKV:
    """A TP=1 engine's layer hook: each layer's KV of the prompt [2, n, H, D]."""

    def __init__(self) -> None:
        self.layers: dict[int, list[torch.Tensor]] = {}

    def on_layer_kv(self, layer_idx, kv_cache_layer, spans) -> None:
        for span in spans:
            self.layers.setdefault(layer_idx, []).append(
                kernels.extract_kv(kv_cache_layer, span.slot_mapping).clone())


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1100, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """prompt -> (per-layer KV [2, n, H, D], the greedy tokens of a TP=1 engine)."""
    prompts = [_prompt(37, 1), _prompt(70, 2)]
    out = {}
    for prompt in prompts:
        hook = _CaptureKV()
        engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), dtype="float32",
                                        num_blocks=64, block_size=16,
                                        max_num_batched_tokens=256), layer_kv_hook=hook)
        result = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                          ignore_eos=True))[0]
        kv = [torch.cat(hook.layers[layer], dim=1) for layer in sorted(hook.layers)]
        out[tuple(prompt)] = (kv, list(result.token_ids))
    return out


SENDERS = {"tcp": TcpKVSender, "grpc": GrpcKVSender}


@pytest.fixture(scope="module", params=["tcp", "grpc"])
def pod(request, tiny_model_dir):
    """A decode pod at TP=2 per transport (its senders: `SENDERS[pod.transport]`)."""
    pod = start_pod("decode", tiny_model_dir, kv_transport=request.param, **DECODE)
    pod.transport = request.param
    yield pod
    if pod.alive():
        pod.terminate()


def _reserve(stub, rid: str, prompt: list[int], max_tokens: int = MAX_TOKENS):
    call = stub.Generate(pb.DecodeGenerateRequest(
        request_id=rid, prompt_token_ids=prompt, remote_prefill=True,
        sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)),
        timeout=120)
    first = next(call)
    assert first.WhichOneof("kind") == "reserved"
    return call, first.reserved.target


def _send_heads(sender: KVSender, rid: str, target: pb.KVTarget, rank: int,
                kv: list[torch.Tensor], first_token: int):
    """Decode rank `rank`'s heads of every layer, from one sender; its outcome."""
    rank_target = target.ranks[rank]
    start, end = rank_target.head_start, rank_target.head_end
    num_heads, head_dim = kv[0].shape[2], kv[0].shape[3]
    layout = KVLayout(len(kv), kv[0].shape[1], end - start, head_dim, "float32",
                      head_start=start, model_kv_heads=num_heads)
    sender.begin(rid, target_from_proto(target).for_rank(rank), layout)
    for layer, layer_kv in enumerate(kv):
        sender.send_layer(rid, layer, layer_kv[:, :, start:end].contiguous(), 0)
    return sender.end(rid, first_token)


def _tokens(call, first_token: int) -> list[int]:
    tokens = [first_token]
    for message in call:
        assert message.tokens.first_index == len(tokens)
        tokens.extend(message.tokens.token_ids)
    return tokens


def _load(pod) -> pb.LoadReport:
    with grpc.insecure_channel(pod.address) as channel:
        return pdserve_pb2_grpc.DecodeStub(channel).GetLoad(pb.LoadRequest(), timeout=10)


def test_two_senders_one_per_rank_generate_the_reference(pod, reference):
    senders = [SENDERS[pod.transport](), SENDERS[pod.transport]()]
    channel = grpc.insecure_channel(pod.address)
    stub = pdserve_pb2_grpc.DecodeStub(channel)
    try:
        for i, (prompt, (kv, expected)) in enumerate(reference.items()):
            rid = f"tp2-{i}"
            call, target = _reserve(stub, rid, list(prompt))
            assert target.tensor_parallel_size == 2
            assert [(r.head_start, r.head_end) for r in target.ranks] == [(0, 1), (1, 2)]
            assert list(target.endpoints) == list(target.ranks[0].endpoints)
            assert target.ranks[0].endpoints != target.ranks[1].endpoints
            outcomes = [_send_heads(senders[rank], rid, target, rank, kv, expected[0])
                        for rank in (0, 1)]
            for outcome in outcomes:
                result = outcome.result(timeout=60)
                assert result.ok, result.reason
            assert _tokens(call, expected[0]) == expected
    finally:
        for sender in senders:
            sender.close()
        channel.close()
    report = _load(pod)
    assert report.num_free_blocks == report.num_total_blocks


def test_half_the_heads_never_commit_and_cancel_frees_everything(pod, reference):
    prompt, (kv, expected) = next(iter(reference.items()))
    sender = SENDERS[pod.transport]()
    channel = grpc.insecure_channel(pod.address)
    stub = pdserve_pb2_grpc.DecodeStub(channel)
    try:
        call, target = _reserve(stub, "half", list(prompt))
        assert _send_heads(sender, "half", target, 0, kv, expected[0]).result(timeout=60).ok
        time.sleep(1.0)  # rank 0 has every layer of its heads; rank 1 has nothing
        assert _load(pod).num_running == 0  # not committed
        call.cancel()
        deadline = time.monotonic() + 20
        while (report := _load(pod)).num_free_blocks != report.num_total_blocks:
            assert time.monotonic() < deadline, "blocks not freed after cancel"
            time.sleep(0.1)
    finally:
        sender.close()
        channel.close()


def _worker_pids(pid: int) -> list[int]:
    pids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"engine.parallel.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                pids.append(int(child))
    return pids


def test_kill_rank_1_takes_the_pod_down_and_nothing_hangs(tiny_model_dir, reference):
    pod = start_pod("decode", tiny_model_dir, **{**DECODE, "num_blocks": 1024})
    senders = [TcpKVSender(), TcpKVSender()]
    channel = grpc.insecure_channel(pod.address)
    stub = pdserve_pb2_grpc.DecodeStub(channel)
    try:
        (workers,) = [_worker_pids(pod.process.pid)]
        assert len(workers) == 1
        streaming = []
        for i, (prompt, (kv, expected)) in enumerate(reference.items()):
            call, target = _reserve(stub, f"long-{i}", list(prompt), max_tokens=LONG)
            for rank in (0, 1):
                assert _send_heads(senders[rank], f"long-{i}", target, rank, kv,
                                   expected[0]).result(timeout=60).ok
            next(call)  # streaming
            streaming.append(call)
        waiting, _ = _reserve(stub, "waiting", list(next(iter(reference))))  # no KV sent
        os.kill(workers[0], signal.SIGKILL)
        began = time.monotonic()
        received = []
        for call in [*streaming, waiting]:
            tokens = 0
            with pytest.raises(grpc.RpcError):
                for message in call:
                    tokens += len(message.tokens.token_ids)
            received.append(tokens)
        assert time.monotonic() - began < DEATH_BOUND_S
        assert max(received[:-1]) < LONG - 1 and received[-1] == 0, received  # mid-stream
        pod.process.wait(DEATH_BOUND_S)
        assert pod.process.returncode != 0
        assert "tensor-parallel rank 1" in pod.log_tail()
    finally:
        for sender in senders:
            sender.close()
        channel.close()
        if pod.alive():
            pod.kill()


def test_rank_layouts_are_head_ranged_and_tp1_is_unchanged():
    from decode_service.rank_wire import layout_fields, layout_of, rank_layout

    whole = KVLayout(3, 10, 4, 8, "float32", token_offset=16)
    assert rank_layout(whole, 2, 4) == replace(whole, head_start=2, num_kv_heads=2,
                                               model_kv_heads=4)
    assert layout_of(layout_fields(rank_layout(whole, 2, 4))) == rank_layout(whole, 2, 4)
    assert not whole.head_ranged
