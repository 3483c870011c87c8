"""The tokenizer a GGUF file carries in its metadata, as a `tokenizers` Tokenizer plus the fields the engine's
Tokenizer takes (offload_engine/tokenizer.py `Tokenizer.from_backend`).

`tokenizer.ggml.model` "gpt2" (byte-level BPE: every Llama 3, Qwen, DeepSeek-V3 file) is built from the token
list and merges, with the pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre` (its regexes, llama-vocab.cpp);
control and user-defined tokens become added tokens. "llama" (SentencePiece: Llama 2, Mistral, Mixtral) is built in
spm.py. `tokenizer.chat_template` is the chat template. Other tokenizer models ("t5", "bert", ...) and unknown
pre-tokenizers are refused by name.
"""
from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from .reader import GGUFFile, read_gguf
from .spm import CONTROL, USER_DEFINED, spm_backend

GPT2 = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",)
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+",)
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+",)
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+",)  # Qwen3.5/3.6: QWEN2 with combining marks (\p{M}) kept in words
DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
             r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
             r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",)  # o200k (gpt-oss)
# tokenizer.ggml.pre -> (regexes applied in turn, ignore_merges: whole-word vocab hits skip the merges)
PRE = {"default": (GPT2, False), "gpt-2": (GPT2, False), "gpt2": (GPT2, False), "llama-bpe": (LLAMA3, True), "llama3": (LLAMA3, True),
       "smaug-bpe": (LLAMA3, True), "qwen2": (QWEN2, False), "deepseek-r1-qwen": (QWEN2, False),
       "deepseek-v3": (DEEPSEEK3, False), "gpt-4o": (GPT4O, False),
       "qwen35": (QWEN35, False)}


def _pre_tokenizer(pre: str, path) -> tuple[Any, bool]:
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE:
        raise ConfigError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported; supported: {', '.join(sorted(PRE))}")
    regexes, ignore_merges = PRE[pre]
    if regexes is GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), ignore_merges
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
    return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), \
        ignore_merges


def _token(g: GGUFFile, key: str, tokens: list[str]) -> tuple[str | None, int | None]:
    i = g.get(f"tokenizer.ggml.{key}_token_id")
    return (tokens[i], i) if isinstance(i, int) and 0 <= i < len(tokens) else (None, None)


def build_backend(g: GGUFFile):
    """A `tokenizers.Tokenizer` from the GGUF metadata, and the fields of the engine's Tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = g.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ConfigError(f"{g.path}: tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', byte-level "
                          f"BPE; 'llama', SentencePiece BPE); run with token ids, or use the Hugging Face folder's "
                          f"tokenizer")
    tokens = list(g.get("tokenizer.ggml.tokens") or [])
    types = list(g.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if not tokens or len(types) != len(tokens):
        raise ConfigError(f"{g.path}: tokenizer.ggml.tokens / token_type missing or of different lengths")
    if kind == "llama":
        named = {k: t for k in ("unknown", "bos", "eos", "padding") for t in [_token(g, k, tokens)]
                 if t[0] is not None}
        return _fields(g, spm_backend(g, tokens, types, named), tokens)
    merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges") or []]
    pre, ignore_merges = _pre_tokenizer(g.get("tokenizer.ggml.pre") or "default", g.path)
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=ty == CONTROL, normalized=False) for t, ty in zip(tokens, types)
             if ty in (CONTROL, USER_DEFINED)]
    backend.add_special_tokens([a for a in added if a.special])
    backend.add_tokens([a for a in added if not a.special])
    bos, bos_id = _token(g, "bos", tokens)
    if g.get("tokenizer.ggml.add_bos_token") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1",
                                                               special_tokens=[(bos, bos_id)])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return _fields(g, backend, tokens)


def _fields(g: GGUFFile, backend: Any, tokens: list[str]) -> dict[str, Any]:
    """The engine Tokenizer's fields: BOS, EOS, the ids that stop generation, the chat template."""
    bos, bos_id = _token(g, "bos", tokens)
    eos, _ = _token(g, "eos", tokens)
    stop = {i for key in ("eos", "eot", "eom") for i in [_token(g, key, tokens)[1]] if i is not None}
    return dict(backend=backend, bos_token=bos, eos_token=eos, eos_token_ids=stop, bos_token_id=bos_id,
                chat_template=g.get("tokenizer.chat_template"), source=str(g.path))


def gguf_tokenizer_fields(path) -> dict[str, Any]:
    return build_backend(read_gguf(path))
