"""A SentencePiece vocabulary from GGUF metadata (`tokenizer.ggml.model` "llama": Llama 2, Mistral, Mixtral files)
as a `tokenizers` BPE with byte fallback, tokenizing as llama.cpp does (tests/test_gguf_tokenizer.py checks it
against llama.cpp's own llama_tokenize and against transformers).

The file has the pieces, their scores and types but no merges: the merges are derived from the vocabulary, each
split of a piece into two pieces of the vocabulary ranked by the piece's score, as transformers' GGUF loader does
(tokenization_utils_base.generate_merges). The space prefix (`tokenizer.ggml.add_space_prefix`, default on) is a
`Prepend("▁")` normalizer, applied to every run of text between added tokens: what llama.cpp (llama-vocab.cpp,
`add_space_prefix && is_prev_special`), SentencePiece and Llama 2's own tokenizer.json do. transformers' GGUF
loader differs in two places: for "llama" it uses `Metaspace(prepend_scheme="first")`, which adds no "▁" to text
that starts with a space or follows an added token (" Hello" is [15043] there, [29871, 15043] in llama.cpp; it
uses this normalizer for Phi-3's vocabulary), and it does not read add_space_prefix (always prefixes).
"""
from __future__ import annotations

from typing import Any

from ...errors import ConfigError

CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType
SPACE = "\u2581"  # SentencePiece's visible space


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best-scored piece first (ties: shorter left
    part, then shorter right part; splits of one piece in vocabulary order), as transformers' generate_merges."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[str, str, float]] = []
    for piece, score in dict(zip(tokens, scores)).items():  # a repeated piece keeps its last score, as there
        splits = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                  if piece[:k] in vocab and piece[k:] in vocab]
        ranked.extend(sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def spm_backend(g: Any, tokens: list[str], types: list[int], named: dict[str, tuple[str, int]]):
    """The `tokenizers.Tokenizer` of a "llama" (SentencePiece) vocabulary in GGUF file `g` (a GGUFFile); `named`:
    the tokens the metadata names by id ("unknown", "bos", "eos", "padding" -> (token, id)), those it has."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    if g.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges")]
    else:
        scores = list(g.get("tokenizer.ggml.scores") or [])
        if len(scores) != len(tokens):
            raise ConfigError(f"{g.path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens; "
                              f"a SentencePiece vocabulary's merges are derived from its scores")
        merges = merges_from_scores(tokens, scores)
    unk = named.get("unknown", (None, None))[0]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=unk, fuse_unk=True,
                                   byte_fallback=True))
    prefix = g.get("tokenizer.ggml.add_space_prefix", True)  # llama.cpp's default for SentencePiece
    replace = normalizers.Replace(" ", SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] * bool(prefix))
    # control tokens special, user-defined ones plain, both matched whole in the text; then the named tokens not
    # among them as special (transformers adds them as its unk/bos/eos/pad tokens)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    added = {a.content for a in backend.get_added_tokens_decoder().values()}
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in dict.fromkeys(t for t, _ in named.values()) if t not in added])
    backend.post_processor = _post_processor(g, named)
    return backend


def _post_processor(g: Any, named: dict[str, tuple[str, int]]):
    """[BOS] $A [EOS] as the add_bos/add_eos flags say (transformers' update_post_processor); llama.cpp adds BOS to
    a SentencePiece vocabulary whose file does not say otherwise."""
    from tokenizers import processors

    bos = named.get("bos") if g.get("tokenizer.ggml.add_bos_token", True) else None
    eos = named.get("eos") if g.get("tokenizer.ggml.add_eos_token", False) else None
    single = " ".join(([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else []))
    pair = " ".join([single] + ([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else []))
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=list(dict.fromkeys(t for t in (bos, eos) if t)))
