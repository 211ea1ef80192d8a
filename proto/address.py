"""`split_host_port`: the one parser of "host:port" addresses (pod gRPC
addresses, registry records, router flags). Plain Python, no project imports.
"""

from __future__ import annotations

MAX_PORT = 65535


def split_host_port(address: str, what: str = "address") -> tuple[str, int]:
    """'host:port' -> (host, port) with port in 1..65535. The host may itself
    hold colons (an IPv6 literal): the port is what follows the last one.
    ValueError names `what` and the bad value."""
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
        raise ValueError(f"{what} must be host:port with port 1..{MAX_PORT}; got {address!r}")
    return host, int(port)
