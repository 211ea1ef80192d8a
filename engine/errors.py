"""Engine error types, shared by the engine, the services and the router.

The services map them to status codes in one place (see docs/architecture.md,
"Errors"): `ValueError` and its subclasses are the caller's fault
(INVALID_ARGUMENT / HTTP 400), `CapacityError` means "no room now"
(RESOURCE_EXHAUSTED / HTTP 503 once every pod has refused), anything else is
an internal error.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A model directory is unusable: a missing file, a missing or unexpected
    tensor, or a tensor of the wrong shape. The message names the file and the
    tensor (and the expected vs. actual shape) so the user can fix it."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint is well formed but describes a model this engine cannot
    run (architecture, rope scaling type, ...). The message names what was
    found and what is supported."""


class CapacityError(RuntimeError):
    """No room right now (KV blocks, landing buffers). Retrying later or on
    another pod may succeed; the request itself is valid."""
