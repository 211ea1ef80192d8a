"""kernels/huge_pages.py: the same tensors as torch.zeros / a copy, on 2 MiB
boundaries where the kernel has transparent huge pages, plain elsewhere."""

from __future__ import annotations

import errno
import gc
import os

import pytest
import torch

from kernels import huge_pages
from kernels.native import pack_panels

NEEDS_THP = pytest.mark.skipif(not huge_pages.available(),
                               reason="no transparent huge pages on this kernel")


def _mapped(address: int) -> bool:
    """Whether any mapping of this process holds `address`."""
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(v, 16) for v in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeros_is_a_zeroed_contiguous_tensor(dtype):
    t = huge_pages.zeros((3, 1024, 700), dtype)
    assert t.shape == (3, 1024, 700) and t.dtype == dtype and t.is_contiguous()
    assert t.device.type == "cpu" and not t.any()
    t.fill_(2)  # writable, every element
    assert t.sum(dtype=torch.float64).item() == 2 * t.numel()


@NEEDS_THP
def test_large_tensors_start_on_a_huge_page():
    t = huge_pages.zeros((4, 1024, 1024), torch.float32)
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0


def test_small_tensors_and_no_thp_are_plain_zeros(monkeypatch):
    small = huge_pages.zeros((16, 16), torch.float32)
    assert not small.any() and small.shape == (16, 16)
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    t = huge_pages.zeros((4, 1024, 1024), torch.float32)
    assert not t.any() and t.shape == (4, 1024, 1024)


def test_copy_of_equals_its_source():
    src = torch.randn(1100, 1500).t()  # not contiguous
    out = huge_pages.copy_of(src)
    assert out.is_contiguous() and torch.equal(out, src)


@NEEDS_THP
def test_the_mapping_goes_with_the_last_view():
    t = huge_pages.zeros((8, 1024, 1024), torch.float32)
    address = t.data_ptr()
    view = t[2:5]
    del t
    gc.collect()
    view.fill_(1)  # still mapped through the view
    assert _mapped(address)
    del view
    gc.collect()
    assert not _mapped(address)


def test_packed_panels_are_the_weight_rearranged():
    """pack_panels now copies onto huge pages: still the layout gemm.c reads."""
    weight = torch.randn(100, 2048)
    panels = pack_panels(weight)
    assert panels.shape == (7, 2048, 16) and panels.is_contiguous()
    for j in range(7):
        cols = weight[16 * j:16 * (j + 1)]
        assert torch.equal(panels[j, :, :cols.shape[0]], cols.t())
        assert not panels[j, :, cols.shape[0]:].any()


def _rss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Rss in /proc/self/smaps_rollup")


@pytest.mark.parametrize("advice", [huge_pages.MADV_POPULATE_WRITE, 9999],
                         ids=["populate-write", "no-such-advice-so-written"])
def test_zeros_are_resident_before_the_first_write(monkeypatch, advice):
    """A KV cache faulted in page by page while serving made prompts' steps
    1.3x longer: every page is allocated before `zeros` returns, by the
    kernel's populate advice or, where the kernel refuses it, by writing."""
    monkeypatch.setattr(huge_pages, "MADV_POPULATE_WRITE", advice)
    size = 64 << 20
    before = _rss_bytes()
    t = huge_pages.zeros((size // 4,), torch.float32)
    assert _rss_bytes() - before >= 0.95 * size
    assert not t.any()


class _RefusingRegion:
    def __init__(self, err: int) -> None:
        self.err = err

    def __len__(self) -> int:
        return 1 << 30

    def madvise(self, advice: int) -> None:
        raise OSError(self.err, os.strerror(self.err))


def test_memory_the_kernel_cannot_give_is_a_clear_error_at_start():
    raw = torch.ones(8, dtype=torch.uint8)
    with pytest.raises(MemoryError, match=r"1073741824 bytes .*--kv-cache-memory"):
        huge_pages.populate(_RefusingRegion(errno.ENOMEM), raw)
    assert raw.all()  # nothing written
    huge_pages.populate(_RefusingRegion(errno.EINVAL), raw)  # an old kernel: written instead
    assert not raw.any()
