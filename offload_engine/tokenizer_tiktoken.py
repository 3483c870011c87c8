"""A tiktoken BPE (`tiktoken.model`, as Moonshot's Kimi checkpoints ship it) behind the small part of the
`tokenizers.Tokenizer` interface that `tokenizer.Tokenizer` uses.

The folder's layout, as Kimi's tokenization_kimi.py reads it (that file is a format spec here, never imported):
  tiktoken.model          one `<base64 token bytes> <rank>` per line; ranks are the ids 0..N-1
  tokenizer_config.json   `added_tokens_decoder`: {"<id>": {"content": "[BOS]", "special": true}, ...}
Special tokens take ids N..N+255; an id there that `added_tokens_decoder` does not name is
`<|reserved_token_<id>|>`. Text is split by Kimi's pre-tokenizer regex (`KIMI_PAT_STR`) and special-token text
in the input is always recognised; encoding never adds a BOS/EOS (Kimi's tokenizer adds none).
"""
from __future__ import annotations

import base64
import binascii
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, NamedTuple

import tiktoken

from .errors import CheckpointError

TIKTOKEN_FILE = "tiktoken.model"
NUM_RESERVED_SPECIAL = 256  # ids N..N+255 belong to special tokens

# Kimi's pre-tokenizer: o200k-like, Han runs kept together and subtracted from the letter classes
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# tiktoken panics (a BaseException) on very long inputs and very long runs of (non-)whitespace: encode in
# windows, cut as Kimi's tokenizer cuts, so long inputs give the ids the checkpoint's own tokenizer gives
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


class _Encoded(NamedTuple):
    ids: list[int]


def load_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file. (tiktoken.load would also do it, but it caches a copy under the temp
    folder keyed by the path, so an edited or replaced file could be read stale.)"""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(path, f"cannot read the tiktoken BPE file: {exc.strerror or exc}") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError(f"{len(fields)} fields")
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error) as exc:
            raise CheckpointError(path, f"line {lineno} is not '<base64 token> <rank>' ({exc})",
                                  hint="the file is corrupt or truncated") from None
        if token in ranks:
            raise CheckpointError(path, f"line {lineno}: token {token!r} listed twice "
                                        f"(ranks {ranks[token]} and {rank})")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(path, f"ranks are not the ids 0..{len(ranks) - 1}, each once",
                              hint="the file is corrupt or truncated")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # BPE falls back to single bytes: without all 256, some text cannot be encoded at all
        raise CheckpointError(path, f"{len(missing)} of the 256 single-byte tokens are missing "
                                    f"(e.g. byte {missing[0]})")
    return ranks


def special_tokens(added_tokens_decoder: Any, num_base: int, where: Path) -> tuple[dict[str, int], set[int]]:
    """(content -> id for every special id, the ids to drop when decoding with skip_special_tokens)."""
    if added_tokens_decoder is None:
        added_tokens_decoder = {}
    if not isinstance(added_tokens_decoder, Mapping):
        raise CheckpointError(where, "added_tokens_decoder must be an object of id -> {\"content\": ...}")
    named: dict[int, str] = {}
    plain: set[int] = set()  # "special": false: matched in text but kept when decoding
    for key, entry in added_tokens_decoder.items():
        content = entry.get("content") if isinstance(entry, Mapping) else None
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            token_id = -1
        if token_id < 0 or not isinstance(content, str) or not content:
            raise CheckpointError(where, f"added_tokens_decoder[{key!r}]: expected a token id and "
                                         f"{{\"content\": \"<non-empty string>\"}}")
        if token_id < num_base:
            raise CheckpointError(where, f"added token {content!r} has id {token_id}, which is a BPE rank of "
                                         f"{TIKTOKEN_FILE} (special tokens start at {num_base})")
        named[token_id] = content
        if isinstance(entry, Mapping) and entry.get("special") is False:
            plain.add(token_id)
    top = max([num_base + NUM_RESERVED_SPECIAL - 1, *named])
    table: dict[str, int] = {}
    for token_id in range(num_base, top + 1):
        content = named.get(token_id, f"<|reserved_token_{token_id}|>")
        if content in table:
            raise CheckpointError(where, f"special token {content!r} has two ids ({table[content]} and {token_id})")
        table[content] = token_id
    return table, set(table.values()) - plain


class TiktokenBackend:
    """tiktoken.Encoding with the `tokenizers.Tokenizer` methods `Tokenizer` calls."""

    post_processor = None  # nothing is ever added around the ids

    def __init__(self, encoding: tiktoken.Encoding, ranks: Mapping[bytes, int], specials: Mapping[str, int],
                 skip_ids: Iterable[int]):
        self.encoding = encoding
        self._ranks = ranks  # the same dict the encoding was built from: no second copy
        self._specials = dict(specials)
        self._skip = frozenset(skip_ids)

    @classmethod
    def from_folder(cls, folder: Path, tok_config: Mapping[str, Any]) -> "TiktokenBackend":
        path = folder / TIKTOKEN_FILE
        ranks = load_ranks(path)
        specials, skip = special_tokens(tok_config.get("added_tokens_decoder"), len(ranks),
                                        folder / "tokenizer_config.json")
        try:
            encoding = tiktoken.Encoding(name=str(path), pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                         special_tokens=specials)
        except Exception as exc:  # tiktoken's Rust core reports bad input as plain exceptions
            raise CheckpointError(path, f"tiktoken cannot build the encoding: {exc}") from None
        return cls(encoding, ranks, specials, skip)

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.encoding.n_vocab if with_added_tokens else self.encoding.n_vocab - len(self._specials)

    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoded:
        ids: list[int] = []
        for piece in _windows(text):
            ids += self.encoding.encode(piece, allowed_special="all")
        return _Encoded(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # ids the encoding does not have are dropped, as `tokenizers` does (a padded embedding can emit them)
        n = self.encoding.n_vocab
        keep = [i for i in ids if 0 <= i < n and not (skip_special_tokens and i in self._skip)]
        return self.encoding.decode_bytes(keep).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        found = self._specials.get(token)  # bos/eos lookups at load: no need to spell out the whole vocabulary
        return found if found is not None else self._vocab.get(token)

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, byte-level tokens spelt as a converted tokenizer.json spells them."""
        return dict(self._vocab)

    @cached_property
    def _vocab(self) -> dict[str, int]:
        alphabet = _byte_alphabet()
        vocab = {"".join(alphabet[b] for b in token): rank
                 for token, rank in self._ranks.items()}
        vocab.update(self._specials)
        return vocab


def has_tiktoken(folder: Path) -> bool:
    return (folder / TIKTOKEN_FILE).is_file()


def _windows(text: str) -> Iterator[str]:
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        yield from _split_long_runs(text[start:start + _MAX_ENCODE_CHARS])


def _split_long_runs(text: str) -> Iterator[str]:
    """Cut `text` so no piece has a run of more than _MAX_RUN_CHARS whitespace or non-whitespace chars."""
    cut, run, space = 0, 0, text[:1].isspace()
    for i, ch in enumerate(text):
        if ch.isspace() != space:
            run, space = 1, not space
            continue
        run += 1
        if run > _MAX_RUN_CHARS:
            yield text[cut:i]
            cut, run = i, 1
    yield text[cut:]


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map (what ByteLevel tokenizer.json files spell tokens with)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]
