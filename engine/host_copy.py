"""`to_device`: host tensors to the device without waiting for the device.

A plain `cpu_tensor.to("cuda")` (and `torch.tensor(..., device="cuda")`)
synchronizes the host with the current stream, so it would wait for every
kernel queued before it, among them the step in flight that async
scheduling is trying to overlap. Staging through pinned memory makes the
copy a stream-ordered `non_blocking` one; torch's pinned allocator keeps the
staging buffer alive until the copy ran. On CPU it is the tensor itself.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (on the host) on `device`, copied in stream order on CUDA."""
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
