"""`FlowState`: the states of one request in the router, with the allowed
transitions written down and checked (see router.flow.request_flow for the life cycle).

    ROUTING -> RESERVING -> PREFILLING -> DECODING -> FINISHED
    ROUTING -> COLOCATED -> FINISHED
    ROUTING -> LOCAL_PREFILL -> FINISHED    (a decode pod prefills the prompt itself)
    ROUTING -> SCORING -> FINISHED    (max_tokens 0: a prefill pod scores the prompt)
    SCORING -> MIGRATING              (that prefill pod failed)
    LOCAL_PREFILL (the pod refused) -> RESERVING
    RESERVING -> LOCAL_PREFILL      (the decode pod's cache left few new tokens: it
                                     computed the prompt instead of reserving)
    RESERVING (no Reserved answer) -> MIGRATING
    PREFILLING | DECODING | COLOCATED | LOCAL_PREFILL -> MIGRATING -> ROUTING
    any state -> FAILED
"""

from __future__ import annotations

import enum


class FlowState(enum.Enum):
    ROUTING = "routing"
    RESERVING = "reserving"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    COLOCATED = "colocated"
    LOCAL_PREFILL = "local_prefill"
    SCORING = "scoring"
    MIGRATING = "migrating"
    FINISHED = "finished"
    FAILED = "failed"


_S = FlowState
_TRANSITIONS: dict[FlowState, frozenset[FlowState]] = {
    _S.ROUTING: frozenset({_S.RESERVING, _S.COLOCATED, _S.LOCAL_PREFILL, _S.SCORING}),
    _S.SCORING: frozenset({_S.MIGRATING, _S.FINISHED}),
    _S.RESERVING: frozenset({_S.PREFILLING, _S.MIGRATING, _S.LOCAL_PREFILL}),
    _S.PREFILLING: frozenset({_S.DECODING, _S.MIGRATING}),
    _S.DECODING: frozenset({_S.MIGRATING, _S.FINISHED}),
    _S.COLOCATED: frozenset({_S.MIGRATING, _S.FINISHED}),
    _S.LOCAL_PREFILL: frozenset({_S.RESERVING, _S.MIGRATING, _S.FINISHED}),
    _S.MIGRATING: frozenset({_S.ROUTING}),
    _S.FINISHED: frozenset(),
    _S.FAILED: frozenset(),
}


def check_transition(request_id: str, old: FlowState, new: FlowState) -> None:
    """Raise AssertionError (an internal bug) unless `old -> new` is allowed."""
    if new is not FlowState.FAILED and new not in _TRANSITIONS[old]:
        raise AssertionError(f"request {request_id}: {old.value} -> {new.value} is not allowed")
