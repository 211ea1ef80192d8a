"""Landing buffer pool: where arriving KV is written, bounded by a byte budget.

The receiver allocates one buffer per expected transfer (`expect`) and frees it
when the transfer is over and no writer can touch it. The budget is the only
back-pressure: a full pool raises `BufferPoolExhausted` at `expect`, nothing is
queued. Buffers are pinned host memory when CUDA is available (so the injector's
H2D copies are asynchronous); torch's caching host allocator keeps pinned
allocations cheap to repeat.

Thread-safe: `allocate`/`free` are called from service threads, receiver I/O
threads and the collector thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kv_transfer.errors import BufferPoolExhausted


@dataclass(frozen=True, slots=True)
class LandingBuffer:
    """One transfer's landing area: `data` is a flat uint8 tensor of `nbytes`."""

    buffer_id: int
    nbytes: int
    data: torch.Tensor


class LandingBufferPool:
    def __init__(self, capacity_bytes: int, pin_memory: bool | None = None) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._lock = threading.Lock()
        self._in_use: dict[int, int] = {}  # buffer id -> bytes
        self._bytes_in_use = 0
        self._next_id = 1

    @property
    def bytes_in_use(self) -> int:
        with self._lock:
            return self._bytes_in_use

    @property
    def buffers_in_use(self) -> int:
        with self._lock:
            return len(self._in_use)

    def allocate(self, nbytes: int) -> LandingBuffer:
        """Reserve `nbytes`; raises BufferPoolExhausted when it does not fit now."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        with self._lock:
            if self._bytes_in_use + nbytes > self.capacity_bytes:
                raise BufferPoolExhausted(
                    f"landing pool has {self.capacity_bytes - self._bytes_in_use} of "
                    f"{self.capacity_bytes} bytes free, {nbytes} requested"
                )
            buffer_id = self._next_id
            self._next_id += 1
            self._in_use[buffer_id] = nbytes
            self._bytes_in_use += nbytes
        try:
            # allocated outside the lock: pinning can take milliseconds
            data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        except BaseException:
            self._forget(buffer_id)
            raise
        return LandingBuffer(buffer_id, nbytes, data)

    def free(self, buffer: LandingBuffer) -> None:
        """Return a buffer; freeing one twice is an internal error (KeyError)."""
        self._forget(buffer.buffer_id)

    def _forget(self, buffer_id: int) -> None:
        with self._lock:
            self._bytes_in_use -= self._in_use.pop(buffer_id)
