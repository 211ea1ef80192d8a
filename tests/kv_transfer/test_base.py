import pytest
import torch

from kv_transfer.base import KVLayout, TransferOutcome, TransferState, TransferTarget, Verdict
from kv_transfer.errors import InvalidTransition, reason_code


def test_layout_sizes():
    layout = KVLayout(32, 2000, 8, 128, "bfloat16")
    assert layout.row_bytes == 8 * 128 * 2
    assert layout.bytes_per_layer == 2 * 2000 * 2048
    assert layout.total_bytes == 32 * 2 * 2000 * 2048
    assert layout.layer_shape == (2, 2000, 8, 128)
    assert layout.torch_dtype is torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_tokens=-1), "num_tokens"),
        (dict(num_kv_heads=2000), "num_kv_heads"),
        (dict(head_dim=True), "head_dim"),
        (dict(dtype="int8"), "dtype"),
    ],
)
def test_layout_rejects(kwargs, message):
    args = dict(num_layers=2, num_tokens=4, num_kv_heads=2, head_dim=8, dtype="float32") | kwargs
    with pytest.raises(ValueError, match=message):
        KVLayout(**args)


def test_check_chunk():
    layout = KVLayout(2, 10, 2, 4, "float32")
    layout.check_chunk(1, torch.zeros(2, 3, 2, 4), 7)
    with pytest.raises(ValueError, match="outside"):
        layout.check_chunk(1, torch.zeros(2, 4, 2, 4), 7)
    with pytest.raises(ValueError, match="shape"):
        layout.check_chunk(0, torch.zeros(2, 3, 4, 2), 0)
    with pytest.raises(ValueError, match="dtype"):
        layout.check_chunk(0, torch.zeros(2, 3, 2, 4, dtype=torch.float16), 0)
    with pytest.raises(ValueError, match="layer"):
        layout.check_chunk(2, torch.zeros(2, 3, 2, 4), 0)


def test_target_validation():
    TransferTarget(("127.0.0.1:5000", "[::1]:6000"), b"t", "tcp", 3, 1.5)
    with pytest.raises(ValueError, match="endpoint"):
        TransferTarget(("nohost",), b"t", "tcp", 3, 1.5)
    with pytest.raises(ValueError, match="transport"):
        TransferTarget(("h:1",), b"t", "udp", 3, 1.5)
    with pytest.raises(ValueError, match="ticket"):
        TransferTarget(("h:1",), b"", "tcp", 3, 1.5)
    with pytest.raises(ValueError, match="endpoints"):
        TransferTarget(["h:1"], b"t", "tcp", 3, 1.5)


def test_outcome():
    assert TransferOutcome.complete().ok
    failed = TransferOutcome.failed("aborted: user left")
    assert failed.verdict is Verdict.FAILED and not failed.ok
    assert reason_code(failed.reason) == "aborted"
    assert reason_code("weird") == "other"
    with pytest.raises(ValueError):
        TransferOutcome(Verdict.COMPLETE, "why")
    with pytest.raises(ValueError):
        TransferOutcome(Verdict.FAILED)


def test_state_transitions():
    s = TransferState.EXPECTED.to(TransferState.STARTED).to(TransferState.ENDING)
    assert s.to(TransferState.COMPLETE).to(TransferState.RELEASED) is TransferState.RELEASED
    assert TransferState.STARTED.to(TransferState.FAILED).terminal
    with pytest.raises(InvalidTransition, match="EXPECTED -> COMPLETE"):
        TransferState.EXPECTED.to(TransferState.COMPLETE)
    with pytest.raises(InvalidTransition):
        TransferState.COMPLETE.to(TransferState.FAILED)
    with pytest.raises(InvalidTransition):
        TransferState.RELEASED.to(TransferState.FAILED)
