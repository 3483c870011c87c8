#!/usr/bin/env python3
"""Greedy text from llama.cpp and from this engine on the same GGUF file (made by llama.cpp's own converter, and
quantized by its own llama-quantize): where do they part? Prints a table and writes JSON.

    python tools/llama_compare.py --model offload_engine/data/demo-model --types f32,Q8_0 --tokens 32

The engine's figures on a GGUF equal its figures on the source folder and transformers' (tests/test_gguf.py),
so a difference here is llama.cpp's own arithmetic or its reading of the model.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload_engine import Engine  # noqa: E402
from offload_engine.generate.prefix_cache import common_prefix  # noqa: E402
from tools.llama_peer import complete, convert, quantize  # noqa: E402

PROMPTS = ("import json\n\n\ndef read_config(path):\n", "class Stack:\n    def __init__(self):\n",
           "def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "offload_engine" / "data" / "demo-model")
    ap.add_argument("--types", default="f32,Q8_0", help="f32 and/or llama-quantize types")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "llama-compare")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    base = convert(a.model, a.out / f"{a.model.name}-f32.gguf", "f32")
    rows = []
    for qtype in a.types.split(","):
        gguf = base if qtype == "f32" else quantize(base, qtype)
        with Engine.open(gguf, dtype="float32", max_context=512) as engine:
            for prompt in PROMPTS:
                ids = engine.tokenizer.encode(prompt)
                mine = engine.tokenizer.decode(
                    engine.generate(ids, max_new_tokens=a.tokens, ignore_eos=True).token_ids).encode()
                theirs = complete(gguf, prompt, a.tokens)  # engine and llama.cpp alike: N tokens
                # the engine's text replaces a token's partial UTF-8 with U+FFFD: compare up to the first one
                rows.append({"type": qtype, "prompt": prompt, "agreeing_bytes": common_prefix(mine, theirs),
                             "engine": mine.decode(errors="replace"), "llama_cpp": theirs.decode(errors="replace")})
    print(f"{'type':6} {'agree':>5}  prompt / engine / llama.cpp")
    for r in rows:
        print(f"{r['type']:6} {r['agreeing_bytes']:5}  {r['prompt'][:30]!r}\n{'':13}{r['engine'][:70]!r}\n"
              f"{'':13}{r['llama_cpp'][:70]!r}")
    (a.out / "llama-compare.json").write_text(json.dumps({"model": str(a.model), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
