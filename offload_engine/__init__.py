"""offload-engine: run Mixture-of-Experts and dense LLMs far larger than device memory."""
from .api import Completion, Engine
from .checkpoint.index import CheckpointIndex
from .config import Budget, EngineConfig, SpeculativeConfig
from .errors import (BudgetError, CheckpointError, CheckpointFormatError, ConfigError, DeviceOOMError,
                     EngineBusyError, EngineClosedError, IOFault, IOStallError, OffloadEngineError, PlanError)
from .prefetch.prefetcher import PrefetchConfig
from .generate.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "SpeculativeConfig", "Completion", "Budget", "PrefetchConfig", "SamplingParams",
           "CheckpointIndex", "OffloadEngineError", "CheckpointError", "CheckpointFormatError", "ConfigError", "BudgetError", "PlanError", "IOFault",
           "EngineClosedError", "EngineBusyError", "IOStallError", "DeviceOOMError"]
__version__ = "0.1.0"
