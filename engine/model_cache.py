"""Where converted and generated models are kept: `models_home()`.

Read by `engine.model_source` (GGUF conversions) and `engine.make_model`
(the built-in models), so both name one directory without importing each
other. The one place PDSERVE_HOME is read.
"""

from __future__ import annotations

import os
from pathlib import Path


def models_home() -> Path:
    """$PDSERVE_HOME/models, PDSERVE_HOME defaulting to ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_HOME", "~/.cache/pdserve")).expanduser() / "models"
