"""Numbers several stages of the flow share: one name and one value each, and the one reader of the timeouts
that the environment may override. A leaf module: it imports only errors (a leaf too), so checkpoint/, planner/,
store/, runtime/ and the front ends may all import it."""
from __future__ import annotations

import os

from .errors import ConfigError

PAGE = 4096  # bytes: O_DIRECT's fallback alignment (every filesystem accepts it) and the CPU page slots start on
DIRECT_SLACK = 3 * PAGE  # a slot's room for an O_DIRECT read's page over-reads around the unit (store/disk.py)
BOUNCE_BYTES = 1 << 20  # O_DIRECT bounce buffer per reader thread at most, charged to the host tier as staging
READER_THREADS = 4  # disk reader threads of a store; the planner charges one bounce buffer and host slot each
DEFAULT_CONTEXT = 4096  # KV positions reserved when neither the user nor the checkpoint says less
PREFILL_CHUNK = 512  # prompt tokens per forward; the planner sizes activations for it
STALL_TIMEOUT_S = 60.0  # seconds without any read progress before a request fails with IOStallError


def seconds_from_env(name: str, default: float) -> float:
    """A positive number of seconds from environment variable `name` (`default` when unset); anything else, nan
    included, is a ConfigError naming the variable."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:  # also rejects nan
        raise ConfigError(f"{name} must be a positive number of seconds, got {text!r}")
    return value
