import pytest

from engine.sampling_params import SamplingParams


def test_defaults_and_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.logprobs) == (1.0, 1.0, 0, 16, None)
    assert not p.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(stop_token_ids=[3, 4], stop=["x"]).stop_token_ids == (3, 4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
     ({"max_tokens": -1}, "max_tokens"), ({"logprobs": 21}, "logprobs"),
     ({"logprobs": -1}, "logprobs"), ({"seed": -5}, "seed"), ({"seed": 2**64}, "seed"),
     ({"stop_token_ids": (-1,)}, "stop_token_ids"), ({"stop": ("",)}, "stop strings")],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
