"""Landing buffer pool: where arriving KV is written, bounded by a byte budget.

The pool is one slab allocated when the receiver starts, as DESIGN.md asks of
every KV memory: nothing grows after start. On CPU the slab's pages are faulted
in on first use and stay resident, since the slab is reused; `prefault=True`
touches them all at start instead (the receive path then never pays for a
page fault, at the price of committing the whole budget at once). Buffers
are carved out first-fit at 64-byte alignment and coalesced on free. The
slab is pinned host memory when CUDA is available, so the injector's H2D
copies are asynchronous.

The budget is the only back-pressure: a request that does not fit raises
`BufferPoolExhausted` at `expect`; nothing is queued.

Thread-safe: `allocate`/`free` are called from service threads, receiver I/O
threads and the collector thread.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import torch

from kv_transfer.errors import BufferPoolExhausted

ALIGNMENT = 64  # bytes; covers every KV dtype and keeps buffers on their own cache lines


@dataclass(frozen=True, slots=True)
class LandingBuffer:
    """One transfer's landing area: `data` is a flat uint8 view of `nbytes` in the slab."""

    offset: int
    nbytes: int
    reserved: int  # nbytes rounded up to ALIGNMENT: what the pool accounts
    data: torch.Tensor


class LandingBufferPool:
    def __init__(self, capacity_bytes: int, pin_memory: bool | None = None,
                 prefault: bool = False) -> None:  # fmt: skip
        if not isinstance(capacity_bytes, int) or capacity_bytes < ALIGNMENT:
            raise ValueError(
                f"capacity_bytes must be an int >= {ALIGNMENT}, got {capacity_bytes!r}"
            )
        self.capacity_bytes = capacity_bytes - capacity_bytes % ALIGNMENT
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._slab = torch.empty(self.capacity_bytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        if prefault and not self.pin_memory:
            self._slab.zero_()  # fault the pages in now (pinned memory already is)
        self._lock = threading.Lock()
        # free extents as two parallel sorted lists: offsets and sizes (coalesced)
        self._free_offsets = [0]
        self._free_sizes = [self.capacity_bytes]
        self._in_use: dict[int, int] = {}  # offset -> reserved bytes
        self._bytes_in_use = 0

    @property
    def bytes_in_use(self) -> int:
        with self._lock:
            return self._bytes_in_use

    @property
    def buffers_in_use(self) -> int:
        with self._lock:
            return len(self._in_use)

    def allocate(self, nbytes: int) -> LandingBuffer:
        """Reserve `nbytes` (first fit); raises BufferPoolExhausted when no extent fits."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        reserved = -(-nbytes // ALIGNMENT) * ALIGNMENT
        with self._lock:
            index = next((i for i, size in enumerate(self._free_sizes) if size >= reserved), None)
            if index is None:
                largest = max(self._free_sizes, default=0)
                raise BufferPoolExhausted(
                    f"landing pool has {self.capacity_bytes - self._bytes_in_use} of "
                    f"{self.capacity_bytes} bytes free (largest extent {largest}), "
                    f"{nbytes} requested"
                )
            offset = self._free_offsets[index]
            if self._free_sizes[index] == reserved:
                del self._free_offsets[index], self._free_sizes[index]
            else:
                self._free_offsets[index] += reserved
                self._free_sizes[index] -= reserved
            self._in_use[offset] = reserved
            self._bytes_in_use += reserved
        return LandingBuffer(offset, nbytes, reserved, self._slab[offset : offset + nbytes])

    def free(self, buffer: LandingBuffer) -> None:
        """Return a buffer; freeing one twice is an internal error (KeyError)."""
        with self._lock:
            reserved = self._in_use.pop(buffer.offset)
            self._bytes_in_use -= reserved
            offset, size = buffer.offset, reserved
            i = bisect.bisect(self._free_offsets, offset)
            # merge with the following extent, then the preceding one
            if i < len(self._free_offsets) and offset + size == self._free_offsets[i]:
                size += self._free_sizes[i]
                del self._free_offsets[i], self._free_sizes[i]
            if i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset:
                self._free_sizes[i - 1] += size
            else:
                self._free_offsets.insert(i, offset)
                self._free_sizes.insert(i, size)

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, size) of every free extent, for tests and debugging."""
        with self._lock:
            return list(zip(self._free_offsets, self._free_sizes, strict=True))
