"""`TransferETA`: a transfer's end extrapolated from its layers' cadence plus
END's learnt lag, with the times given (no clock, no threads)."""

from __future__ import annotations

import pytest

from decode_service.transfer_eta import TransferETA


def test_an_expectation_needs_two_layers_and_counts_the_layers_to_come_plus_ends_lag():
    eta = TransferETA()
    eta.layer_in("r", 1, 8, now=5.0)
    assert eta.next_ready() is None  # one layer: no cadence yet
    eta.layer_in("r", 2, 8, now=5.5)
    # 0.5 s per layer; six layers to go plus END's lag, one cadence to start with
    assert eta.next_ready() == ("r", pytest.approx(5.5 + 0.5 * (6 + 1.0)))


def test_the_transfer_expected_first_wins_and_one_ended_or_forgotten_is_not_expected():
    eta = TransferETA()
    for request_id, start, per_layer in (("slow", 0.0, 1.0), ("fast", 1.0, 0.1)):
        eta.layer_in(request_id, 1, 4, now=start)
        eta.layer_in(request_id, 2, 4, now=start + per_layer)
    assert eta.next_ready() == ("fast", pytest.approx(1.1 + 0.1 * 3))
    eta.forget("fast")
    assert eta.next_ready() == ("slow", pytest.approx(1.0 + 1.0 * 3))
    eta.ended("slow", now=4.0)
    assert eta.next_ready() is None


def test_ends_lag_is_learnt_in_cadences_and_one_stalled_end_counts_at_most_two():
    eta = TransferETA()
    eta.layer_in("a", 1, 2, now=0.0)
    eta.layer_in("a", 2, 2, now=1.0)
    eta.ended("a", now=1.0 + 10.0)  # 10 cadences late: counted as 2, lag 1.0 -> 1.2
    eta.layer_in("b", 1, 4, now=20.0)
    eta.layer_in("b", 2, 4, now=21.0)
    assert eta.next_ready() == ("b", pytest.approx(21.0 + 1.0 * (2 + 1.2)))


def test_layer_0_again_starts_the_count_afresh():
    eta = TransferETA()
    eta.layer_in("r", 1, 4, now=0.0)
    eta.layer_in("r", 2, 4, now=1.0)
    eta.forget("r")  # a restart
    eta.layer_in("r", 1, 4, now=10.0)
    assert eta.next_ready() is None
    eta.layer_in("r", 2, 4, now=10.2)
    assert eta.next_ready() == ("r", pytest.approx(10.2 + 0.2 * (2 + 1.0)))
