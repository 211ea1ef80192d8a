"""Pod discovery: where the router learns which pods exist.

A `PodSource` answers "which pods exist, and in which role" — nothing about
their health or load, which `router.registry.poller.PolledPodPool` finds out
by polling each one. Sources: `StaticPodSource` (the --prefill/--decode/
--colocated flags) and `RedisPodSource` (pods' own heartbeats).

`discover()` is awaited by the poller on the router's event loop once per poll
interval; it returns the complete current set (not a diff).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from router.routing.base import check_address, check_role


@dataclass(frozen=True, slots=True)
class PodEntry:
    """A pod the registry knows: gRPC address and role."""

    address: str
    role: str

    def __post_init__(self) -> None:
        check_address(self.address)
        check_role(self.role)


class PodSource(abc.ABC):
    """Lists the pods that currently exist. See the module docstring."""

    @abc.abstractmethod
    async def discover(self) -> list[PodEntry]:
        """Every pod known right now. Raises on a registry outage (the poller then keeps
        the previous set rather than dropping every pod)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections; awaited once when the pool closes."""
