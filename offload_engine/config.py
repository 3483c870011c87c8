"""Frozen option dataclasses. `from_dict` rejects unknown keys so a typo in a preset is an error, not a no-op.

EngineConfig is every option of Engine.open, its default and its validation, in one place: the CLI builds one from
its flags, the API from its keywords (EngineConfig.from_keywords), and assemble.py builds the engine from it.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .constants import PREFILL_CHUNK
from .errors import ConfigError
from .modes import DIRECT_IO_MODES, HOST_COMPUTE_MODES, KERNEL_MODES
from .planner.kv import check_cache_ram, check_kv_dtype
from .planner.placement import ResolvedBudget
from .prefetch.prefetcher import PrefetchConfig
from .runtime.threads import check_threads
from .speculative.stepper import check_spec
from .store.policy import POLICIES
from .store.store import CopyFn, ReadFn
from .units import parse_bytes

ByteSize = int | str | None


def _from_dict(cls, data: Mapping[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{cls.__name__}: unknown option(s) {unknown}; known: {sorted(names)}")
    return cls(**data)


@dataclass(frozen=True)
class Budget:
    """Hard byte budgets per tier. Values: int bytes, or strings like '512MiB', '12GiB', '1.5GB', '25%' (of the
    model's bytes). None means: not limited by the user (the device tier then defaults to what the device has)."""

    vram: ByteSize = None
    ram: ByteSize = None

    from_dict = classmethod(_from_dict)

    def resolve(self, model_bytes: int) -> "ResolvedBudget":
        def one(value: ByteSize, flag: str) -> int | None:
            if value is None:
                return None
            try:
                return parse_bytes(value, what=flag, total=model_bytes)
            except ValueError as e:
                raise ConfigError(str(e)) from None

        return ResolvedBudget(device=one(self.vram, "--vram"), host=one(self.ram, "--ram"))



DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, stored: str | None = None) -> torch.dtype:
    """Compute dtype, unless asked: bfloat16 on CUDA; on a CPU the checkpoint's own (`stored`, config.json's
    dtype) where it is bfloat16 and the CPU multiplies bfloat16 well (cpu_computes_bf16: 4-5x the float32 decode
    speed on such a checkpoint, docs/PERF.md), else float32 (what the parity tests use)."""
    if dtype is None:
        if device.type == "cuda" or (stored == "bfloat16" and cpu_computes_bf16()):
            return torch.bfloat16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype {dtype} is not supported; choose one of {sorted(DTYPES)}")
        return dtype
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def cpu_computes_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 well: torch natively (oneDNN's AVX512-BF16 / AMX), or the engine's own
    kernels (AVX2 and up: runtime/kernels/native_build.py, built on first use, which prefill takes too where torch
    lacks the former). Without either, torch converts: slower than float32."""
    from .runtime.kernels import native_build  # (the runtime imports this module)

    return native_build.torch_multiplies_bf16() or native_build.load() is not None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None: OFFLOAD_ENGINE_DEVICE if set (the test suite sets 'cpu'), else cuda when available, else cpu."""
    source = "--device"  # what an error names
    if device is None and os.environ.get("OFFLOAD_ENGINE_DEVICE"):
        device, source = os.environ["OFFLOAD_ENGINE_DEVICE"], "OFFLOAD_ENGINE_DEVICE"
    elif device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{source} {device!r} is not a device (expected 'cpu', 'cuda' or 'cuda:N')") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{source} {device!r} requested but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{source} {device!r} is not supported (expected 'cpu' or 'cuda')")
    return dev


@dataclass(frozen=True)
class SpeculativeConfig:
    """The default speculative decoding of an engine's requests. mode: one of modes.SPEC_MODES ("mtp" loads the
    checkpoint's MTP layers as `mtp` units, "auto" only where they cost little memory: assemble._with_mtp_units);
    depth / width fix the draft shape (None: the cost model chooses each step); draft_model: a smaller
    checkpoint with the same tokenizer, opened as an engine of its own within draft_budget."""

    mode: str = "off"
    depth: int | None = None
    width: int | None = None
    draft_model: str | os.PathLike | None = None
    draft_budget: Budget | None = None

    def __post_init__(self):
        check_spec(self.mode, self.depth, self.width)
        if self.mode == "draft" and self.draft_model is None:
            raise ConfigError("spec 'draft' needs a draft model: pass --draft-model DIR (API: draft_model=...)")
        _check_budget(self.draft_budget, "draft_budget", optional=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SpeculativeConfig":
        data = dict(data)
        if isinstance(data.get("draft_budget"), Mapping):
            data["draft_budget"] = Budget.from_dict(data["draft_budget"])
        return _from_dict(cls, data)


@dataclass(frozen=True)
class EngineConfig:
    """Every option of Engine.open. Validated when built (ConfigError naming the flag); the device and dtype are
    resolved when the engine is assembled (resolve_device, resolve_dtype), and checked here already.

    budget: bytes per tier; device / dtype: None picks (cuda when available; bfloat16 there, and on a CPU for a
    bfloat16 checkpoint where the CPU computes it natively, else float32: resolve_dtype);
    max_context: KV positions reserved (default: the checkpoint's, at most constants.DEFAULT_CONTEXT);
    policy: expert cache eviction (store/policy.py POLICIES); direct_io: O_DIRECT reads (modes.DIRECT_IO_MODES);
    prefetch: True (defaults), False, or a PrefetchConfig (kept as a PrefetchConfig); trace: a routing trace
    seeding the prefetcher's frequency prior; allow_cast: accept tensors whose dtype differs from config.json;
    progress: a loading bar; read_fn / copy_fn: replace the disk read of one byte range / the host -> compute
    copy of one unit (fault-injection tests);
    stall_timeout: seconds without any read making progress before a request fails with IOStallError (default
    60, or OFFLOAD_ENGINE_STALL_TIMEOUT); speculative: SpeculativeConfig; host_compute: "off", "on" or "auto":
    experts the host tier holds and the device tier does not are computed by the CPU where they lie (not bit
    for bit the device's results on a GPU); prefill_chunk: prompt tokens per forward (its activations grow with
    it: `plan --prefill-chunk` sizes them; under offload a larger chunk reads each expert the prompt misses fewer
    times); record_routing: the model appends every MoE layer's routing to `model.routing_trace`
    (tools/trace_experts.py); kernels: "auto" (quantized weights use a fast kernel where one applies, repacked
    once per resident unit within the budget: docs/FORMATS.md) or "dequantize" (always dequantize-then-matmul);
    kv_dtype: the KV cache's storage (modes.KV_DTYPES): "auto" the compute dtype, "bf16", or "fp8" / "int8" with
    one fp32 scale per position and head (runtime/kv_storage.py), charged to the budget at that size;
    threads: torch's intra-op threads, applied by Engine.open: an int, or "auto" (runtime/threads.py: within
    torch's count and the usable cores, one fewer while weights stream, as many as the other processes leave
    idle, re-measured while decoding); the count that ran is in the stats (`threads`);
    cache_ram: host bytes for saved prompt prefixes (generate/prompt_cache.py; `serve --cache-ram`): a size as for
    the budget, 0 (default: only the last sequence's cache is reused) or "auto" (planner.kv.prompt_cache_bytes),
    charged to the host tier."""

    budget: Budget = field(default_factory=Budget)
    device: str | torch.device | None = None
    dtype: str | torch.dtype | None = None
    max_context: int | None = None
    policy: str = "lru-floor"
    direct_io: str = "auto"
    prefetch: PrefetchConfig | bool = True
    trace: str | None = None
    allow_cast: bool = False
    progress: bool = False
    read_fn: ReadFn | None = None
    copy_fn: CopyFn | None = None
    stall_timeout: float | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    host_compute: str = "off"
    prefill_chunk: int = PREFILL_CHUNK
    record_routing: bool = False
    kernels: str = "auto"
    kv_dtype: str = "auto"
    threads: int | str = "auto"
    cache_ram: int | str = 0

    def __post_init__(self):
        _check_budget(self.budget, "budget")
        if not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(f"speculative must be an offload_engine.config.SpeculativeConfig, got "
                              f"{type(self.speculative).__name__}")
        resolve_dtype(self.dtype, resolve_device(self.device))
        if self.host_compute not in HOST_COMPUTE_MODES:
            raise ConfigError(f"--host-compute must be one of {', '.join(HOST_COMPUTE_MODES)}, got "
                              f"{self.host_compute!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)} (--policy), got {self.policy!r}")
        chunk = self.prefill_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(f"prefill_chunk (--prefill-chunk) must be a positive int, got {chunk!r}")
        if self.kernels not in KERNEL_MODES:
            raise ConfigError(f"--kernels must be one of {', '.join(KERNEL_MODES)}, got {self.kernels!r}")
        check_kv_dtype(self.kv_dtype)
        check_cache_ram(self.cache_ram)
        object.__setattr__(self, "threads", check_threads(self.threads))  # "4" (a flag's text) -> 4
        if self.direct_io not in DIRECT_IO_MODES:
            raise ConfigError(f"--direct-io must be auto, on or off, got {self.direct_io!r}")
        if not isinstance(self.prefetch, PrefetchConfig):  # a bool: the defaults, enabled or not
            object.__setattr__(self, "prefetch", PrefetchConfig(enabled=bool(self.prefetch)))

    @classmethod
    def from_keywords(cls, budget: Budget | None = None, device: str | torch.device | None = None,
                      dtype: str | torch.dtype | None = None, *, spec: str = "off", spec_depth: int | None = None,
                      spec_width: int | None = None, draft_model: str | os.PathLike | None = None,
                      draft_budget: Budget | None = None, **options: Any) -> "EngineConfig":
        """Engine.open's keyword form: the speculative options flat (spec, spec_depth, spec_width, draft_model,
        draft_budget), every other one by its field name."""
        budget = budget if budget is not None else Budget()
        _check_budget(budget, "budget")  # first, as Engine.open always checked it
        speculative = SpeculativeConfig(spec, spec_depth, spec_width, draft_model, draft_budget)
        return cls(budget=budget, device=device, dtype=dtype, speculative=speculative, **options)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EngineConfig":
        """Nested options may be mappings too (budget, speculative, prefetch), checked the same way."""
        data = dict(data)
        for name, kind in (("budget", Budget), ("speculative", SpeculativeConfig)):
            if isinstance(data.get(name), Mapping):
                data[name] = kind.from_dict(data[name])
        if isinstance(data.get("prefetch"), Mapping):
            data["prefetch"] = _from_dict(PrefetchConfig, data["prefetch"])
        return _from_dict(cls, data)


def _check_budget(budget: Any, name: str, optional: bool = False) -> None:
    if not isinstance(budget, Budget) and not (optional and budget is None):
        raise ConfigError(f"{name} must be an offload_engine.Budget, got {type(budget).__name__}")
