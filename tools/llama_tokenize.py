#!/usr/bin/env python3
"""llama.cpp's own tokenizer on a GGUF file: `llama_tokenize` of the cached CPU build (tools/llama_peer.py build),
called through the ctypes bindings of the llama-cpp-python sdist it was built from. The model is loaded vocabulary
only, so a file with no tensors will do.

    python tools/llama_tokenize.py FILE.gguf < texts.json    # -> {"with_special": [[ids]...], "without": [...]}

Reads a JSON list of texts on stdin and prints, for each, the ids with BOS/EOS as the file says (add_special) and
without, special tokens parsed in the text both times (as llama-server and llama-cli do). Test tooling: run it in a
subprocess, llama.cpp logs to stderr and a crash there should not take the caller down.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.llama_peer import bin_dir, source_dir  # noqa: E402


def available() -> bool:
    """The sdist's bindings and the built libllama are both there."""
    return (source_dir().parents[1] / "llama_cpp" / "llama_cpp.py").is_file() and (bin_dir() / "libllama.so").is_file()


def _bindings():
    """llama_cpp.llama_cpp without the package's __init__ (which imports the high-level API and its extra
    dependencies), pointed at the cached build's libllama."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(bin_dir())
    package = types.ModuleType("llama_cpp")
    package.__path__ = [str(source_dir().parents[1] / "llama_cpp")]
    sys.modules["llama_cpp"] = package
    import llama_cpp.llama_cpp as lib

    return lib


def tokenize(path: Path, texts: list[str]) -> dict[str, list[list[int]]]:
    lib = _bindings()
    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise SystemExit(f"{path}: llama.cpp could not load the vocabulary (its log is above)")
    vocab = lib.llama_model_get_vocab(model)

    def ids(text: str, add_special: bool) -> list[int]:
        data = text.encode()
        out = (lib.llama_token * (len(data) + 8))()  # at most one token per byte, plus BOS/EOS
        n = lib.llama_tokenize(vocab, data, len(data), out, len(out), add_special, True)
        if n < 0:
            raise SystemExit(f"llama_tokenize needs {-n} tokens for {text!r}")
        return list(out[:n])

    result = {"with_special": [ids(t, True) for t in texts], "without": [ids(t, False) for t in texts]}
    lib.llama_model_free(model)
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(tokenize(Path(args[0]), json.load(sys.stdin))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
