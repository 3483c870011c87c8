"""Whether a test comparing with llama.cpp's own binaries runs, skips or fails.

`make test` builds llama.cpp into the cache outside the repository before the suite (tools/llama_peer.py build
--where-possible). Where cmake or a C++ compiler is missing those tests skip, saying which; where both exist, a
missing build is a failure, not a skip: a comparison with llama.cpp must not quietly stop running."""
from __future__ import annotations

from pathlib import Path

import pytest

from tools import llama_peer


def require_llama_cpp() -> Path:
    """The folder of the built binaries; skips without a toolchain, fails with one and no build."""
    if (done := llama_peer.built()) is not None:
        return done
    if (tool := llama_peer.missing_toolchain()) is not None:
        pytest.skip(f"llama.cpp cannot be built here: `{tool}` is not on PATH")
    if not llama_peer.source_dir().is_dir():
        pytest.skip("llama.cpp's sources are not cached and could not be fetched (offline?): "
                    "python tools/llama_peer.py build")
    pytest.fail("llama.cpp is not built although cmake and c++ exist: run `python tools/llama_peer.py build` "
                "(make test does)")
