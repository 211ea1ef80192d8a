"""`pod.drain`: the drain gate."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pod.drain import DrainGate, DrainState
from proto.status import ServiceError


def test_gate_counts_in_flight_and_refuses_while_draining():
    async def scenario():
        gate = DrainGate()
        with gate.admit():
            assert gate.in_flight == 1
            gate.transition(DrainState.DRAINING)
            with pytest.raises(ServiceError) as err:
                with gate.admit():
                    pass
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert await gate.wait_idle(0.01) is False
        assert gate.in_flight == 0
        assert await gate.wait_idle(0.01) is True

    asyncio.run(scenario())


def test_wait_idle_wakes_when_the_last_request_leaves():
    async def scenario():
        gate = DrainGate()

        async def request():
            with gate.admit():
                await asyncio.sleep(0.05)

        task = asyncio.create_task(request())
        await asyncio.sleep(0)
        assert gate.in_flight == 1
        assert await gate.wait_idle(5.0) is True
        await task

    asyncio.run(scenario())


def test_pod_state_transitions_are_checked():
    gate = DrainGate()
    gate.transition(DrainState.DRAINING)
    gate.transition(DrainState.STOPPED)
    with pytest.raises(RuntimeError, match="pod state stopped -> serving is not allowed"):
        gate.transition(DrainState.SERVING)
