"""Static pod registry: the addresses given on the router's command line.

The pods never change; the poller still polls them, so a dead one leaves
rotation within one poll interval and comes back when it answers again.
"""

from __future__ import annotations

from collections.abc import Sequence

from proto.roles import PodRole
from router.registry.base import PodEntry, PodSource


def parse_addresses(value: str) -> list[str]:
    """Split a comma-separated `--prefill`/`--decode` flag into addresses (blanks dropped)."""
    return [part.strip() for part in value.split(",") if part.strip()]


class StaticPodSource(PodSource):
    """Fixed prefill / decode / colocated address lists. An address may have one role only."""

    def __init__(
        self,
        *,
        prefill: Sequence[str] = (),
        decode: Sequence[str] = (),
        colocated: Sequence[str] = (),
    ) -> None:
        entries: dict[str, PodEntry] = {}
        for role, addresses in ((PodRole.PREFILL, prefill), (PodRole.DECODE, decode),
                                (PodRole.COLOCATED, colocated)):
            for address in addresses:
                entry = PodEntry(address=address, role=role)
                previous = entries.get(address)
                if previous is not None and previous.role != role:
                    raise ValueError(
                        f"pod {address} is listed as both {previous.role} and {role}; "
                        "each address serves one role"
                    )
                entries[address] = entry
        self._entries = sorted(entries.values(), key=lambda e: (e.role, e.address))

    async def discover(self) -> list[PodEntry]:
        return list(self._entries)

    async def close(self) -> None:
        return None
