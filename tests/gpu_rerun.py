"""GPU test files re-run themselves with compiled Triton kernels.

The suite runs with TRITON_INTERPRET=1 (tests/conftest.py), under which
Triton would interpret even CUDA tensors. A GPU test file marks its tests
`compiled_only` and has one test that calls `rerun_compiled(__file__)`:
on a CUDA machine that re-runs the file's `gpu` tests in a subprocess with
TRITON_INTERPRET=0, where the `compiled_only` tests run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# A GPU test file's `pytestmark`.
GPU_MARKS = [pytest.mark.gpu,
             pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
compiled_only = pytest.mark.skipif(INTERPRETED, reason="runs in the TRITON_INTERPRET=0 re-run")
needs_rerun = pytest.mark.skipif(not INTERPRETED, reason="already in compiled mode")
REPO = Path(__file__).resolve().parents[1]


def rerun_compiled(test_file: str) -> None:
    """Run `test_file`'s gpu tests with TRITON_INTERPRET=0; fail with their output."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
         str(Path(test_file).resolve().relative_to(REPO))],
        cwd=REPO, env=env, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
