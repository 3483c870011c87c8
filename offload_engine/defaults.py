"""Where the bundled default model lives."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError

PACKAGE_MODEL = Path(__file__).parent / "data" / "demo-model"
REPO_MODEL = Path(__file__).resolve().parents[1] / ".cache" / "demo-model"  # written by `make demo`


def default_model_path() -> Path:
    """OFFLOAD_ENGINE_MODEL, else the model shipped in the package, else the one `make demo` generates."""
    env = os.environ.get("OFFLOAD_ENGINE_MODEL")
    if env:
        return Path(env)
    for candidate in (PACKAGE_MODEL, REPO_MODEL):
        if (candidate / "config.json").is_file():
            return candidate
    raise ConfigError("no --model given and no bundled default model found; run `make demo` once to generate it, "
                      "or pass --model DIR")
