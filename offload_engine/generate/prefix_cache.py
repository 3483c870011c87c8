"""Token-id prefix matching: the length two sequences share. The prompt cache (prompt_cache.py) reuses the cache
of the longest one a prompt shares; tools/llama_compare.py and its test compare outputs with it."""
from __future__ import annotations

from typing import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
