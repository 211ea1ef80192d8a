"""Open a GGUF file and read its metadata, with errors that name the file.

Called by `engine.gguf.convert` (once per conversion). The `gguf` package
(llama.cpp's own reader) parses the file; it memory-maps the tensor data,
so opening reads only the header and the metadata (the tokenizer's 50k
strings take most of the few seconds it needs).

A file that is not GGUF, is truncated, or whose header lies about its
sizes fails here, before anything is written: the `gguf` reader checks the
magic and maps every tensor's byte range, and a range past the end of the
file raises. Every failure becomes a `CheckpointError` naming the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError


@dataclass(frozen=True)
class GGUFFile:
    """An opened GGUF file: its metadata as plain Python values (str, int,
    float, bool, lists of those) and the `gguf` reader for its tensors."""

    path: Path
    metadata: Mapping[str, Any]
    reader: Any  # gguf.GGUFReader (imported lazily: an optional dependency)

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None, *,
            required: bool = False) -> Any:
        """`metadata[key]` checked to be of `kind` (bool is not an int here);
        `default` when absent, or CheckpointError when `required`."""
        if key not in self.metadata:
            if required:
                raise CheckpointError(f"{self.path}: metadata key {key} is missing")
            return default
        value = self.metadata[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            value = None  # a flag where a number is expected: wrong either way
        if not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise CheckpointError(f"{self.path}: metadata key {key} must be {names}, "
                                  f"got {self.metadata[key]!r}")
        return value

    def positive(self, key: str, default: int | None = None) -> int:
        """An integer key that must be > 0 (sizes, counts)."""
        value = self.get(key, int, default, required=default is None)
        if value <= 0:
            raise CheckpointError(f"{self.path}: metadata key {key} must be > 0, got {value}")
        return value


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse `path`'s header and metadata; CheckpointError if it is missing,
    not GGUF, or truncated."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    try:
        import gguf
    except ImportError:
        raise CheckpointError(f"{path}: reading GGUF files needs the `gguf` package "
                              "(pip install gguf)") from None
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError, ...
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(exc).__name__}: "
                              f"{exc}); is it truncated or not GGUF?") from None
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the header's own counts, not model metadata
        try:
            metadata[key] = field.contents()
        except Exception as exc:
            raise CheckpointError(f"{path}: metadata key {key} is unreadable: {exc}") from None
    return GGUFFile(path, metadata, reader)
