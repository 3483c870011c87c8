#!/usr/bin/env python3
"""Run llama.cpp's own `convert_hf_to_gguf.py` (vendored in the llama-cpp-python sdist) on a test checkpoint.

    python tools/llamacpp_convert.py --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp \
        MODEL_DIR --outtype f32 --outfile model.gguf

The converter runs unmodified except for two environment facts of the test checkpoints, patched here:
- their byte-level BPE is trained locally, so its pre-tokenizer hash is in no table: it is declared "gpt-2"
  (GPT-2's regex and byte-level mapping, which is what tools/make_checkpoint.py trains);
- `sentencepiece` is not installed: Llama's vocab loader tries it first and falls back on FileNotFoundError
  (the test checkpoints have no tokenizer.model), so the missing module is reported as that.
The converter and its `gguf-py` are imported from the sdist folder, so the conversion is llama.cpp's own.
tools/llama_peer.py (the bench's llama.cpp peer) converts through this wrapper too, and keeps the sdist unpacked
in its cache (`python tools/llama_peer.py fetch`), where tests/test_gguf.py finds it.
"""
from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--llama-cpp":
        print("usage: llamacpp_convert.py --llama-cpp DIR [convert_hf_to_gguf.py arguments]", file=sys.stderr)
        return 2
    root = Path(argv[0 + 1]).resolve()
    script = root / "convert_hf_to_gguf.py"
    if not script.is_file():
        print(f"error: {script} not found", file=sys.stderr)
        return 2
    sys.path[:0] = [str(root / "gguf-py"), str(root)]
    import conversion.base as base  # noqa: E402  (the sdist's, from the path above)

    original = base.TextModel.get_vocab_base_pre

    def vocab_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:  # a locally trained tokenizer: no published hash
            print("llamacpp_convert: unknown BPE pre-tokenizer hash: using 'gpt-2' (byte-level)", file=sys.stderr)
            return "gpt-2"

    def no_sentencepiece(self) -> None:
        raise FileNotFoundError("sentencepiece is not installed; the test checkpoints have no tokenizer.model")

    base.TextModel.get_vocab_base_pre = vocab_pre
    base.TextModel._set_vocab_sentencepiece = no_sentencepiece
    import convert_hf_to_gguf  # noqa: E402  (the sdist's script, a module on the path above)

    sys.argv = [str(script), *argv[2:]]
    convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
