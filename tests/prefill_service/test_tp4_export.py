"""A prefill pod at TP=4 over the tiny model's 2 KV heads (real worker
processes, gloo): ranks 0 and 1 hold head 0, ranks 2 and 3 head 1, and only
the lowest holder of each (ranks 0 and 2) sends it, so a TP=2 decode pod
gets each head once, from one rank, and the bytes are TP=1's. Its own
module: a process is rank 0 of one group at a time, and test_tp_export.py
keeps a TP=2 engine for its whole module."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from kv_transfer.tcp import TcpKVSender
from prefill_service.kv_export import KVExport
from prefill_service.rank_export import RANK_SERVICE
from prefill_service.worker_exports import WorkerExports
from tests.prefill_service.test_tp_export import (
    SENDER,
    TOL,
    DecodePod,
    _landed,
    _layout,
    _prefill,
    _prompt,
)

pytestmark = pytest.mark.timeout(300)


def test_tp4_prefill_sends_each_replicated_head_once(tiny_model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    common = dict(model_dir=str(tiny_model_dir), dtype="float32", num_blocks=64,
                  block_size=16, max_num_batched_tokens=32)
    decode1, decode2 = DecodePod(1), DecodePod(2)
    ref_export = KVExport({"tcp": TcpKVSender(SENDER)})
    ref = (LLMEngine(EngineConfig(**common), layer_kv_hook=ref_export), ref_export)
    export = KVExport({"tcp": TcpKVSender(SENDER)}, prefill_tp=4)
    engine = LLMEngine(EngineConfig(**common, tensor_parallel_size=4, tp_timeout_s=30.0,
                                    rank_service=RANK_SERVICE), layer_kv_hook=export)
    try:
        workers = WorkerExports(engine.tp, num_streams=1)
        export.attach_workers(workers)
        prompt = _prompt(9)
        _, bytes_ref = _prefill(ref, decode1, "ref-9", prompt)
        layout = _layout(engine, len(prompt))
        export.register("tp4-9", decode2.expect("tp4-9", layout), layout)
        # only rank 2 of the workers sends (head 1); ranks 1 and 3 hold copies
        assert workers.open_requests() == {1: [], 2: ["tp4-9"], 3: []}
        export.forget("tp4-9")
        assert workers.open_requests() == {1: [], 2: [], 3: []}
        _, bytes_tp = _prefill((engine, export), decode2, "tp4-9b", prompt)
        assert bytes_tp == bytes_ref
        expected = _landed(decode1, 0, "ref-9")
        for rank in (0, 1):
            for a, b in zip(expected, _landed(decode2, rank, "tp4-9b"), strict=True):
                torch.testing.assert_close(b, a[:, :, rank:rank + 1], **TOL)
    finally:
        for closing in (engine, export, ref[0], ref[1], decode1, decode2):
            closing.close()
        torch.set_num_threads(threads)
