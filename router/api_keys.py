"""API keys with names and limits, read from a file the router reloads when
it changes (`--api-keys-file`), so keys rotate without a restart.

File format (a mounted Kubernetes Secret works as is), one key per line:

    # name   key                      limits (optional, any order)
    team-a   sk-4f1c0e9d2b7a5e3c       max_concurrent=8 tokens_per_minute=120000
    batch    sk-9a8b7c6d5e4f3a2b

* `name`: 1-64 of `A-Z a-z 0-9 . _ -`; what logs and metrics show (never the key).
* `key`: 8-256 printable characters without spaces; what clients send as
  `Authorization: Bearer <key>`.
* `max_concurrent=N`: generation requests of this key in flight at once
  (over it: 429); unset = the router's `--max-concurrent-per-client`.
* `tokens_per_minute=N`: prompt plus output tokens per minute, a token
  bucket of N that refills at N/60 a second; a request is admitted while the
  bucket is not in debt and charged its tokens when it ends (so one request
  may overdraw it); in debt -> 429 with `Retry-After` the refill needs.
* `#` starts a comment; blank lines are skipped. Names and keys are unique.

A file that does not parse refuses to start the router with the line and
what is wrong; on a reload it leaves the previous keys in force (logged,
counted in `pdserve_router_api_key_reloads_total{outcome="error"}`).
Keys are held only as SHA-256 digests: a presented token is hashed and
looked up, so no comparison depends on how much of a key matched.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
KEY = re.compile(r"^[!-~]{8,256}$")  # printable ASCII, no space
LIMITS = ("max_concurrent", "tokens_per_minute")
MAX_LIMIT = 1 << 40
RELOAD_INTERVAL_S = 0.25  # rotation takes effect within this (plus a read)
DEFAULT_NAME = "default"  # the one key `--api-key` gives


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    digest: bytes  # SHA-256 of the key
    max_concurrent: int | None = None
    tokens_per_minute: int | None = None


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True, slots=True)
class KeyRing:
    """The keys in force; immutable, swapped whole on a reload."""

    keys: tuple[ApiKey, ...]
    _by_digest: dict[bytes, ApiKey] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_digest", {k.digest: k for k in self.keys})

    def find(self, token: str) -> ApiKey | None:
        return self._by_digest.get(digest(token))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.keys)

    @staticmethod
    def single(key: str) -> KeyRing:
        """`--api-key KEY`: one key named "default", no limits of its own."""
        return KeyRing((ApiKey(DEFAULT_NAME, digest(key)),))


def parse_keys(text: str, source: str) -> KeyRing:
    """The file's keys; ValueError naming `source`, the line and the problem."""
    keys: list[ApiKey] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}, line {number}"
        fields = line.split()
        if len(fields) < 2:
            raise ValueError(f"{where}: expected '<name> <key> [max_concurrent=N] "
                             f"[tokens_per_minute=N]', got {len(fields)} field(s)")
        name, key, *options = fields
        if not NAME.match(name):
            raise ValueError(f"{where}: key name {name!r} must be 1-64 of A-Z a-z 0-9 . _ -")
        if not KEY.match(key):
            raise ValueError(f"{where}: the key of {name!r} must be 8-256 printable "
                             f"characters without spaces (got {len(key)} characters)")
        limits = _parse_limits(options, where)
        key_digest = digest(key)
        if name in names:
            raise ValueError(f"{where}: key name {name!r} appears twice")
        if key_digest in digests:
            raise ValueError(f"{where}: the key of {name!r} is also another name's key")
        names.add(name)
        digests.add(key_digest)
        keys.append(ApiKey(name, key_digest, **limits))
    if not keys:
        raise ValueError(f"{source}: no keys (an empty key file would refuse every client; "
                         "leave --api-keys-file unset to turn authentication off)")
    return KeyRing(tuple(keys))


def _parse_limits(options: list[str], where: str) -> dict[str, int]:
    limits: dict[str, int] = {}
    for option in options:
        field, sep, value = option.partition("=")
        if not sep or field not in LIMITS:
            raise ValueError(f"{where}: unknown option {option!r}; the options are "
                             + ", ".join(f"{name}=N" for name in LIMITS))
        if field in limits:
            raise ValueError(f"{where}: {field} given twice")
        if not value.isdigit() or not 1 <= int(value) <= MAX_LIMIT:
            raise ValueError(f"{where}: {field} must be an integer in [1, {MAX_LIMIT}], "
                             f"got {value!r}")
        limits[field] = int(value)
    return limits


def read_keys(path: str | Path) -> KeyRing:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the API keys file {path}: {exc}") from None
    return parse_keys(text, str(path))


class KeyFile:
    """The keys of one file, reloaded when it changes.

    `watch()` (a task on the router's event loop) looks at the file every
    RELOAD_INTERVAL_S: its stat (size, mtime, inode, following symlinks, so
    a Kubernetes Secret's atomic symlink swap counts) and, when that changed,
    its text. `on_reload(outcome)` is told "ok" or "error" per attempt."""

    def __init__(self, path: str | Path,
                 on_reload: Callable[[str], object] = lambda outcome: None) -> None:
        self.path = Path(path)
        self.ring = read_keys(self.path)  # ValueError at start: the router does not start
        self._signature = self._stat()
        self._on_reload = on_reload

    def _stat(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def poll(self) -> bool:
        """Reload if the file changed; True when the keys were replaced."""
        signature = self._stat()
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            ring = read_keys(self.path)
        except ValueError as exc:
            log.error("API keys not reloaded, the previous %d key(s) stay in force: %s",
                      len(self.ring.keys), exc)
            self._on_reload("error")
            return False
        if ring != self.ring:
            added = sorted(set(ring.names) - set(self.ring.names))
            removed = sorted(set(self.ring.names) - set(ring.names))
            log.info("API keys reloaded from %s: %d key(s); added %s, removed %s",
                     self.path, len(ring.keys), added or "none", removed or "none")
        self.ring = ring
        self._on_reload("ok")
        return True

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_INTERVAL_S)
            self.poll()
