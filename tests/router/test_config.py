"""RouterConfig's checks of the relay and worker settings."""

from __future__ import annotations

import pytest

from router.config import RouterConfig


def test_workers_and_relay_defaults() -> None:
    config = RouterConfig(model_dir="m")
    assert (config.workers, config.relay, config.metrics_dir) == (1, "session", None)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("workers", 0, "workers must be in [1, 256], got 0"),
    ("workers", 257, "workers must be in [1, 256], got 257"),
    ("relay", "tokens", "relay must be one of session, stream, got 'tokens'"),
])
def test_bad_values_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RouterConfig(model_dir="m", **{field: value})
