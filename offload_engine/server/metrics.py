"""Server counters and their Prometheus text exposition (GET /metrics)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Metrics:
    requests: int = 0
    errors: dict[int, int] = field(default_factory=dict)  # error answers by HTTP status
    prompt_tokens: int = 0
    completion_tokens: int = 0
    generated_tokens: int = 0  # every token the engine produced, those of requests cancelled midway included
    reused_prompt_tokens: int = 0
    decode_tok_s: float = 0.0  # of the last request
    hit_rate: float = 1.0  # of the last request, in the tier the model computes from
    bytes_read: dict[str, int] = field(default_factory=dict)  # per tier
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, stats: dict) -> None:
        """Fold one finished request's engine stats in."""
        with self.lock:
            self.requests += 1
            self.prompt_tokens += int(stats.get("prompt_tokens", 0))
            self.completion_tokens += int(stats.get("generated_tokens", 0))
            self.reused_prompt_tokens += int(stats.get("reused_prompt_tokens", 0))
            self.decode_tok_s = float(stats.get("decode_tok_s", 0.0))
            self.hit_rate = float(stats.get("hit_rate", 1.0))
            # bytes moved into each tier: disk -> host (or device) reads, and host -> device copies
            for tier, key in (("disk", "bytes_read_disk"), ("host_to_device", "bytes_host_to_device")):
                value = stats.get(key)
                if isinstance(value, (int, float)):
                    self.bytes_read[tier] = self.bytes_read.get(tier, 0) + int(value)

    def count_error(self, status: int) -> None:
        with self.lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def count_token(self) -> None:
        with self.lock:
            self.generated_tokens += 1

    def text(self, queue_length: int, busy: bool, prompt_cache: dict | None = None) -> str:
        """prompt_cache: the engine's PromptCache.snapshot() (saved prefixes: entries, bytes, hits, tokens)."""
        with self.lock:
            lines = [
                "# TYPE offload_engine_requests_total counter", f"offload_engine_requests_total {self.requests}",
                "# TYPE offload_engine_request_errors_total counter",
                *(f'offload_engine_request_errors_total{{status="{c}"}} {n}' for c, n in sorted(self.errors.items())),
                "# TYPE offload_engine_prompt_tokens_total counter",
                f"offload_engine_prompt_tokens_total {self.prompt_tokens}",
                "# TYPE offload_engine_reused_prompt_tokens_total counter",
                f"offload_engine_reused_prompt_tokens_total {self.reused_prompt_tokens}",
                "# TYPE offload_engine_completion_tokens_total counter",
                f"offload_engine_completion_tokens_total {self.completion_tokens}",
                "# TYPE offload_engine_generated_tokens_total counter",
                f"offload_engine_generated_tokens_total {self.generated_tokens}",
                "# TYPE offload_engine_decode_tokens_per_second gauge",
                f"offload_engine_decode_tokens_per_second {self.decode_tok_s:.6g}",
                "# TYPE offload_engine_hit_rate gauge",
                f"offload_engine_hit_rate {self.hit_rate:.6g}",
                "# TYPE offload_engine_bytes_read_total counter",
                *(f'offload_engine_bytes_read_total{{tier="{t}"}} {n}' for t, n in sorted(self.bytes_read.items())),
                "# TYPE offload_engine_queue_length gauge", f"offload_engine_queue_length {queue_length}",
                "# TYPE offload_engine_busy gauge", f"offload_engine_busy {int(busy)}",
            ]
        return "\n".join(lines + _prompt_cache_lines(prompt_cache)) + "\n"


def _prompt_cache_lines(c: dict | None) -> list[str]:
    """Saved prefixes (serve --cache-ram) and reuse by source: "last" (the last sequence's cache, in place) or
    "saved" (a saved prefix, copied in); a miss reused nothing."""
    if c is None:
        return []
    p = "offload_engine_prompt_cache"
    return [f"# TYPE {p}_limit_bytes gauge", f"{p}_limit_bytes {c['limit_bytes']}",
            f"# TYPE {p}_entries gauge", f"{p}_entries {c['entries']}",
            f"# TYPE {p}_bytes gauge", f"{p}_bytes {c['bytes']}",
            f"# TYPE {p}_hits_total counter", *(f'{p}_hits_total{{source="{s}"}} {n}' for s, n in c["hits"].items()),
            f"# TYPE {p}_misses_total counter", f"{p}_misses_total {c['misses']}",
            f"# TYPE {p}_tokens_reused_total counter",
            *(f'{p}_tokens_reused_total{{source="{s}"}} {n}' for s, n in c["tokens"].items()),
            f"# TYPE {p}_evictions_total counter", f"{p}_evictions_total {c['evictions']}"]

