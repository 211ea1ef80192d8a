"""The request state machine allows exactly the written transitions."""

from __future__ import annotations

import pytest

from router.flow.state import FlowState, check_transition

S = FlowState


@pytest.mark.parametrize(
    ("old", "new"),
    [(S.ROUTING, S.RESERVING), (S.ROUTING, S.COLOCATED), (S.RESERVING, S.PREFILLING),
     (S.RESERVING, S.MIGRATING), (S.PREFILLING, S.DECODING), (S.DECODING, S.FINISHED),
     (S.DECODING, S.MIGRATING), (S.COLOCATED, S.FINISHED), (S.MIGRATING, S.ROUTING),
     (S.FINISHED, S.FAILED), (S.DECODING, S.FAILED)],
)
def test_allowed(old, new):
    check_transition("r", old, new)


@pytest.mark.parametrize(
    ("old", "new"),
    [(S.ROUTING, S.DECODING), (S.RESERVING, S.FINISHED), (S.FINISHED, S.ROUTING),
     (S.MIGRATING, S.DECODING), (S.COLOCATED, S.PREFILLING), (S.FAILED, S.ROUTING)],
)
def test_refused(old, new):
    with pytest.raises(AssertionError, match=f"request r: {old.value} -> {new.value} is not"):
        check_transition("r", old, new)
