"""`pdserve bench serve --turn-overlap` (benchmarks/serve_client.py,
`LoadSpec.turn_overlap`): a session's next turn is sent once the previous
turn's first token is in, not once it ended, so turns overlap in time (the
multi-turn case of issue 42). Against a live `pdserve up` on the tiny model
(the fixture of test_serve_client.py)."""

from __future__ import annotations

import pytest

from benchmarks.serve_client import LoadSpec, run_sessions
from benchmarks.serve_workload import BenchRequest, Session
from tests.benchmarks.test_serve_client import pdserve_server  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(180)

FIRST = tuple(range(10, 26))
LONG = 300  # the first turn's answer: far longer than the wait for its first token


def _session() -> Session:
    second = FIRST + tuple(range(30, 30 + LONG)) + tuple(range(40, 56))
    return Session(0.0, (BenchRequest(FIRST, LONG, "overlap-1"),
                         BenchRequest(second, 4, "overlap-1")))


@pytest.mark.parametrize("overlap", [True, False])
def test_the_next_turn_starts_at_the_first_token_with_overlap(pdserve_server, overlap):  # noqa: F811
    base_url, model = pdserve_server
    result = run_sessions(base_url, model, [_session()],
                          LoadSpec(max_tokens=1, concurrency=2, turn_overlap=overlap))
    assert result["errors"] == 0 and result["completed"] == 2
    first, second = sorted(result["requests"], key=lambda r: r["turn"])
    assert first["output_tokens"] == LONG and second["output_tokens"] == 4
    # either way the next turn waits for the first token ...
    assert second["start_s"] >= first["start_s"] + first["ttft_s"]
    first_end = first["start_s"] + first["e2e_s"]
    if overlap:  # ... and with overlap it is sent while the long answer still streams
        assert second["start_s"] < first_end
    else:
        assert second["start_s"] >= first_end
