"""Decode CUDA graphs on a real CUDA device: replay equals eager, token for token.

Skipped without CUDA. The suite runs with TRITON_INTERPRET=1 (tests/conftest.py),
under which Triton would interpret even CUDA tensors and no graph is captured
(`kernels.cuda_graph_unsupported_reason`), so on a GPU machine
`test_gpu_graph_suite_compiled` re-runs this file in a subprocess with
TRITON_INTERPRET=0; the other tests run only in that compiled mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
compiled_only = pytest.mark.skipif(INTERPRETED, reason="runs in the TRITON_INTERPRET=0 re-run")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
@pytest.mark.skipif(not INTERPRETED, reason="already in compiled mode")
def test_gpu_graph_suite_compiled():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
         str(Path(__file__).relative_to(REPO))],
        cwd=REPO, env=env, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


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
