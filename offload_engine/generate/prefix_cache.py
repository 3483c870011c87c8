"""The last sequence's KV cache (and recurrent state), kept between requests: a prompt that extends its token ids
prefills only the new suffix. The match is exact, on token ids; anything else gets a fresh cache."""
from __future__ import annotations

from typing import Any, Callable, Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Holds one cache and the ids of the positions it has committed (cache.length of them)."""

    def __init__(self, new_cache: Callable[[], Any]):
        self.new_cache = new_cache  # a cache of the engine's whole context (its KV bytes are in the budget)
        self.cache: Any = None
        self.ids: list[int] = []

    def take(self, prompt: Sequence[int], needed: int) -> tuple[Any, int]:
        """A cache for `prompt` (which then forwards prompt[reused:]) and `reused`, the positions it already holds.
        At least the prompt's last token is always forwarded: its logits give the first new token."""
        cache, ids = self.cache, self.ids
        self.cache, self.ids = None, []  # taken: a request that fails leaves nothing behind
        if cache is not None and needed <= cache.capacity:
            keep = min(common_prefix(ids, prompt), len(prompt) - 1)
            if keep > 0:
                try:
                    cache.trim(cache.length - keep)
                    return cache, keep
                except ValueError:  # a recurrent state that cannot be rewound to `keep` (after a chunked prefill)
                    pass
        return self.new_cache(), 0

    def give_back(self, cache: Any, sequence: Sequence[int]) -> None:
        """Keep `cache` for the next request; `sequence` is the prompt then the generated ids, of which the cache
        holds the first cache.length (the last generated id is never forwarded)."""
        if cache.length <= len(sequence):
            self.cache, self.ids = cache, list(sequence[:cache.length])

    def clear(self) -> None:
        self.cache, self.ids = None, []
