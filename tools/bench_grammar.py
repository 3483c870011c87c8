"""Grammar libraries for structured output, measured on this CPU: tokenizer setup, JSON schema compile, and the mask
cost per token over a walk of up to 200 grammar-allowed tokens (random logits, masked, argmax; one torch thread).

    python tools/bench_grammar.py offload_engine/data/demo-model/tokenizer.json
    python tools/bench_grammar.py --train-bpe 50000 /tmp/bpe50k.json     # a realistic vocabulary size first

llguidance is the engine's dependency; xgrammar and outlines-core are measured when installed (pip install
xgrammar outlines-core into a scratch environment). The figures in docs/SERVE.md came from this script."""
from __future__ import annotations

import argparse
import glob
import json
import time
from typing import Callable

import torch
from tokenizers import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "kind": {"enum": ["a", "b", "c"]}},
    "required": ["name", "age", "tags", "address", "kind"], "additionalProperties": False}
STEPS = 200


def walk(vocab: int, mask: Callable[[torch.Tensor], torch.Tensor], accept: Callable[[int], object],
         done: Callable[[], bool]) -> tuple[int, float]:
    """(tokens walked, mean seconds of `mask` per token)."""
    g = torch.Generator().manual_seed(0)
    spent, n = 0.0, 0
    for _ in range(STEPS):
        if done():
            break
        logits = torch.randn(vocab, generator=g)
        start = time.perf_counter()
        allowed = mask(logits)
        spent += time.perf_counter() - start
        accept(int(allowed.argmax()))
        n += 1
    return n, spent / max(n, 1)


def bench_llguidance(path: str) -> None:
    import llguidance

    from offload_engine.generate.grammar import JSON_OPTIONS

    backend = Tokenizer.from_file(path)
    V = backend.get_vocab_size()
    start = time.perf_counter()
    tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=V, eos_token=0)
    setup = time.perf_counter() - start
    bits, shifts = torch.zeros((V + 31) // 32, dtype=torch.int32), torch.arange(32, dtype=torch.int32)
    for name, schema in (("schema", SCHEMA), ("json_object", {"type": "object"})):
        start = time.perf_counter()
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
        compile_s = time.perf_counter() - start

        def mask(logits: torch.Tensor) -> torch.Tensor:
            m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
            allowed = ((bits[:, None] >> shifts) & 1).flatten()[:V].bool()
            return logits.masked_fill(~allowed, -torch.inf)
        n, per = walk(V, mask, m.consume_token, lambda: m.is_stopped() or m.is_accepting())
        report("llguidance", name, setup, compile_s, per, n)


def bench_xgrammar(path: str) -> None:
    import transformers
    import xgrammar as xgr

    backend = Tokenizer.from_file(path)
    V = backend.get_vocab_size()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V), max_threads=1)
    setup = time.perf_counter() - start
    for name, build in (("schema", lambda: compiler.compile_json_schema(json.dumps(SCHEMA))),
                        ("json_object", compiler.compile_builtin_json_grammar)):
        start = time.perf_counter()
        m = xgr.GrammarMatcher(build())
        compile_s = time.perf_counter() - start
        bits = xgr.allocate_token_bitmask(1, V)

        def mask(logits: torch.Tensor) -> torch.Tensor:
            m.fill_next_token_bitmask(bits)
            out = logits[None].clone()
            xgr.apply_token_bitmask_inplace(out, bits)
            return out[0]
        n, per = walk(V, mask, m.accept_token, m.is_terminated)
        report("xgrammar", name, setup, compile_s, per, n)


def bench_outlines_core(path: str) -> None:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    from tokenizers import decoders

    backend = Tokenizer.from_file(path)
    V = backend.get_vocab_size()
    byte_level = decoders.ByteLevel()
    vocab: dict[bytes, list[int]] = {}
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        if i:  # 0: EOS
            vocab.setdefault(byte_level.decode([text]).encode("utf-8", "surrogatepass"), []).append(i)
    start = time.perf_counter()
    voc = outlines_core.Vocabulary(0, vocab)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    guide = outlines_core.Guide(outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), voc))
    compile_s = time.perf_counter() - start

    def mask(logits: torch.Tensor) -> torch.Tensor:
        allowed = torch.tensor(guide.get_tokens(), dtype=torch.long)
        return torch.full_like(logits, -torch.inf).index_copy(0, allowed, logits[allowed])
    n, per = walk(V, mask, guide.advance, guide.is_finished)
    report("outlines-core", "schema", setup, compile_s, per, n)


def report(lib: str, grammar: str, setup: float, compile_s: float, per: float, n: int) -> None:
    print(f"{lib:14s} {grammar:12s} setup {setup * 1e3:7.0f} ms | compile {compile_s * 1e3:7.1f} ms | "
          f"mask {per * 1e6:7.0f} us/token over {n} tokens", flush=True)


def train_bpe(size: int, out: str) -> None:
    from tokenizers import decoders, models, pre_tokenizers, trainers

    files, total = [], 0
    for f in sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True)):
        try:
            total += len(open(f, encoding="utf-8").read())
        except (OSError, UnicodeDecodeError):
            continue
        files.append(f)
        if total > 12_000_000:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=size, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokenizer", help="a tokenizers JSON file (byte-level BPE, EOS id 0)")
    ap.add_argument("--train-bpe", type=int, metavar="N", help="first train an N-token BPE into TOKENIZER")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.train_bpe:
        train_bpe(args.train_bpe, args.tokenizer)
    for bench in (bench_llguidance, bench_xgrammar, bench_outlines_core):
        try:
            bench(args.tokenizer)
        except ImportError as e:
            print(f"{bench.__name__[6:]}: not installed ({e.name})")


if __name__ == "__main__":
    main()
