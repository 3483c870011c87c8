"""Frozen option dataclasses, plain data: `from_dict` rejects unknown keys so a typo in a preset is an error, not a
no-op. A leaf of the package (it imports only the stage-0 modules constants, errors, modes and units; no torch):
every layer may take its options from here (tests/test_structure.py checks it).

EngineConfig is every option of Engine.open, its default and its validation, in one place: the CLI builds one from
its flags (frontend/engine_flags.py), the API from its keywords (EngineConfig.from_keywords), and assemble.py builds
the engine from it. The checks of one option's values live here with it (check_spec, check_threads,
check_kv_dtype, check_cache_ram), and the modules that use an option import them; what needs the machine (a CUDA
device where there is none, the dtype a CPU computes well) is resolved at assembly (runtime/devices.py).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .constants import PREFILL_CHUNK
from .errors import ConfigError
from .modes import DIRECT_IO_MODES, HOST_COMPUTE_MODES, KERNEL_MODES, KV_DTYPES, POLICIES, SPEC_MODES
from .units import parse_bytes

ByteSize = int | str | None
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # --dtype (runtime/devices.py DTYPES: the torch dtypes)
MAX_DEPTH, MAX_WIDTH = 8, 4  # the most draft tokens per step, and candidates per depth (--spec-depth, --spec-width)
PREFETCH_SLOTS = 8  # default quota of prefetched, unused units per kind (the store's reserve; PrefetchConfig.slots)
AUTO = "auto"  # --threads auto (runtime/threads.py)
# PrefetchConfig's fields the CLI sets (frontend/engine_flags.prefetch_config), named in its errors
PREFETCH_FLAGS = {"depth": "--prefetch-depth", "reads": "--prefetch-reads", "route_ahead": "--route-ahead"}
# torch device types this engine does not run on (another one is not a device at all: the error says which)
OTHER_DEVICE_TYPES = ("mps", "meta", "xpu", "xla", "hpu", "ipu", "mtia", "hip", "lazy", "vulkan", "privateuseone")


def _from_dict(cls, data: Mapping[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{cls.__name__}: unknown option(s) {unknown}; known: {sorted(names)}")
    return cls(**data)


@dataclass(frozen=True)
class Budget:
    """Hard byte budgets per tier. Values: int bytes, or strings like '512MiB', '12GiB', '1.5GB', '25%' (of the
    model's bytes). None means: not limited by the user (the device tier then defaults to what the device has).
    assemble.resolve_budget turns them into bytes against the model's size."""

    vram: ByteSize = None
    ram: ByteSize = None

    from_dict = classmethod(_from_dict)


def size_bytes(value: int | str | None, flag: str, total: int | None = None) -> int | None:
    """A size flag's value in bytes (units.parse_bytes: '12GiB', '1.5GB', 4096; '25%' of `total`), None for
    None, or a ConfigError naming the flag: every size flag's one reading (--vram, --ram, --ram-total, ...)."""
    if value is None:
        return None
    try:
        return parse_bytes(value, what=flag, total=total)
    except ValueError as e:
        raise ConfigError(str(e)) from None


# ---- the checks of one option's values (the CLI's flag named in each error) -------------------------------------
SPEC_FLAGS = ("--spec", "--spec-depth", "--spec-width")  # the CLI's names of (mode, depth, width)
SPEC_ARGUMENTS = ("spec", "spec_depth", "spec_width")  # the API's (Engine.prepare's arguments, the server's fields)


def spec_problem(spec: str, depth: int | None = None, width: int | None = None,
                 names: tuple[str, str, str] = SPEC_FLAGS) -> tuple[str, str] | None:
    """The first bad value of a speculation mode and a fixed draft shape (None: chosen each step), as (its name
    in `names`, a message naming it), or None when all are good."""
    if spec not in SPEC_MODES:
        return names[0], f"{names[0]} must be one of {', '.join(SPEC_MODES)}, got {spec!r}"
    for name, value, most in ((names[1], depth, MAX_DEPTH), (names[2], width, MAX_WIDTH)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most):
            return name, f"{name} must be an integer from 1 to {most}, got {value!r}"
    return None


def check_spec(spec: str, depth: int | None = None, width: int | None = None
               ) -> tuple[str, int | None, int | None]:
    """A speculation mode and a fixed draft shape, or a ConfigError naming the CLI's flag."""
    problem = spec_problem(spec, depth, width)
    if problem is not None:
        raise ConfigError(problem[1])
    return spec, depth, width


def check_threads(value: Any) -> int | str:
    """'auto', or an int >= 1 (a string of digits too: the CLI's flag). Anything else: ConfigError naming both
    the field and the flag."""
    if value == AUTO:
        return AUTO
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"threads (--threads) must be 'auto' or an integer >= 1, got {value!r}")
    return value


def check_kv_dtype(kv_dtype: object) -> str:
    """The one check of a --kv-dtype value (EngineConfig, KVCache and the planner all call it)."""
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return kv_dtype


def check_cache_ram(value: object, total: int = 1) -> int | None:
    """The one reading of a --cache-ram value: None for 'auto' (planner.kv.prompt_cache_bytes sizes it against
    the host budget), else its bytes: 0 (off) or a size as --ram takes it ('2GiB'; '5%' of `total`, the model's
    bytes). Anything else: ConfigError naming the flag."""
    if value == "auto":
        return None
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(f"--cache-ram must be 'auto' or a size like '2GiB' (0: off), got {value!r}")
    try:
        return parse_bytes(value, what="--cache-ram", total=total)
    except ValueError as e:
        raise ConfigError(f"{e} (or 'auto'; 0 turns the prompt cache off)") from None


def check_device_name(device: Any) -> None:
    """--device's form (cpu, cuda, cuda:N; a torch.device too), or OFFLOAD_ENGINE_DEVICE's when it is None. Whether
    CUDA is there is runtime/devices.resolve_device's to say, when the engine is assembled."""
    source = "--device"  # what an error names
    if device is None and os.environ.get("OFFLOAD_ENGINE_DEVICE"):
        device, source = os.environ["OFFLOAD_ENGINE_DEVICE"], "OFFLOAD_ENGINE_DEVICE"
    if device is None:
        return
    kind, colon, index = str(device).partition(":")  # a torch.device prints as its name: 'cuda:0'
    if kind in ("cpu", "cuda") and (not colon or index.isdigit()):
        return
    if kind in OTHER_DEVICE_TYPES and (not colon or index.isdigit()):
        raise ConfigError(f"{source} {device!r} is not supported (expected 'cpu' or 'cuda')")
    raise ConfigError(f"{source} {device!r} is not a device (expected 'cpu', 'cuda' or 'cuda:N')")


def check_dtype_name(dtype: Any) -> None:
    """--dtype: None (the engine picks), a name of DTYPE_NAMES, or such a torch.dtype."""
    if dtype is None:
        return
    name = str(dtype).replace("torch.", "")
    if name in DTYPE_NAMES:
        return
    if type(dtype).__module__ == "torch":
        raise ConfigError(f"dtype {dtype} is not supported; choose one of {sorted(DTYPE_NAMES)}")
    raise ConfigError(f"--dtype {dtype!r} is not supported; choose one of {sorted(DTYPE_NAMES)}")


@dataclass(frozen=True)
class PrefetchConfig:
    enabled: bool = True
    depth: int = 1  # MoE layers ahead
    margin: int = 2  # candidates beyond top-k per token
    min_prob: float = 0.05
    adaptive: bool = True  # PayCheck: expert prefetching only while it measurably makes forwards faster
    reads: int = 1  # expert reads started per token at each layer at most, likeliest first (wrong ones cost disk)
    slots: int = PREFETCH_SLOTS  # the store's quota of prefetched, unused units per kind (TieredStore(prefetch_slots))
    # MoE layers whose routing a layer waiting for reads predicts (0: off; CausalLM._route_ahead). 2: where the
    # disk is the bound, reads started two layers early keep it busy (realistic routing at 25% on a 1.5 GB/s
    # disk, 9 runs each alternated: 19.5 -> 22.4 tok/s; random routing 42.2 -> 43.8; docs/PERF.md session 25)
    route_ahead: int = 2

    def __post_init__(self):
        for name, least in (("depth", 1), ("margin", 0), ("reads", 0), ("slots", 0), ("route_ahead", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                flag = f" ({PREFETCH_FLAGS[name]})" if name in PREFETCH_FLAGS else ""
                raise ConfigError(f"PrefetchConfig.{name}{flag} must be an integer >= {least}, got {value!r}")


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
    resolved when the engine is assembled (runtime/devices.py: resolve_device, resolve_dtype, which also check
    that a CUDA device is there), their names checked here already.

    budget: bytes per tier; device / dtype: None picks (cuda when available; bfloat16 there, and on a CPU for a
    bfloat16 checkpoint where the CPU computes it natively, else float32: runtime/devices.py resolve_dtype);
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
    device: str | Any | None = None  # or a torch.device
    dtype: str | Any | None = None  # or a torch.dtype
    max_context: int | None = None
    policy: str = "lru-floor"
    direct_io: str = "auto"
    prefetch: PrefetchConfig | bool = True
    trace: str | None = None
    allow_cast: bool = False
    progress: bool = False
    read_fn: Callable[..., Any] | None = None  # store.store.ReadFn
    copy_fn: Callable[..., Any] | None = None  # store.store.CopyFn
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
        check_device_name(self.device)
        check_dtype_name(self.dtype)
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
    def from_keywords(cls, budget: Budget | None = None, device: str | Any | None = None,
                      dtype: str | Any | None = None, *, spec: str = "off", spec_depth: int | None = None,
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
