"""The calibration text of `quantize --calibrate FILE`: read (refused clearly when missing, empty or binary),
tokenized with the model's own tokenizer, cut into windows the runtime runs (activations.py)."""
from __future__ import annotations

import codecs
from pathlib import Path

import torch

from ..errors import ConfigError
from ..tokenizer import Tokenizer

WINDOW = 512  # default tokens per calibration window (each its own sequence, causal attention within it)
MIN_TOKENS = 16  # fewer than this calibrate nothing worth the name
BYTES_PER_TOKEN = 32  # the file's head read is this many bytes per token asked for (real text: ~3-5)


def read_text(path: str | Path, tokens: int) -> str:
    """The head of the file as text: enough for `tokens` tokens. Refuses a missing, non-regular, empty, or
    binary (NUL bytes, not UTF-8) file, naming --calibrate and the file."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--calibrate {p}: no such file")
    if not p.is_file():
        raise ConfigError(f"--calibrate {p}: not a regular file (give a text file)")
    with open(p, "rb") as f:
        raw = f.read(max(1 << 20, tokens * BYTES_PER_TOKEN))
    if b"\0" in raw:
        raise ConfigError(f"--calibrate {p}: looks binary (NUL bytes); give a UTF-8 text file")
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(raw, final=False)  # a cut character at the end is fine
    except UnicodeDecodeError as e:
        raise ConfigError(f"--calibrate {p}: not UTF-8 text (byte {e.start}); give a UTF-8 text file") from None
    if not text.strip():
        raise ConfigError(f"--calibrate {p}: the file is empty")
    return text


def calibration_windows(path: str | Path, model: Path, tokens: int, max_positions: int | None = None,
                        window: int = WINDOW) -> list[torch.Tensor]:
    """The first `tokens` tokens of the file (the model's tokenizer, no special tokens added), in windows of
    `window` (or the model's max_position_embeddings if smaller); the last window may be shorter."""
    text = read_text(path, tokens)
    tokenizer = Tokenizer.load_optional(model)
    if tokenizer is None:
        raise ConfigError(f"--calibrate: {model} has no tokenizer to read the calibration text with")
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    if len(ids) < MIN_TOKENS:
        raise ConfigError(f"--calibrate {path}: only {len(ids)} tokens of text; at least {MIN_TOKENS} are needed")
    window = min(window, max_positions or window)
    return [torch.tensor(ids[i:i + window], dtype=torch.long) for i in range(0, len(ids), window)]
