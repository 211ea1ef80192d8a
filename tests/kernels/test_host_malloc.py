"""kernels/host_malloc.py: after `keep_freed_memory`, a forward's freed
activations are reused, not faulted in again (each test in a fresh
process: the settings are process-wide and this one's heap is not)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.integration.pods import REPO_ROOT

# One prefill step's activations as the forward allocates them (SmolLM2 at
# 1,792 prompt tokens, float32: qkv 6.9 MB, gate/up 22 MB, ...), 30 layers,
# on a worker thread (the engine's forward thread, its own malloc arena);
# the minor faults of the third step, after two have warmed the heap.
SCRIPT = textwrap.dedent("""
    import resource, sys, threading, torch
    from kernels import host_malloc
    took = host_malloc.keep_freed_memory() if sys.argv[1] == "keep" else None
    ROWS = 1792
    def step():
        x = torch.empty(ROWS * 576).fill_(1)
        for _ in range(30):
            qkv = torch.empty(ROWS * 960).fill_(1)
            attn = torch.empty(ROWS * 576).fill_(1)
            del qkv
            gate_up = torch.empty(ROWS * 3072).fill_(1)
            act = torch.empty(ROWS * 1536).fill_(1)
            del gate_up
            down = torch.empty(ROWS * 576).fill_(1)
            del act, attn
            x = down
    faults = []
    def forward():
        step()
        step()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    worker = threading.Thread(target=forward)
    worker.start()
    worker.join()
    print(took, faults[0])
""")


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO_ROOT, check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activations_are_reused_not_faulted_in_again():
    took, faults = _faults("keep")
    assert took == "True"
    assert faults < 500, f"{faults} minor faults in a step after keep_freed_memory"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_without_it_glibc_gives_freed_activations_back():
    """The control: the faults the settings remove are there without them."""
    _, faults = _faults("default")
    assert faults > 10_000  # 129,048 here: every layer's gate/up faulted in again


def test_it_is_applied_once_and_says_whether_glibc_took_it():
    from kernels import host_malloc

    first = host_malloc.keep_freed_memory()
    assert host_malloc.keep_freed_memory() is first
