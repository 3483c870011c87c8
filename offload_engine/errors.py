"""Typed errors. Every message names the file, tensor or flag concerned, what was expected and what was found."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator, Mapping


class OffloadEngineError(Exception):
    """Base class of every error the engine raises on purpose."""

    exit_code = 1


class ConfigError(OffloadEngineError, ValueError):
    """A flag, option or config file value is invalid."""

    exit_code = 2


class CheckpointError(OffloadEngineError):
    """A checkpoint folder cannot be used (missing files, unsupported architecture, pickle-only...)."""

    exit_code = 2

    def __init__(self, path: Any, reason: str, *, tensor: str | None = None, hint: str | None = None):
        self.path = str(path)
        self.tensor = tensor
        self.reason = reason
        self.hint = hint
        where = self.path if tensor is None else f"{self.path}: tensor '{tensor}'"
        msg = f"{where}: {reason}"
        if hint:
            msg += f" (hint: {hint})"
        super().__init__(msg)


class CheckpointFormatError(CheckpointError):
    """A safetensors header, index or config is malformed or disagrees with itself."""

    def __init__(self, path: Any, reason: str, *, tensor: str | None = None, offset: int | None = None,
                 hint: str | None = None):
        self.offset = offset
        if offset is not None:
            reason = f"{reason} (at byte offset {offset})"
        super().__init__(path, reason, tensor=tensor, hint=hint)


class PlanError(OffloadEngineError):
    """No placement satisfies the request."""

    exit_code = 3


class BudgetError(PlanError):
    """A memory budget is too small, or an allocation would exceed it."""

    def __init__(self, resource: str, required: int, available: int,
                 breakdown: Mapping[str, int] | None = None, hint: str | None = None):
        self.resource = resource
        self.required = int(required)
        self.available = int(available)
        self.breakdown = dict(breakdown or {})
        from .units import format_bytes  # local import: units has no dependency on errors

        parts = ", ".join(f"{k}={format_bytes(v)}" for k, v in self.breakdown.items())
        msg = (f"{resource} budget too small: need {format_bytes(self.required)} ({self.required} bytes), "
               f"have {format_bytes(self.available)} ({self.available} bytes)")
        if parts:
            msg += f"; breakdown: {parts}"
        if hint:
            msg += f" (hint: {hint})"
        super().__init__(msg)


class IOFault(OffloadEngineError, OSError):
    """A read of checkpoint data failed; names the shard and the offset."""

    exit_code = 3

    def __init__(self, path: Any, offset: int, errno_: int | None, reason: str):
        self.path = str(path)
        self.offset = offset
        self.errno_ = errno_
        OffloadEngineError.__init__(self, f"{self.path}: read at offset {offset} failed: {reason}")

    def __str__(self) -> str:  # OSError.__str__ would format errno/strerror instead
        return self.args[0]


class EngineClosedError(OffloadEngineError, RuntimeError):
    """The engine was used after close()."""


class EngineBusyError(OffloadEngineError, RuntimeError):
    """A request was started in the thread that is still iterating another request's stream (it would wait on
    itself forever: one engine serves one request at a time)."""


class IOStallError(IOFault, TimeoutError):
    """No read completed within the stall timeout: names the shard and offset of the oldest read in progress.
    A TimeoutError too, so callers that wait on reads with a deadline catch it as one."""


class DeviceOOMError(OffloadEngineError, RuntimeError):
    """The device (or host) allocator ran out of memory during a request: that request fails, the engine stays
    usable. A RuntimeError, like the torch.OutOfMemoryError it wraps (the original is its __cause__)."""

    exit_code = 3

    def __init__(self, where: str, reason: str):
        self.where = where
        super().__init__(f"{where}: out of memory: {reason} (hint: lower --ram/--vram shares or max_context, "
                         f"or free memory used by other processes)")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA, MPS, XPU, and CPU allocators that report it), without importing torch here."""
    oom = getattr(sys.modules.get("torch"), "OutOfMemoryError", None)
    return oom is not None and isinstance(exc, oom) and not isinstance(exc, OffloadEngineError)


@contextmanager
def out_of_memory_as_error(where: str) -> Iterator[None]:
    """Turn an allocator's out-of-memory error into a DeviceOOMError naming `where` (RELIABILITY M6: one
    request fails with an engine error, exit code 3, and the engine stays usable)."""
    try:
        yield
    except Exception as e:
        if is_out_of_memory(e):
            raise DeviceOOMError(where, str(e)) from e
        raise
