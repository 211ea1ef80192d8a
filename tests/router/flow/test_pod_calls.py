"""choose_path: colocated vs P/D, and the 503 reason when neither can serve."""

from __future__ import annotations

import pytest

from router.api_error import ApiError
from router.flow.pod_calls import choose_path
from router.routing.base import PodLoad, PodPool


class FixedPool(PodPool):
    """A pool whose pods and loads the test sets directly."""

    def __init__(self, **running: dict[str, int]) -> None:
        super().__init__()
        self._running = running  # role -> {address: num_running}

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def pods(self, role: str) -> list[PodLoad]:
        return [PodLoad(address=a, role=role, healthy=True, generation=1, num_waiting=0,
                        num_waiting_tokens=0, num_running=n, num_free_blocks=10,
                        num_total_blocks=10, block_size=16, prefix_hit_rate=0.0,
                        in_flight=self.in_flight(a)[0])
                for a, n in sorted(self._running.get(role, {}).items())]

    def known(self, role: str) -> list[str]:
        return sorted(self._running.get(role, {}))

    def mark_unhealthy(self, address: str, reason: str) -> None: ...


P, D, C = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"


def test_single_paths():
    assert choose_path(FixedPool(colocated={C: 5}), set()) == "colocated"
    assert choose_path(FixedPool(prefill={P: 0}, decode={D: 9}), set()) == "disaggregated"


def test_both_paths_pick_the_less_busy_and_ties_go_to_pd():
    pool = FixedPool(prefill={P: 0}, decode={D: 2}, colocated={C: 2})
    assert choose_path(pool, set()) == "disaggregated"
    with pool.track(D):
        assert choose_path(pool, set()) == "colocated"
    assert choose_path(pool, {D}) == "colocated"


class _Gate:
    """A ColocatedGate whose over-the-limit pods the test names."""

    def __init__(self, *over: str) -> None:
        self.over = set(over)

    def over_limit(self, address: str, num_tokens: int) -> float | None:
        return 9.0 if address in self.over else None


def test_colocated_pods_beyond_the_wait_limit_leave_the_request_to_pd():
    pool = FixedPool(prefill={P: 0}, decode={D: 5}, colocated={C: 0})
    assert choose_path(pool, set(), _Gate()) == "colocated"
    assert choose_path(pool, set(), _Gate(C)) == "disaggregated"
    # without a P/D path the colocated attempt itself sheds (PodCaller.open_stream)
    assert choose_path(FixedPool(colocated={C: 0}), set(), _Gate(C)) == "colocated"


def test_nothing_to_route_to():
    with pytest.raises(ApiError) as info:
        choose_path(FixedPool(prefill={P: 0}, decode={D: 0}), {D})
    assert info.value.status == 503 and info.value.code == "no_pod_available"
    assert info.value.message == (
        "no pod can serve the request: no healthy decode pod and no healthy colocated pod "
        "(1/1 prefill healthy, 1/1 decode healthy, 0/0 colocated healthy, "
        "1 failed this request)")


def test_one_table_says_which_pod_errors_are_the_pods():
    import grpc

    from router.flow.pod_calls import PodFault, pod_fault

    class _Error:  # the one method pod_fault reads of a grpc.aio.AioRpcError
        def __init__(self, code: grpc.StatusCode) -> None:
            self._code = code

        def code(self) -> grpc.StatusCode:
            return self._code

    codes = grpc.StatusCode
    assert {c: pod_fault(_Error(c)) for c in codes if pod_fault(_Error(c))} == {
        codes.UNAVAILABLE: PodFault.BROKEN, codes.INTERNAL: PodFault.BROKEN,
        codes.UNKNOWN: PodFault.BROKEN, codes.RESOURCE_EXHAUSTED: PodFault.FULL}
