import pytest
import torch

from kv_transfer.device import HostStager, byte_view


def test_byte_view_is_the_tensor_memory():
    t = torch.arange(6, dtype=torch.bfloat16)
    view = byte_view(t)
    assert bytes(view) == t.view(torch.uint8).numpy().tobytes()
    view[0:2] = bytes(torch.tensor([7.0], dtype=torch.bfloat16).view(torch.uint8).tolist())
    assert t[0].item() == 7.0  # writable, no copy
    assert len(byte_view(torch.empty(0))) == 0
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(torch.zeros(4, 4).t())


def test_cpu_stage_uses_the_tensor_in_place():
    stager = HostStager()
    kv = torch.randn(2, 5, 2, 4)
    copy = stager.stage(kv)
    assert copy.tensor.data_ptr() == kv.data_ptr() and copy.event is None
    copy.wait()
    strided = torch.randn(2, 4, 5, 2).permute(0, 2, 3, 1)
    staged = stager.stage(strided)
    assert staged.tensor.is_contiguous() and torch.equal(staged.tensor, strided)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stage_copies_into_pinned_memory_on_a_side_stream():
    stager = HostStager()
    kv = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    expected = kv.cpu()
    copy = stager.stage(kv)
    assert copy.tensor.is_pinned() and copy.event is not None
    del kv  # the caller drops its tensor at once; a new one must not reuse it early
    reuse = torch.zeros(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    copy.wait()
    assert reuse.abs().sum().item() == 0
    assert torch.equal(copy.tensor, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stage_of_a_head_major_view():
    """A head-ranged sender stages `KVLayout.staged(kv)`: a permuted CUDA view."""
    stager = HostStager()
    kv = torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16)[:, :, 1:3]
    expected = kv.permute(2, 0, 1, 3).contiguous().cpu()
    copy = stager.stage(kv.permute(2, 0, 1, 3))
    del kv
    copy.wait()
    assert copy.tensor.is_pinned() and copy.tensor.is_contiguous()
    assert torch.equal(copy.tensor, expected)
