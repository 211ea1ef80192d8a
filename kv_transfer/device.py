"""Device-side helpers: stage KV on the host for sending, and raw byte views.

`HostStager.stage` is called by `KVSender.send_layer` on the engine thread. On
CUDA it copies D2H into pinned memory on the stager's own stream, ordered after
the caller's current stream (`wait_stream`), and records an event; the sender's
I/O thread waits on that event, never the engine. On CPU there is nothing to
overlap: the tensor is used in place (contiguous) and the event is None.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class HostCopy:
    """A host tensor ready to send once `wait()` returns."""

    tensor: torch.Tensor
    event: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Block (an I/O thread, never the engine) until the D2H copy finished."""
        if self.event is not None:
            self.event.synchronize()


class HostStager:
    """One per sender; `stage` may be called from any thread."""

    def __init__(self) -> None:
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def stage(self, kv: torch.Tensor) -> HostCopy:
        if not kv.is_cuda:
            return HostCopy(kv.contiguous())
        assert self._stream is not None, "CUDA tensor without a CUDA runtime"
        pinned = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
        producer = torch.cuda.current_stream(kv.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(producer)  # the layer's KV is final on the producer
            pinned.copy_(kv, non_blocking=True)
            # the caller may drop kv at once; the allocator must wait for our copy
            kv.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        return HostCopy(pinned, event)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (any dtype, bfloat16
    included). The caller keeps `tensor` alive while the view is in use."""
    if tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
