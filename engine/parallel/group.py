"""`TPGroup`: one rank's view of its pod's tensor-parallel group.

A pod at TP=N is N processes, one per device, each holding one shard of the
model (`engine.parallel.shard`). Every rank calls `TPGroup.initialize` once
at start with the same rendezvous store and its own rank, before the model is
loaded; the group then lives as long as the process. Every collective below
must be called by all ranks, in the same order, from the one thread that
runs the model (the engine loop thread, or a worker's loop): a rank that
skips one leaves the others waiting until `timeout_s` and then failing,
which is how a dead or stalled rank takes its pod down in bounded time.

Backends (torch.distributed; no collective of our own): NCCL on CUDA for
the device tensors of the forward (its all-reduces run inside a captured
CUDA graph too), plus a gloo group (`host_group`) for small host values;
gloo on CPU for both (then `host_group` is the device group itself).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def host_store(timeout_s: float) -> tuple[dist.TCPStore, str]:
    """A rendezvous store hosted by this process on a loopback port the OS
    picks as it binds, and the `init_method` the other ranks join it by.
    Binding first is the point: a port chosen free and bound later (by the
    rendezvous) can be taken by anyone in between (EADDRINUSE)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    return store, f"tcp://127.0.0.1:{store.port}"


def join_store(init_method: str, timeout_s: float) -> dist.TCPStore:
    """A client of the store `host_store` made, by its `init_method`."""
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


class TPGroup:
    """Collectives over the N ranks of one pod; `rank` 0 samples and serves."""

    def __init__(self, *, rank: int, size: int, device: torch.device,
                 group: dist.ProcessGroup, host_group: dist.ProcessGroup) -> None:
        """Use `initialize`; this wraps groups that already exist."""
        self.rank = rank
        self.size = size
        self.device = device
        self.group = group
        self.host_group = host_group

    @classmethod
    def initialize(cls, *, rank: int, size: int, store: dist.Store, device: str,
                   timeout_s: float) -> TPGroup:
        """Join the group (blocks until all `size` ranks have joined, or
        `timeout_s`). `store` is the rendezvous, the same for every rank:
        rank 0's from `host_store`, the others' from `join_store`; `device`
        is this rank's own device ("cuda:1", "cpu"). The timeout also bounds
        every later collective."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} must be in [0, size {size}) with size >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        torch_device = torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        if torch_device.type == "cuda":
            torch.cuda.set_device(torch_device)
            # device_id: the NCCL communicator is made now, not lazily at the
            # first collective, which may be inside a CUDA graph capture.
            dist.init_process_group("nccl", store=store, rank=rank,
                                    world_size=size, timeout=timeout, device_id=torch_device)
            group = dist.group.WORLD
            host_group = dist.new_group(backend="gloo", timeout=timeout)
        else:
            dist.init_process_group("gloo", store=store, rank=rank,
                                    world_size=size, timeout=timeout)
            group = host_group = dist.group.WORLD
        return cls(rank=rank, size=size, device=torch_device, group=group,
                   host_group=host_group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place on every rank; returns `x`.
        No host synchronisation, so a CUDA graph captures it."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Rank 0: the full logits [n, vocab_size] float32 from every rank's
        [n, vocab_shard] (its vocabulary range, padded to one width; the
        padding columns past `vocab_size` are dropped). Other ranks send
        theirs and return None."""
        local = local.float().contiguous()
        if self.rank != 0:
            dist.gather(local, None, dst=0, group=self.group)
            return None
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.gather(local, parts, dst=0, group=self.group)
        full = torch.cat(parts, dim=1)
        return full if full.shape[1] == vocab_size else full[:, :vocab_size].contiguous()

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype
        everywhere, on the device); returns `x`."""
        dist.broadcast(x, src=0, group=self.group)
        return x

    def min_int(self, value: int) -> int:
        """The minimum of `value` over the ranks (on the host group): e.g. the
        KV block count every rank can hold."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())

    def destroy(self) -> None:
        """Leave the group (every group of this process); idempotent."""
        if dist.is_initialized():
            dist.destroy_process_group()
