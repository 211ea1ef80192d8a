"""`TPGroup` across two real gloo ranks: each collective's result on every rank."""

from __future__ import annotations

import socket

import pytest
import torch

from engine.parallel.group import TPGroup, host_store, join_store
from tests.engine.parallel.spawn import group_ops, run_ranks

pytestmark = pytest.mark.timeout(120)


def test_collectives_across_two_ranks(tmp_path):
    first, second = run_ranks(group_ops, 2, tmp_dir=tmp_path)
    for result in (first, second):
        assert result["all_reduce"].tolist() == [3.0, 30.0]
        assert result["broadcast"].tolist() == [7.0] * 4  # rank 0's value everywhere
        assert result["min_int"] == 93
    # rank 0: both shards side by side, float32, the 2 padding columns dropped
    assert first["gathered"].dtype == torch.float32
    assert first["gathered"].tolist() == [list(map(float, range(8)))] * 3
    assert second["gathered"] is None


@pytest.mark.parametrize(("rank", "size", "timeout_s", "message"), [
    (2, 2, 10.0, r"rank 2 must be in \[0, size 2\)"),
    (0, 0, 10.0, r"size >= 1"),
    (0, 2, 0.0, r"timeout_s must be > 0"),
])
def test_initialize_refuses_bad_arguments(rank, size, timeout_s, message):
    with pytest.raises(ValueError, match=message):
        TPGroup.initialize(rank=rank, size=size, store=host_store(5.0)[0],
                           device="cpu", timeout_s=timeout_s)


def test_the_rendezvous_store_holds_its_port_from_the_start():
    # The CI failure this replaced: a port picked free, closed, and bound by
    # the rendezvous later was taken in between (EADDRINUSE). The store is
    # listening when host_store returns, so nobody else can take its port.
    store, init_method = host_store(5.0)
    assert init_method == f"tcp://127.0.0.1:{store.port}"
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))
    client = join_store(init_method, 5.0)
    client.set("k", "v")
    assert store.get("k") == b"v"
