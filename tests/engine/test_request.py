import pytest

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

S = RequestStatus


def test_token_accounting():
    r = Request("r", [1, 2, 3], SamplingParams(), output_token_ids=[4])
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (4, 3, 1)
    assert r.num_context_tokens == 4 and r.output_token_ids == [4]
    r.append_output_token(5)
    assert r.all_token_ids == [1, 2, 3, 4, 5] and r.num_context_tokens == 4


def test_transitions_are_checked():
    r = Request("r", [1], SamplingParams())
    r.transition(S.RUNNING)
    r.transition(S.PREEMPTED)
    r.transition(S.RUNNING)
    r.transition(S.FINISHED_LENGTH)
    assert r.status.finish_reason == "length" and r.is_finished
    with pytest.raises(RuntimeError, match="FINISHED_LENGTH -> RUNNING"):
        r.transition(S.RUNNING)
    w = Request("w", [1], SamplingParams())
    with pytest.raises(RuntimeError, match="WAITING -> FINISHED_STOPPED"):
        w.transition(S.FINISHED_STOPPED)
    remote = Request("x", [1], SamplingParams(), status=S.WAITING_FOR_REMOTE_KV)
    with pytest.raises(RuntimeError, match="WAITING_FOR_REMOTE_KV -> PREEMPTED"):
        remote.transition(S.PREEMPTED)
    remote.transition(S.FINISHED_STOPPED)


@pytest.mark.parametrize(
    ("status", "reason"),
    [(S.FINISHED_STOPPED, "stop"), (S.FINISHED_LENGTH, "length"),
     (S.FINISHED_ABORTED, "abort"), (S.FINISHED_PREFILL_DONE, "prefill_done"),
     (S.RUNNING, None), (S.WAITING, None)],
)
def test_finish_reasons(status, reason):
    assert status.finish_reason == reason
    assert status.is_finished == (reason is not None)
