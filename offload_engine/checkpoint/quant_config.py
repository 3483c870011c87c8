"""config.json `quantization_config`, parsed and checked: which weight format a checkpoint claims.

Only what the config says lives here; which tensors are really quantized, and with what shapes, is decided from
the tensor headers by checkpoint/formats.py. Every method not listed in SUPPORTED is refused by name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointFormatError

SUPPORTED = ("fp8", "compressed-tensors", "gptq", "awq", "mxfp4")
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
CT_STRATEGIES = ("group", "channel", "block", "tensor")


@dataclass(frozen=True)
class CTScheme:
    """One compressed-tensors config group: which modules (`targets`) and how their weights are stored."""

    name: str
    targets: tuple[str, ...]
    format: str  # one of CT_FORMATS
    num_bits: int
    type: str  # "int" | "float"
    strategy: str  # one of CT_STRATEGIES
    group_size: int | None
    block: tuple[int, int] | None
    symmetric: bool


@dataclass(frozen=True)
class QuantConfig:
    method: str  # one of SUPPORTED
    block: tuple[int, int] | None = None  # fp8: weight_block_size
    not_convert: tuple[str, ...] = ()  # fp8: modules_to_not_convert
    schemes: tuple[CTScheme, ...] = ()  # compressed-tensors config groups
    ignore: tuple[str, ...] = ()  # compressed-tensors: modules left unquantized
    bits: int = 0  # gptq / awq
    group_size: int = -1  # gptq / awq; -1: one group over the whole input
    desc_act: bool = False  # gptq: act-order (g_idx permutes the groups)
    sym: bool = True  # gptq
    zero_offset: int = 0  # gptq v1 files store zero - 1 (checkpoint_format "gptq"); v2 stores the zero itself

    def scheme_for(self, module: str) -> CTScheme | None:
        """The compressed-tensors group that quantizes `module` (None: ignored or not targeted). Targets and
        ignore entries are module names or `re:` regexes (matched from the start, as compressed-tensors does);
        a class name ("Linear") matches every linear layer, which is all this is asked about. As in
        compressed-tensors, a target naming the module exactly wins over a regex, and a regex over a class name
        (a group naming a few modules beside a "Linear" group), whatever the groups' order."""
        if any(_match(module, t) for t in self.ignore):
            return None
        for matches in (lambda t: t == module, lambda t: t.startswith("re:") and _match(module, t), _is_class):
            for scheme in self.schemes:
                if any(matches(t) for t in scheme.targets):
                    return scheme
        return None


def _match(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _is_class(target: str) -> bool:
    return target in ("Linear", "LinearBase", "QuantLinear")


def parse_quant_config(raw: Any, config_path: Path) -> QuantConfig | None:
    """QuantConfig from config.json's `quantization_config` (None when absent); refuses what is not supported."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CheckpointFormatError(config_path, f"quantization_config must be an object, found {raw!r:.80}")
    method = raw.get("quant_method")
    if method == "fp8":
        return _fp8(raw, config_path)
    if method == "compressed-tensors":
        return _compressed_tensors(raw, config_path)
    if method in ("gptq", "awq"):
        return _gptq_awq(method, raw, config_path)
    if method == "mxfp4":
        return QuantConfig("mxfp4")
    raise CheckpointFormatError(config_path, f"quantization_config quant_method={method!r} is not supported; "
                                             f"supported: {', '.join(SUPPORTED)}",
                                hint="use a checkpoint in one of these formats or in bf16/fp16/fp32")


def _fail(config_path: Path, field: str, value: Any, expected: str) -> CheckpointFormatError:
    return CheckpointFormatError(config_path, f"quantization_config {field}={value!r:.80} is not supported: "
                                              f"expected {expected}")


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _pair(value: Any) -> tuple[int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(_pos_int(v) for v in value):
        return int(value[0]), int(value[1])
    return None


def _fp8(raw: dict, config_path: Path) -> QuantConfig:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _fail(config_path, "fmt", fmt, "'e4m3'")
    block = _pair(raw.get("weight_block_size"))
    if block is None:
        raise _fail(config_path, "weight_block_size", raw.get("weight_block_size"),
                    "two positive integers (per-tensor fp8 scales are not supported)")
    keep = raw.get("modules_to_not_convert") or ()
    if not isinstance(keep, (list, tuple)) or not all(isinstance(m, str) for m in keep):
        raise _fail(config_path, "modules_to_not_convert", keep, "a list of module names")
    return QuantConfig("fp8", block=block, not_convert=tuple(keep))


def _compressed_tensors(raw: dict, config_path: Path) -> QuantConfig:
    top_format = raw.get("format")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _fail(config_path, "config_groups", groups, "a non-empty object of groups")
    schemes = tuple(_ct_scheme(name, group, top_format, config_path) for name, group in groups.items())
    ignore = raw.get("ignore") or ()
    if not isinstance(ignore, (list, tuple)) or not all(isinstance(i, str) for i in ignore):
        raise _fail(config_path, "ignore", ignore, "a list of module names or 're:' patterns")
    return QuantConfig("compressed-tensors", schemes=schemes, ignore=tuple(ignore))


def _ct_scheme(name: str, group: Any, top_format: Any, config_path: Path) -> CTScheme:
    where = f"config_groups.{name}"
    if not isinstance(group, dict):
        raise _fail(config_path, where, group, "an object")
    fmt = group.get("format") or top_format
    if fmt not in CT_FORMATS:
        raise _fail(config_path, f"{where}.format", fmt, f"one of {', '.join(CT_FORMATS)}")
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise _fail(config_path, f"{where}.targets", targets, "a non-empty list of names")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise _fail(config_path, f"{where}.weights", w, "an object (weight-only or weight+activation schemes)")
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    if kind not in ("int", "float"):
        raise _fail(config_path, f"{where}.weights.type", kind, "'int' or 'float'")
    if bits not in ((4, 8) if kind == "int" else (8,)):
        raise _fail(config_path, f"{where}.weights.num_bits", bits, "4 or 8 for int, 8 for float")
    if strategy not in CT_STRATEGIES:
        raise _fail(config_path, f"{where}.weights.strategy", strategy, f"one of {', '.join(CT_STRATEGIES)}")
    if w.get("actorder") not in (None, False, "static", "weight"):
        raise _fail(config_path, f"{where}.weights.actorder", w.get("actorder"), "none or 'static'")
    group_size = w.get("group_size")
    if strategy == "group" and not _pos_int(group_size):
        raise _fail(config_path, f"{where}.weights.group_size", group_size, "a positive integer")
    block = _pair(w.get("block_structure")) if strategy == "block" else None
    if strategy == "block" and block is None:
        raise _fail(config_path, f"{where}.weights.block_structure", w.get("block_structure"),
                    "two positive integers")
    symmetric = bool(w.get("symmetric", True))
    if fmt == "pack-quantized" and kind != "int":
        raise _fail(config_path, f"{where}.format", fmt, "float weights in float-quantized or naive-quantized")
    if fmt == "float-quantized" and kind != "float":
        raise _fail(config_path, f"{where}.weights.type", kind, "'float' in float-quantized")
    if kind == "float" and not symmetric:
        raise _fail(config_path, f"{where}.weights.symmetric", False, "true for float weights")
    return CTScheme(name, tuple(targets), fmt, bits, kind, strategy,
                    int(group_size) if strategy == "group" else None, block, symmetric)


def _format_field(raw: dict, legacy: str, default: str) -> tuple[str, str]:
    """(field, lower-cased value) of a GPTQ/AWQ layout: transformers 5 and gptqmodel name it `format` and still
    read (and write) the legacy name (GPTQ `checkpoint_format`, AWQ `version`), which wins where both are set, as
    in transformers' GPTQConfig / AwqConfig."""
    for field in (legacy, "format"):
        if raw.get(field) is not None:
            return field, str(raw[field]).lower()
    return legacy, default


def _gptq_awq(method: str, raw: dict, config_path: Path) -> QuantConfig:
    bits, group = raw.get("bits", raw.get("w_bit")), raw.get("group_size", raw.get("q_group_size", -1))
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise _fail(config_path, "bits", bits, "4 or 8" if method == "gptq" else "4")
    if not (group == -1 or _pos_int(group)):
        raise _fail(config_path, "group_size", group, "-1 or a positive integer")
    if method == "awq":
        field, version = _format_field(raw, "version", "gemm")
        if version != "gemm":
            raise _fail(config_path, field, raw.get(field), "'gemm' (the GEMM layout)")
        if not raw.get("zero_point", True):
            raise _fail(config_path, "zero_point", False, "true")
        return QuantConfig("awq", bits=4, group_size=group, sym=False)
    field, fmt = _format_field(raw, "checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _fail(config_path, field, raw.get(field), "'gptq' or 'gptq_v2'")
    return QuantConfig("gptq", bits=bits, group_size=group, desc_act=bool(raw.get("desc_act", False)),
                       sym=bool(raw.get("sym", True)), zero_offset=1 if fmt == "gptq" else 0)
