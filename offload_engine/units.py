"""Byte-size parsing and formatting shared by flags, budgets and reports."""
from __future__ import annotations

import re

_SUFFIXES = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float, *, what: str = "size", total: int | None = None) -> int:
    """'512MiB', '12GiB', '1.5GB', '4096', or '25%' (of `total`) -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size like '12GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{what}: size must be >= 0, got {value}")
        return int(value)
    text = str(value).strip()
    if text.endswith("%"):
        if total is None:
            raise ValueError(f"{what}: a percentage ('{text}') needs the model size, which is not known here")
        try:
            pct = float(text[:-1])
        except ValueError:
            raise ValueError(f"{what}: expected a percentage like '25%', got {text!r}") from None
        if not 0 <= pct <= 1000:
            raise ValueError(f"{what}: percentage out of range: {text!r}")
        return int(total * pct / 100)
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _SUFFIXES:
        raise ValueError(f"{what}: expected a size like '512MiB', '12GiB', '1.5GB' or '25%', got {text!r}")
    return int(float(m.group(1)) * _SUFFIXES[m.group(2).lower()])


def format_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
