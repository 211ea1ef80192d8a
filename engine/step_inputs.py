"""`StepInputs`: the persistent per-step input tensors of `ModelRunner`.

Allocated once when the runner is built, on the model's device, sized for
the largest step the configuration allows, and filled in place every step
(engine loop thread only). The forward pass reads views of them, and a
captured CUDA graph (`engine.cuda_graphs`) reads the very same storage, so
writing a step's values here is all a replay needs.

Fields (N = `max_num_tokens` rows, S = `max_num_seqs` decode rows,
W = `max_blocks_per_seq` table columns):

| field | shape, dtype | fill |
|---|---|---|
| `input_ids`, `positions` | [N] int64 | 0 |
| `slot_mapping` | [N] int64 | -1 (skipped by `kernels.inject_kv`) |
| `sample_rows` | [N] int64 | 0 |
| `block_tables` | [S, W] int32 (decode rows) | 0 |
| `context_lens` | [S] int32 (decode rows) | 0 |

A write converts the step's Python list into the field's host staging
tensor in one bulk numpy assignment and copies the touched rows to the
device in one non-blocking copy. On CPU the staging tensor *is* the device
tensor, so there is no copy at all. On CUDA the staging tensor is pinned;
before it is overwritten, the write waits for the event recorded after the
previous copy out of it, so preparing a step while the previous one still
runs (async scheduling) never changes bytes a pending copy has yet to read.

Invariant (what padded graph replay relies on, and what the tests check):
outside the current step's rows -- and, for `block_tables`, outside the
current step's columns -- every field holds its fill value. A write also
resets whatever a previous, larger step left there. So the rows past a
decode batch, up to its graph bucket, are padding by construction: token 0
at position 0, slot -1 (its K/V are written nowhere), context length 0 (its
attention output is zeros, and it reads no cache slot).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class StepField:
    """One persistent input: `buffer` on the device, `staging` on the host (the
    same tensor on CPU), and the extent (rows, and columns for 2-D fields)
    that holds non-fill values."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill: int,
                 device: torch.device) -> None:
        self.name = name
        self.fill = fill
        self.buffer = torch.full(shape, fill, dtype=dtype, device=device)
        on_cpu = device.type == "cpu"
        self.staging = self.buffer if on_cpu else torch.full(shape, fill, dtype=dtype,
                                                          pin_memory=True)
        self.staging_np: np.ndarray = self.staging.numpy()
        self._copied: torch.cuda.Event | None = None
        self.rows = 0
        self.cols = 0

    @property
    def capacity(self) -> int:
        return self.buffer.shape[0]

    def write_rows(self, values: Sequence[int]) -> torch.Tensor:
        """Rows `[0, len(values))` = values, the rest fill; returns the [n] device view."""
        n = len(values)
        if n > self.buffer.shape[0]:
            raise ValueError(f"{self.name}: {n} rows exceed the {self.capacity} preallocated")
        dirty = max(n, self.rows)
        self._wait_for_previous_copy()
        self.staging_np[:n] = values
        self.staging_np[n:dirty] = self.fill
        self._copy(dirty)
        self.rows = n
        return self.buffer[:n]

    def write_table(self, tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """Row i = tables[i] padded with fill to the longest; returns the
        [len(tables), max(1, longest)] device view (a view of wider rows)."""
        n = len(tables)
        width = max(1, max((len(t) for t in tables), default=0))
        if n > self.capacity or width > self.buffer.shape[1]:
            raise ValueError(f"{self.name}: {n} rows of up to {width} entries exceed the "
                             f"preallocated {self.capacity} x {self.buffer.shape[1]} (the "
                             f"block table of max_model_len tokens)")
        dirty_rows, dirty_cols = max(n, self.rows), max(width, self.cols)
        self._wait_for_previous_copy()
        self.staging_np[:dirty_rows, :dirty_cols] = self.fill
        for i, table in enumerate(tables):
            self.staging_np[i, :len(table)] = table
        self._copy(dirty_rows)  # whole rows: one contiguous copy
        self.rows, self.cols = n, width
        return self.buffer[:n, :width]

    def _wait_for_previous_copy(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def _copy(self, rows: int) -> None:
        if self.staging is self.buffer or rows == 0:
            return
        self.buffer[:rows].copy_(self.staging[:rows], non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()


class StepInputs:
    """The runner's per-step tensors; see the module docstring for the layout."""

    def __init__(self, *, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device | str) -> None:
        if min(max_num_tokens, max_num_seqs, max_blocks_per_seq) < 1:
            raise ValueError(f"step input sizes must be >= 1, got max_num_tokens "
                             f"{max_num_tokens}, max_num_seqs {max_num_seqs}, "
                             f"max_blocks_per_seq {max_blocks_per_seq}")
        device = torch.device(device)
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        tokens, seqs = (max_num_tokens,), (max_num_seqs,)
        self.input_ids = StepField("input_ids", tokens, torch.int64, 0, device)
        self.positions = StepField("positions", tokens, torch.int64, 0, device)
        self.slot_mapping = StepField("slot_mapping", tokens, torch.int64, -1, device)
        self.sample_rows = StepField("sample_rows", tokens, torch.int64, 0, device)
        self.block_tables = StepField("block_tables", (max_num_seqs, max_blocks_per_seq),
                                      torch.int32, 0, device)
        self.context_lens = StepField("context_lens", seqs, torch.int32, 0, device)

    def fields(self) -> tuple[StepField, ...]:
        return (self.input_ids, self.positions, self.slot_mapping, self.sample_rows,
                self.block_tables, self.context_lens)
