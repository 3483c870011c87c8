"""offload-engine: run Mixture-of-Experts and dense LLMs far larger than device memory.

The public names load on first use (PEP 562): `import offload_engine.cli` (the console script) must not import
torch before the CLI has taken over Ctrl-C, or an interrupt during those seconds of imports is lost (SIGINT
ignored by a background job), swallowed (torch's C++ init drops a KeyboardInterrupt raised in its numpy import)
or printed as a traceback (cli.main, interrupts.py)."""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .errors import (BudgetError, CheckpointError, CheckpointFormatError, ConfigError, DeviceOOMError,
                     EngineBusyError, EngineClosedError, IOFault, IOStallError, OffloadEngineError, PlanError)

if TYPE_CHECKING:
    from .api import Completion, Engine
    from .checkpoint.index import CheckpointIndex
    from .config import Budget, EngineConfig, PrefetchConfig, SpeculativeConfig
    from .generate.sampling import SamplingParams

_LAZY = {"Engine": ".api", "Completion": ".api", "CheckpointIndex": ".checkpoint.index", "Budget": ".config",
         "EngineConfig": ".config", "SpeculativeConfig": ".config", "PrefetchConfig": ".config",
         "SamplingParams": ".generate.sampling"}

__all__ = ["Engine", "EngineConfig", "SpeculativeConfig", "Completion", "Budget", "PrefetchConfig", "SamplingParams",
           "CheckpointIndex", "OffloadEngineError", "CheckpointError", "CheckpointFormatError", "ConfigError", "BudgetError", "PlanError", "IOFault",
           "EngineClosedError", "EngineBusyError", "IOStallError", "DeviceOOMError"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later lookups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
