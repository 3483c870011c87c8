"""Grammar-constrained decoding: a Grammar (JSON schema, any JSON object, a Lark grammar or a regex) compiled by
llguidance into a matcher that, before each token is sampled, masks the logits of every token the grammar does not
allow next (-inf), then advances by the token taken.

Why llguidance: a 3 MB wheel with no dependencies (xgrammar pulls triton and a TVM runtime), JSON of any shape
(outlines-core compiles a regex and so has no "any JSON object"), Lark grammars for --grammar, and on this CPU a
mask costs tens to hundreds of microseconds a token (docs/SERVE.md has the figures), beside a forward of tens of
milliseconds or more. JSON is generated compact (", " and ": ", no free whitespace): a small model cannot then spend
its tokens on blank space inside the object.

Under speculative decoding each draft-tree row gets the mask of its own path (the matcher takes the path's tokens,
computes the mask, and rolls them back), so the verifier sees the same constrained distribution as plain decoding."""
from __future__ import annotations

import copy
import json
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..errors import ConfigError

KINDS = ("json_schema", "json_object", "lark", "regex")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # a dependency (pyproject.toml): only a broken install lacks it
        raise ConfigError("grammar: structured output needs the llguidance package (pip install llguidance)") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What the output must match. `source`: the schema as JSON text, a Lark grammar or a regex."""

    kind: str
    source: str = ""
    name: str = "grammar"  # the field or flag it came from, named in errors

    @classmethod
    def json_schema(cls, schema: dict | str, name: str = "json_schema") -> "Grammar":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{name}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        if not isinstance(schema, dict):
            raise ConfigError(f"{name}: a JSON schema must be an object, got {type(schema).__name__}")
        try:
            return cls("json_schema", json.dumps(schema), name)  # key order kept: properties come out in it
        except RecursionError:
            raise ConfigError(f"{name}: the schema is nested too deeply") from None

    @classmethod
    def json_object(cls, name: str = "response_format") -> "Grammar":
        return cls("json_object", "", name)

    @classmethod
    def lark(cls, text: str, name: str = "grammar") -> "Grammar":
        return cls("lark", text, name)

    @classmethod
    def regex(cls, pattern: str, name: str = "grammar") -> "Grammar":
        return cls("regex", pattern, name)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"{self.name}: grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str) or (self.kind in ("lark", "regex") and not self.source.strip()):
            raise ConfigError(f"{self.name}: an empty {self.kind} grammar")

    def compiled(self) -> str:
        """The llguidance grammar, checked: a ConfigError naming the field when it does not compile."""
        llg = _llguidance()
        try:
            if self.kind == "json_object":
                text = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            elif self.kind == "json_schema":
                text = llg.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
            elif self.kind == "lark":
                text = llg.LLMatcher.grammar_from_lark(self.source)
            else:
                text = llg.LLMatcher.grammar_from_regex(self.source)
        except (ValueError, RuntimeError, TypeError, RecursionError) as e:
            raise ConfigError(f"{self.name}: the {self.kind} grammar does not compile: {e}") from None
        error = llg.LLMatcher.validate_grammar(text)
        if error and not error.startswith("WARNING"):
            raise ConfigError(f"{self.name}: the {self.kind} grammar does not compile: {error}")
        return text


def as_grammar(value: Any) -> Grammar | None:
    """The `grammar=` argument: a Grammar, a Lark grammar (str) or a JSON schema (dict); None: unconstrained."""
    if value is None or isinstance(value, Grammar):
        return value
    if isinstance(value, str):
        return Grammar.lark(value)
    if isinstance(value, dict):
        return Grammar.json_schema(value, name="grammar")
    raise ConfigError(f"grammar must be a Grammar, a Lark grammar (str) or a JSON schema (dict), got "
                      f"{type(value).__name__}")


_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict[int, Any]]" = weakref.WeakKeyDictionary()


def _lltokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of the engine's tokenizer (built once per tokenizer: ~0.3 s at 2k tokens, ~1 s at 50k)."""
    if tokenizer is None:
        raise ConfigError("grammar: structured output needs the model's tokenizer (this checkpoint has none)")
    eos = sorted(tokenizer.eos_token_ids)
    if not eos:
        raise ConfigError("grammar: structured output needs an EOS token to end the output where the grammar ends")
    cache = _TOKENIZERS.setdefault(tokenizer, {})
    if vocab_size not in cache:
        llg = _llguidance()
        backend = tokenizer.backend
        try:
            if hasattr(backend, "encoding"):  # tiktoken
                from llguidance.tiktoken import lltokenizer_from_encoding

                cache[vocab_size] = lltokenizer_from_encoding(backend.encoding, n_vocab=vocab_size, eos_token=eos)
            else:
                cache[vocab_size] = llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        except (ValueError, RuntimeError) as e:  # e.g. a model whose head has fewer rows than the tokenizer's ids
            raise ConfigError(f"grammar: llguidance cannot read this tokenizer ({vocab_size} logits): {e}") from None
    return cache[vocab_size]


_SPECIALS: "weakref.WeakKeyDictionary[Any, dict[int, frozenset[int]]]" = weakref.WeakKeyDictionary()


def _special_ids(tokenizer: Any, vocab_size: int) -> frozenset[int]:
    """The ids llguidance reads as special tokens (they match only a grammar's <[id]>)."""
    cache = _SPECIALS.setdefault(tokenizer, {})
    if vocab_size not in cache:
        lt = _lltokenizer(tokenizer, vocab_size)
        cache[vocab_size] = frozenset(i for i in range(vocab_size) if lt.is_special_token(i))
    return cache[vocab_size]


def _plain_ids(tokenizer: Any, text: str) -> list[int]:
    """`text` tokenized with special-token text read as plain text."""
    backend = tokenizer.backend
    if hasattr(backend, "encoding"):  # tiktoken
        return backend.encoding.encode_ordinary(text)
    plain = copy.copy(backend)
    plain.encode_special_tokens = True
    return plain.encode(text, add_special_tokens=False).ids


class GrammarMatcher:
    """One request's grammar state: the allowed next tokens after the accepted ones (plus a draft path, for a
    speculative verifier's tree rows), then `advance` by the tokens accepted."""

    def __init__(self, grammar: Grammar, tokenizer: Any, vocab_size: int):
        llg = _llguidance()
        self.grammar = grammar
        self.vocab_size = vocab_size
        self._matcher = llg.LLMatcher(_lltokenizer(tokenizer, vocab_size), grammar.compiled(), log_level=0)
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._check()
        self._bits = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._tokenizer = tokenizer
        self._specials = torch.tensor(sorted(_special_ids(tokenizer, vocab_size) | self._eos), dtype=torch.long)

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ConfigError(f"{self.grammar.name}: {self._matcher.get_error()}")

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar allows next (EOS once the output is complete)."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        self._check()
        allowed = ((self._bits[:, None] >> self._shifts) & 1).flatten()[:self.vocab_size].bool()
        return self._special_text(allowed) if self._specials.numel() else allowed

    def _special_text(self, allowed: torch.Tensor) -> torch.Tensor:
        """llguidance's quirk: where the grammar forces text that equals a special token's (a JSON const
        "<|im_end|>"), the mask allows that special token, which the grammar then refuses (special tokens only
        match <[id]>, as the tool-call grammars name them). Such a token leaves the mask; if nothing is left, the
        forced text's first token as plain text (the tokenizer not reading special tokens in it) takes its place."""
        dropped = False
        for t in self._specials[allowed[self._specials]].tolist():
            if t in self._eos and self._matcher.is_accepting():
                continue  # the output may end here
            if self._matcher.try_consume_tokens([t]) == 1:
                self._matcher.rollback(1)
            else:
                allowed[t], dropped = False, True
        if dropped and not allowed.any():
            forced = self._matcher.compute_ff_bytes().decode("utf-8", errors="ignore")
            ids = _plain_ids(self._tokenizer, forced)
            if not ids or self._matcher.try_consume_tokens(ids[:1]) != 1:
                raise ConfigError(f"{self.grammar.name}: the grammar forces the text {forced!r}, which this "
                                  "tokenizer cannot write (it names a special token)")
            self._matcher.rollback(1)
            allowed[ids[0]] = True
        return allowed

    def masks(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """bool [R, V]: row r allows what the grammar allows after the accepted tokens + paths[r]. A row whose path
        the grammar does not take (a draft token it forbids, or one past the EOS) allows everything: the verifier
        never accepts the forbidden token, so it never reads that row."""
        out = torch.ones(len(paths), self.vocab_size, dtype=torch.bool)
        for r, path in enumerate(paths):
            taken = self._matcher.try_consume_tokens([int(t) for t in path]) if path else 0
            if taken == len(path):
                out[r] = self.allowed()
            if taken:
                self._matcher.rollback(taken)
            self._check()
        return out

    def mask(self, scores: torch.Tensor, paths: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """scores [R, V] with what the grammar forbids next at -inf (row r after paths[r]; None: no path)."""
        allowed = self.masks(paths if paths is not None else [()] * scores.shape[0]).to(scores.device)
        return scores.masked_fill(~allowed, -torch.inf)

    def advance(self, tokens: Sequence[int]) -> None:
        """Take accepted tokens; those after an EOS that ends the output are the decoder's to drop."""
        tokens = [int(t) for t in tokens]
        taken = self._matcher.try_consume_tokens(tokens)
        if taken < len(tokens) and not (tokens[taken] in self._eos and self._matcher.is_accepting()):
            self._check()
            raise ConfigError(f"{self.grammar.name}: token {tokens[taken]} does not continue the grammar")

    @property
    def complete(self) -> bool:
        return self._matcher.is_accepting()
