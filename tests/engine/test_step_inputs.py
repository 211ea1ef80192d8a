"""StepInputs: persistent buffers hold exactly the current step's values, with
fill values everywhere else, after consecutive steps of different shapes."""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.step_inputs import StepInputs

pytestmark = pytest.mark.timeout(120)


def _inputs() -> StepInputs:
    return StepInputs(max_num_tokens=10, max_num_seqs=4, max_blocks_per_seq=5, device="cpu")


def test_a_smaller_write_resets_what_a_larger_one_left():
    inputs = _inputs()
    view = inputs.slot_mapping.write_rows([7, 8, 9, 10, 11, 12])
    assert view.tolist() == [7, 8, 9, 10, 11, 12]
    view = inputs.slot_mapping.write_rows([3, 4])
    assert view.tolist() == [3, 4]
    assert inputs.slot_mapping.buffer.tolist() == [3, 4] + [-1] * 8
    inputs.input_ids.write_rows([5, 6, 7])
    inputs.input_ids.write_rows([])
    assert inputs.input_ids.buffer.tolist() == [0] * 10


def test_tables_are_padded_to_the_longest_and_cleared_outside_the_step():
    inputs = _inputs()
    view = inputs.block_tables.write_table([[4, 5, 6], [7], [8, 9, 1, 2], [3]])
    assert view.tolist() == [[4, 5, 6, 0], [7, 0, 0, 0], [8, 9, 1, 2], [3, 0, 0, 0]]
    view = inputs.block_tables.write_table([[1], [2, 3]])
    assert view.tolist() == [[1, 0], [2, 3]]
    # Rows and columns of the earlier, larger step are back to 0.
    assert inputs.block_tables.buffer.tolist() == [[1, 0, 0, 0, 0], [2, 3, 0, 0, 0]] + [
        [0] * 5] * 2
    view = inputs.block_tables.write_table([])
    assert tuple(view.shape) == (0, 1) and not inputs.block_tables.buffer.any()


def test_writes_beyond_the_preallocated_size_name_the_limit():
    inputs = _inputs()
    with pytest.raises(ValueError, match="11 rows exceed the 10 preallocated"):
        inputs.positions.write_rows(list(range(11)))
    with pytest.raises(ValueError, match=r"up to 6 entries exceed the preallocated 4 x 5"):
        inputs.block_tables.write_table([[1] * 6])
    with pytest.raises(ValueError, match="max_blocks_per_seq 0"):
        StepInputs(max_num_tokens=1, max_num_seqs=1, max_blocks_per_seq=0, device="cpu")


def _expected_slots(request, block_size, start, end):
    return [request.block_ids[p // block_size] * block_size + p % block_size
            for p in range(start, end)]


def test_runner_buffers_after_a_mixed_step_then_a_smaller_decode_step(make_engine):
    """A mixed step (4 decode rows + a 30-token prompt) and then a 2-row decode
    step: the buffers hold exactly the second step, nothing of the first leaks."""
    engine = make_engine(block_size=16, num_blocks=64, max_num_batched_tokens=64,
                         max_num_seqs=8, max_model_len=256)
    inputs = engine.runner.inputs
    assert (inputs.max_num_tokens, inputs.max_num_seqs, inputs.max_blocks_per_seq) == (64, 8, 16)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, n in enumerate([20, 13, 5, 17]):
        engine.add_request(f"r{i}", list(range(10 + i, 10 + i + n)), params)
    engine.step()  # the four prompts
    engine.add_request("long", list(range(200, 230)), params)
    engine.step()  # four decode rows + the 30-token prompt: 34 rows
    assert inputs.slot_mapping.rows == 34 and inputs.block_tables.rows == 4
    for rid in ("r0", "r2", "long"):
        engine.abort_request(rid)
    engine.step()
    running = [engine._requests["r1"], engine._requests["r3"]]
    # The second step decoded position num_tokens - 1 of each remaining request.
    positions = [r.num_tokens - 2 for r in running]
    assert inputs.positions.buffer.tolist() == positions + [0] * 62
    assert inputs.input_ids.buffer.tolist() == [
        r.all_token_ids[p] for r, p in zip(running, positions, strict=True)] + [0] * 62
    assert inputs.slot_mapping.buffer.tolist() == [
        _expected_slots(r, 16, p, p + 1)[0] for r, p in zip(running, positions, strict=True)
    ] + [-1] * 62
    assert inputs.sample_rows.buffer.tolist() == [0, 1] + [0] * 62
    assert inputs.context_lens.buffer.tolist() == [p + 1 for p in positions] + [0] * 6
    width = max(len(r.block_ids) for r in running)
    expected_tables = torch.zeros(8, 16, dtype=torch.int32)
    for i, r in enumerate(running):
        expected_tables[i, :len(r.block_ids)] = torch.tensor(r.block_ids)
    assert torch.equal(inputs.block_tables.buffer, expected_tables)
    assert inputs.block_tables.cols == width


def test_no_prefill_context_is_gathered_unless_a_chunk_needs_it(make_engine, monkeypatch):
    """Whole prompts attend over their own rows: the step builds no context slots."""
    from engine import paged_attention_context

    built = []
    original = paged_attention_context.PagedAttentionContext.__init__

    def spy(self, **kwargs):
        built.append(kwargs["prefill_context_slots"])
        original(self, **kwargs)

    monkeypatch.setattr(paged_attention_context.PagedAttentionContext, "__init__", spy)
    engine = make_engine(max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", list(range(10, 20)), params)
    engine.add_request("b", list(range(30, 60)), params)  # 14 tokens now, 16 next step
    engine.step()
    assert built[-1] is None  # "a" whole, "b"'s first chunk has no earlier context
    engine.step()
    # "b"'s second chunk gathers its 30-token context; "a" is a decode row.
    assert built[-1] is not None and built[-1].tolist() == _expected_slots(
        engine._requests["b"], 16, 0, 30)
