"""`PodRole`: the three kinds of pod, named once for pods, router and CLI.

A role travels as its string value (in `LoadReport.role`, Redis registry
keys, metric labels, CLI subcommand names), so `PodRole` is a `StrEnum`:
`PodRole.DECODE == "decode"`. Plain Python, no project imports (see
proto/__init__.py: this package is the contract every other package may import).
"""

from __future__ import annotations

import enum


class PodRole(enum.StrEnum):
    PREFILL = "prefill"      # computes prompts, sends their KV to a decode pod
    DECODE = "decode"        # receives KV, generates tokens 2..n
    COLOCATED = "colocated"  # prefill and decode in one process, no transfer

    @classmethod
    def parse(cls, text: str, what: str = "role") -> PodRole:
        """`text` as a role; ValueError naming `what` and the allowed values otherwise."""
        try:
            return cls(text)
        except ValueError:
            allowed = ", ".join(role.value for role in cls)
            raise ValueError(f"{what} must be one of {allowed}; got {text!r}") from None
