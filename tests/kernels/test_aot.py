"""Every kernel variant compiles for real GPUs (sm_80, sm_90) on this CPU-only machine.

The compile runs in one subprocess, `python -m kernels.aot --json` with
TRITON_INTERPRET=0 (the suite itself interprets, and Triton cannot compile
for a GPU in that mode). By default it covers a representative subset
(every value of every axis at least once); PDSERVE_AOT_ALL=1 compiles every
variant the launchers can pick. Each variant's registers, shared memory and
spills are printed (`pytest -s`); a variant that spills fails: the
selection functions must never pick one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Importing the kernel modules under TRITON_INTERPRET=1 loads Triton's interpreter (numpy).
import numpy  # noqa: F401  the interpreter needs it: a test dependency, fails rather than skips
import pytest
import triton  # noqa: F401,E402

from kernels import aot, kv_copy, norm, paged_attention, prefill_attention, rotary  # noqa: E402

ALL = os.environ.get("PDSERVE_AOT_ALL") == "1"
SPECS = aot.all_specs() if ALL else aot.representative_specs()
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reports() -> dict[tuple[str, int], dict]:
    """Every variant's report, one compiling process per target at once (the
    compiles are independent and each process is one core's work)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    processes = [subprocess.Popen(
        [sys.executable, "-m", "kernels.aot", "--json", "--capability", str(capability),
         *(["--all"] if ALL else [])],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) for capability in aot.CAPABILITIES]
    rows = []
    for process in processes:
        out, err = process.communicate(timeout=3000)
        assert process.returncode == 0, err[-4000:]
        rows += [json.loads(line) for line in out.splitlines()]
    return {(row["label"], row["capability"]): row for row in rows}


@pytest.mark.timeout(3000)
@pytest.mark.parametrize("capability", aot.CAPABILITIES, ids=lambda c: f"sm_{c}")
@pytest.mark.parametrize("label", [s.label for s in SPECS], ids=lambda s: s.replace(" ", "_"))
def test_variant_compiles_without_spills(reports, label, capability):
    report = reports[(label, capability)]
    print(f"\n{label} sm_{capability}: {report['registers']} registers, "
          f"{report['shared_bytes']} B shared, spills {report['spill_store_bytes']}/"
          f"{report['spill_load_bytes']} B store/load")
    assert 0 < report["registers"] <= 255
    assert report["shared_bytes"] <= 99 * 1024  # within an sm_80 block's opt-in maximum
    assert (report["spill_store_bytes"], report["spill_load_bytes"]) == (0, 0)


def test_all_specs_cover_every_selectable_config():
    labels = [spec.label for spec in aot.all_specs()]
    assert len(labels) == len(set(labels))
    expected = (
        len(paged_attention.all_decode_configs()) + 3 * 4  # partial kernels + reduce kernels
        + len(prefill_attention.all_prefill_configs())
        + 2 * len(kv_copy.all_copy_configs())  # inject and extract
        + len(norm.all_rms_norm_configs()) + len(rotary.all_rotary_configs())
    )
    assert len(labels) == expected == 180 + 12 + 420 + 8 + 126 + 12
    assert {s.label for s in aot.representative_specs()} <= set(labels)


def test_spec_signature_must_name_every_argument():
    with pytest.raises(ValueError, match="signature lacks arguments"):
        aot.KernelSpec("broken", rotary._rotary_kernel, {"x_ptr": "*fp16"}, {}, 4)


def test_aot_refuses_to_run_under_the_interpreter():
    result = subprocess.run([sys.executable, "-m", "kernels.aot"], cwd=REPO,
                            env={**os.environ, "TRITON_INTERPRET": "1"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "run it with TRITON_INTERPRET=0" in result.stderr
