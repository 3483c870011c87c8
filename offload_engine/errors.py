"""Typed errors. Every message names the file, tensor or flag concerned, what was expected and what was found."""
from __future__ import annotations

from typing import Any, Mapping


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
