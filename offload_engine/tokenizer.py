"""Tokenizer: a `tokenizers` tokenizer.json (or a tiktoken.model) plus the bits of the HF config files that
generation needs.

Reads, from a checkpoint folder:
  tokenizer.json           the vocabulary, merges, pre-tokenizer, decoder; or, when absent,
  tiktoken.model           a tiktoken BPE as Kimi checkpoints ship it (tokenizer_tiktoken.py; its special tokens
                           come from tokenizer_config.json's added_tokens_decoder)
  tokenizer_config.json    optional; bos/eos token strings, chat_template, add_bos_token/add_eos_token (used
                           only when tokenizer.json has no post-processor, which otherwise decides)
  chat_template.jinja      optional; newer checkpoints keep the template here (takes precedence)
  chat_template.json       optional; {"chat_template": "..."}
  generation_config.json   optional; eos_token_id (int or list)
  config.json              optional; eos_token_id / bos_token_id (top level or text_config)

`StreamDecoder` turns a token stream into text incrementally, never emitting half a UTF-8 character.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import processors

from .checkpoint.gguf.reader import is_gguf
from .checkpoint.gguf.tokenizer import gguf_tokenizer_fields
from .errors import CheckpointError, ConfigError
from .tokenizer_tiktoken import TIKTOKEN_FILE, TiktokenBackend, has_tiktoken

TOKENIZER_FILES = ("tokenizer.json", TIKTOKEN_FILE)  # what `Tokenizer.load_optional` looks for, in this order

_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


# ---------------------------------------------------------------------------------------------- file helpers

def _read_json(path: Path) -> dict[str, Any] | None:
    """Parsed JSON object, or None when the file does not exist. Invalid JSON names the file."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(path, f"invalid JSON: {exc}", hint="the file is corrupt or truncated") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, f"expected a JSON object, found {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """Special tokens appear as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> list[int]:
    """eos_token_id may be an int, a list of ints, or null."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _model_config_ids(config: Mapping[str, Any] | None, key: str) -> list[int]:
    """config.json ids, at top level or under text_config (multimodal checkpoints)."""
    if not config:
        return []
    found = _ids(config.get(key))
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping):
        found += _ids(text_config.get(key))
    return found


def _chat_template_source(folder: Path, tok_config: Mapping[str, Any]) -> str | None:
    """Where transformers looks for it: chat_template.jinja, chat_template.json, then tokenizer_config."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = _read_json(folder / "chat_template.json")
    if json_file is not None and isinstance(json_file.get("chat_template"), str):
        return json_file["chat_template"]
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# ---------------------------------------------------------------------------------------------- chat templates

class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers in some templates): render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes; chat templates expect plain JSON, as transformers renders it
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    """Compile the template the way transformers does: sandboxed, trim_blocks + lstrip_blocks."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# ---------------------------------------------------------------------------------------------- tokenizer

class Tokenizer:
    """Encode/decode and chat rendering for one checkpoint folder: `Tokenizer(folder)`."""

    def __init__(self, folder: str | Path):
        self._setup(**_load_folder(Path(folder)))

    @classmethod
    def load_optional(cls, folder: str | Path) -> "Tokenizer | None":
        """The folder's tokenizer, or None when it has no tokenizer file (TOKENIZER_FILES): a checkpoint
        without one still runs from token ids."""
        folder = Path(folder)
        if not is_gguf(folder) and not any((folder / name).is_file() for name in TOKENIZER_FILES):
            return None
        return cls(folder)

    @classmethod
    def from_backend(cls, backend: _HFTokenizer | TiktokenBackend, **fields: Any) -> "Tokenizer":
        """Wrap an in-memory `tokenizers.Tokenizer` (fields as in `_setup`)."""
        obj = cls.__new__(cls)
        obj._setup(backend, **fields)
        return obj

    def _setup(self, backend: _HFTokenizer | TiktokenBackend, *, bos_token: str | None = None,
               eos_token: str | None = None, eos_token_ids: Iterable[int] = (), bos_token_id: int | None = None,
               chat_template: str | None = None, source: str = "<memory>") -> None:
        self.backend = backend
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = bos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.chat_template = chat_template
        self._compiled: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids. Chat-rendered text already holds its special tokens: encode it with
        add_special_tokens=False (or use `encode_chat`), as transformers' apply_chat_template does."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_vars: Any) -> str:
        """Render messages with the checkpoint's chat template (extra variables, e.g. tools or
        enable_thinking, pass through to the template)."""
        if self.chat_template is None:
            raise ConfigError(f"{self.source}: the tokenizer has no chat_template; pass a plain prompt instead")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **template_vars}
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_vars: Any) -> list[int]:
        """apply_chat_template then encode without adding special tokens a second time."""
        text = self.apply_chat_template(messages, add_generation_prompt, **template_vars)
        return self.encode(text, add_special_tokens=False)

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


def _load_folder(folder: Path) -> dict[str, Any]:
    """Everything `Tokenizer._setup` needs, read from the checkpoint folder's files (or a GGUF file's metadata)."""
    if is_gguf(folder):
        return gguf_tokenizer_fields(folder)
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file() and not has_tiktoken(folder):
        raise CheckpointError(tok_path, f"tokenizer.json not found (nor {TIKTOKEN_FILE})",
                              hint="the engine needs a fast tokenizer (tokenizer.json); convert a "
                                   "sentencepiece-only checkpoint with transformers' AutoTokenizer.save_pretrained")
    tok_config = _read_json(folder / "tokenizer_config.json") or {}
    backend: _HFTokenizer | TiktokenBackend = (
        _load_backend(tok_path) if tok_path.is_file() else TiktokenBackend.from_folder(folder, tok_config))
    gen_config = _read_json(folder / "generation_config.json") or {}
    model_config = _read_json(folder / "config.json") or {}

    bos = _token_content(tok_config.get("bos_token"))
    eos = _token_content(tok_config.get("eos_token"))
    bos_id = backend.token_to_id(bos) if bos is not None else None
    if bos_id is None:
        bos_id = next(iter(_ids(gen_config.get("bos_token_id")) +
                           _model_config_ids(model_config, "bos_token_id")), None)
    # union: stop on any id a config calls EOS (generation_config often lists several, e.g. <|eot_id|>)
    eos_ids = set(_ids(gen_config.get("eos_token_id"))) | set(_model_config_ids(model_config, "eos_token_id"))
    if eos is not None and backend.token_to_id(eos) is not None:
        eos_ids.add(backend.token_to_id(eos))
    if isinstance(backend, _HFTokenizer) and backend.post_processor is None and (
            tok_config.get("add_bos_token") or tok_config.get("add_eos_token")):
        # tokenizer.json's post-processor is authoritative (transformers 5 drops these flags when it has
        # one); without one, honour the flags as transformers' update_post_processor would
        _set_post_processor(backend, bos if tok_config.get("add_bos_token") else None,
                            eos if tok_config.get("add_eos_token") else None)
    return dict(backend=backend, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids, bos_token_id=bos_id,
                chat_template=_chat_template_source(folder, tok_config), source=str(folder))


def _load_backend(path: Path) -> _HFTokenizer:
    try:
        return _HFTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for both bad JSON and unknown models
        raise CheckpointError(path, f"cannot load tokenizer: {exc}",
                              hint="the file is invalid JSON or from a newer tokenizers version") from None


def _set_post_processor(backend: _HFTokenizer, bos: str | None, eos: str | None) -> None:
    """[bos] $A [eos], like transformers' update_post_processor; tokens missing from the vocab are left out."""
    bos_id = backend.token_to_id(bos) if bos is not None else None
    eos_id = backend.token_to_id(eos) if eos is not None else None
    single = " ".join(
        [f"{bos}:0"] * (bos_id is not None) + ["$A:0"] + [f"{eos}:0"] * (eos_id is not None))
    pair = single + " " + " ".join(
        [f"{bos}:1"] * (bos_id is not None) + ["$B:1"] + [f"{eos}:1"] * (eos_id is not None))
    special = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if i is not None]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


# ---------------------------------------------------------------------------------------------- streaming

class StreamDecoder:
    """Incremental detokenizer: push ids one at a time, get back only newly completed text.

    Decodes a small window (the ids of the previous emission plus the new ones) rather than everything, and
    emits the difference to the window's previous text. The context keeps decoders that strip a leading
    space (sentencepiece) or merge bytes (byte-level BPE) consistent with a full decode. Text ending in
    U+FFFD is an incomplete UTF-8 sequence and waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this have been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix, len(self._ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """Whatever is still held back (possibly ending in U+FFFD: the stream ended mid-character)."""
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix, len(self._ids))
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text):]

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)
