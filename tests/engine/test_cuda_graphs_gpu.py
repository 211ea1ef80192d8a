"""Decode CUDA graphs on a real CUDA device: replay equals eager, token for token.

Skipped without CUDA; on a GPU machine the file re-runs itself with compiled
Triton kernels (tests/gpu_rerun.py): interpreted, no graph is captured
(`kernels.cuda_graph_unsupported_reason`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.gpu_rerun import GPU_MARKS, compiled_only, needs_rerun, rerun_compiled

pytestmark = GPU_MARKS


@pytest.mark.timeout(900)
@needs_rerun
def test_gpu_graph_suite_compiled():
    rerun_compiled(__file__)


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    fields = dict(model_dir=str(model_dir), dtype="float32", device="cuda", num_blocks=256,
                  max_num_seqs=16, max_num_batched_tokens=1024)
    return LLMEngine(EngineConfig(**{**fields, **overrides}))


@compiled_only
@pytest.mark.timeout(600)
def test_graph_replay_equals_eager_token_for_token(tiny_model_dir):
    """13 requests (bucket 16) finish one after another, so the decode batch
    runs through 13, 12, ..., 1: buckets 1, 2, 4, 8, 16 and padded sizes."""
    graphs, eager = _engine(tiny_model_dir), _engine(tiny_model_dir, enforce_eager=True)
    assert graphs.runner.graphs is not None and graphs.runner.graphs.sizes == (1, 2, 4, 8, 16)
    assert eager.runner.graphs is None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 1000, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 200, (13,), generator=g)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)
              for i in range(13)]
    expected = [r.token_ids for r in eager.generate(prompts, params)]
    assert [r.token_ids for r in graphs.generate(prompts, params)] == expected
    runs = graphs.runner.graphs.num_runs
    assert all(runs[size] > 0 for size in (1, 2, 4, 8, 16)), runs


@compiled_only
@pytest.mark.timeout(300)
def test_enforce_eager_and_kernel_backend_torch_capture_nothing(tiny_model_dir):
    assert _engine(tiny_model_dir, enforce_eager=True).runner.graphs is None
    assert _engine(tiny_model_dir, kernel_backend="torch").runner.graphs is None
    engine = _engine(tiny_model_dir, max_num_seqs=3)
    assert engine.runner.graphs.sizes == (1, 2, 3)
