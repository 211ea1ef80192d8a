"""The split prefill on a real CUDA device (docs/architecture.md, "One
prompt on both pods"): prefill and decode pods on the GPU, the decode pod
with the large blocks it runs in production (128 tokens, the prefill pod
16), a real `pdserve router` splitting every long prompt. The decode
pod's injector copies each head layer into the paged cache on its side
stream and waits for that copy before it opens the layer's gate to the
tail's forward (decode_service/injector.py); were that wait missing, the
tail would attend over a half-written head and the output would drift.
Every output (greedy and seeded, whole and streamed, alone or beside a
request decoding) must equal an in-process engine's on the same GPU.

Skipped without CUDA; on a GPU machine the file re-runs itself with
compiled Triton kernels (tests/gpu_rerun.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gpu_rerun import GPU_MARKS, compiled_only, needs_rerun, rerun_compiled
from tests.router.test_split_prefill_e2e import (
    CASES,
    _prompt,
    check_split_beside_a_decoding_request,
    check_splits,
    split_pods,
    undisturbed_texts,
)

pytestmark = GPU_MARKS

# the e2e cases and a prompt whose head (1,100 tokens) spans nine decode blocks
GPU_CASES = [*CASES, (_prompt(4, 2000), {"temperature": 0})]


@pytest.mark.timeout(900)
@needs_rerun
def test_gpu_split_suite_compiled():
    rerun_compiled(__file__)


@pytest.fixture(scope="module")
def pods(tiny_model_dir) -> Iterator[dict]:
    with split_pods(tiny_model_dir, "cuda", decode_block_size=128, decode_blocks=64) as started:
        yield started


@pytest.fixture(scope="module")
def undisturbed(tiny_model_dir) -> list[str]:
    return undisturbed_texts(tiny_model_dir, GPU_CASES, "cuda")


@compiled_only
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_split_prompt_on_the_gpu_gives_the_undisturbed_output(
        tiny_model_dir, pods, undisturbed, stream):
    check_splits(tiny_model_dir, pods, GPU_CASES, undisturbed, stream)


@compiled_only
@pytest.mark.timeout(600)
def test_a_split_beside_a_decoding_request_on_the_gpu_gives_both_undisturbed_outputs(
        tiny_model_dir, pods):
    """Two threads launching on one device: the tail worker and the engine
    loop stepping a request that decodes 1,500 tokens."""
    check_split_beside_a_decoding_request(tiny_model_dir, pods, GPU_CASES[-1], "cuda", 1500)
