"""open_gguf_model: a GGUF file (or split set) as the same ModelCheckpoint a Hugging Face folder opens to.

The architecture's own schema (checkpoint/arch/, built from the config that checkpoint/gguf/config.py derives
from the metadata) names every tensor the runtime needs; each is found in the GGUF file under llama.cpp's name
(names.py) and becomes a TensorRecord keyed by the schema's name, so the layouts, the planner and the store work
unchanged. A routed expert is its byte range inside the fused `ffn_*_exps` tensor. A tensor stored in a block
type (Q4_K, ...), or one whose rows llama.cpp permuted (Llama's q/k for its rope), becomes a weight of format
`gguf` (checkpoint/formats.QuantSpec: the GGUF type, the rows to unpermute) that runtime/gguf_dequant.py turns
back into the [out, in] matrix; DeepSeek's kv_b_proj, which llama.cpp splits into k_b and v_b, is a `gguf_kvb`
weight of those two tensors. Where an architecture's files differ further (hybrid.py: Qwen3-Next, Qwen3.5-MoE),
its ArchHooks (fixups.py) give its names, the args the file's layout implies, the fix-ups of the tensors the
converter transformed (applied when a unit's tensors are built from its bytes) and its MTP blocks, which
runtime/mtp.attach_mtp_units adds when they are wanted.
"""
from __future__ import annotations

import dataclasses
import functools
import os

from ...errors import CheckpointFormatError, ConfigError
from ..arch import get_naming
from ..formats import QuantSpec, part_name, primary_name
from ..hf_config import ModelSpec, parse_config
from ..index import CheckpointIndex, TensorRecord
from ..layout import UnitLayout, build_layout
from ..naming import ModelSchema, TensorSpec, UnitKey
from ..opened import ModelCheckpoint, PrebuiltUnits
from . import gpt_oss
from .config import build_config
from .fixups import DEFAULT_HOOKS, ArchHooks, Fixup, with_fixups
from .hybrid import HOOKS as ARCH_HOOKS  # per-architecture names, args and load-time fix-ups (fixups.py)
from .reader import GGUFFile, GGUFTensor, read_gguf

PLAIN = ("F32", "F16", "BF16")
# type -> (values per block, bytes per block): ggml's sizes (gguf.constants.GGML_QUANT_SIZES)
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
          "IQ4_XS": (256, 136), "MXFP4": (32, 17)}
SUPPORTED = PLAIN + tuple(BLOCKS)
PERMUTED_ARCHS = ("llama", "mixtral")  # convert_hf_to_gguf's LlamaModel permutes q_proj / k_proj rows


class _Builder:
    def __init__(self, g: GGUFFile, spec: ModelSpec, hooks: ArchHooks = DEFAULT_HOOKS):
        self.g, self.spec, self.hooks = g, spec, hooks
        self.fixups: dict[str, Fixup] = {}  # schema name -> its load-time fix-up
        self.records: dict[str, TensorRecord] = {}
        self.formats: dict[str, QuantSpec] = {}
        self.used: set[str] = set()

    def tensor(self, name: str, key: UnitKey, want: str) -> GGUFTensor:
        t = self.g.tensors.get(name)
        if t is None:
            raise CheckpointFormatError(self.g.path, f"tensor missing: the architecture needs it for unit {key} "
                                                     f"({want})", tensor=name)
        if t.gtype not in SUPPORTED:
            raise ConfigError(f"{t.file}: tensor {name} has type {t.gtype}, which is not supported; supported: "
                              f"{', '.join(SUPPORTED)}")
        self.used.add(name)
        return t

    def record(self, key_name: str, t: GGUFTensor, expert: int | None, shape: tuple[int, ...]) -> TensorRecord:
        """The record of `t` (one expert's slice of it) with the shape it is stored in: logical for plain
        types, [rows, bytes per row] for block types."""
        offset, nbytes, label = t.offset, t.nbytes, t.name
        if expert is not None:
            nbytes //= t.shape[0]
            offset += expert * nbytes
            label = f"{t.name}[expert {expert}]"
        cols = shape[-1]
        if t.gtype in BLOCKS:
            per, size = BLOCKS[t.gtype]
            if cols % per:
                raise CheckpointFormatError(t.file, f"{cols} columns are not a whole number of {t.gtype} blocks of "
                                                    f"{per}", tensor=t.name)
            stored, dtype = (*shape[:-1], cols // per * size), "U8"
        else:
            stored, dtype = shape, t.gtype
        rows = 1
        for d in stored[:-1]:
            rows *= d
        rec = TensorRecord(label, t.file, offset, nbytes, dtype, (rows, stored[-1]) if len(stored) > 2 else stored)
        self.records[key_name] = rec
        return rec

    def logical(self, t: GGUFTensor, expert: int | None, want: tuple[int, ...], key: UnitKey) -> tuple[int, ...]:
        shape = t.shape
        if expert is not None:
            if len(shape) != 3 or expert >= shape[0]:
                raise CheckpointFormatError(t.file, f"shape {list(shape)} does not hold expert {expert} of unit "
                                                    f"{key}", tensor=t.name)
            shape = shape[1:]
        if shape == want or (len(shape) == 1 and want == (1, shape[0])):  # qwen2moe's shared gate: [H] vs [1, H]
            return want
        raise CheckpointFormatError(t.file, f"shape {list(shape)} disagrees with the metadata: expected "
                                            f"{list(want)} for unit {key}", tensor=t.name)

    def component(self, key: UnitKey, local: str, ts: TensorSpec) -> dict[str, TensorSpec]:
        # gpt-oss: renamed tensors and the converter's split experts (checkpoint/gguf/gpt_oss.py)
        if self.spec.model_type == "gpt_oss" and (parts := gpt_oss.component(self, key, local, ts)) is not None:
            return parts
        mapped = self.hooks.name(ts.hf_name)
        if mapped is None:
            raise CheckpointFormatError(self.g.path, f"no GGUF name for tensor {ts.hf_name} of unit {key}")
        name, expert = mapped
        if ts.hf_name.endswith("kv_b_proj.weight") and name not in self.g.tensors:
            return self.kv_b(key, local, ts, name)
        return self.stored(key, local, ts, name, expert)

    def stored(self, key: UnitKey, local: str, ts: TensorSpec, name: str, expert: int | None) -> dict[str, TensorSpec]:
        """`ts` of unit `key` read from GGUF tensor `name` (expert `expert` of it, if fused)."""
        t = self.tensor(name, key, ts.hf_name)
        if (fix := self.hooks.fixup(name)) is not None:
            return self.fixed(key, local, ts, t, fix)
        shape = self.logical(t, expert, ts.shape, key)
        heads = self.permuted_heads(ts.hf_name)
        if t.gtype in PLAIN and not heads:
            self.record(ts.hf_name, t, expert, shape)
            return {local: TensorSpec(ts.hf_name, shape)}
        if len(shape) != 2:
            raise CheckpointFormatError(t.file, f"{t.gtype} tensor of shape {list(shape)}: only matrices are "
                                                f"supported in block types", tensor=t.name)
        q = QuantSpec("gguf", shape[0], shape[1], gtype=t.gtype, heads=heads)
        rec = self.record(ts.hf_name, t, expert, shape)
        self.formats[ts.hf_name] = q
        return {primary_name(local, q): TensorSpec(ts.hf_name, rec.shape, dtype=rec.dtype)}

    def fixed(self, key: UnitKey, local: str, ts: TensorSpec, t: GGUFTensor, fix: Fixup) -> dict[str, TensorSpec]:
        """A plain tensor the converter transformed: recorded as stored, its fix-up applied when it is loaded."""
        shape = self.logical(t, None, fix.stored_shape(ts.shape) if fix.stored_shape else ts.shape, key)
        if t.gtype not in PLAIN:
            raise ConfigError(f"{t.file}: tensor {t.name} ({fix.what}) is {t.gtype}; supported: {', '.join(PLAIN)}")
        self.record(ts.hf_name, t, None, shape)
        self.fixups[ts.hf_name] = fix
        return {local: TensorSpec(ts.hf_name, shape)}

    def permuted_heads(self, hf_name: str) -> int:
        if self.spec.model_type not in PERMUTED_ARCHS:
            return 0
        if hf_name.endswith("self_attn.q_proj.weight"):
            return self.spec.num_heads
        if hf_name.endswith("self_attn.k_proj.weight"):
            return self.spec.num_kv_heads
        if hf_name.endswith(("self_attn.q_proj.bias", "self_attn.k_proj.bias")):  # permuted like their weights
            raise ConfigError(f"{self.g.path}: q/k attention biases of a {self.spec.model_type} GGUF (permuted by "
                              f"llama.cpp's converter) are not supported yet")
        return 0

    def kv_b(self, key: UnitKey, local: str, ts: TensorSpec, name: str) -> dict[str, TensorSpec]:
        """kv_b_proj [H * (nope + v), rank] from llama.cpp's attn_k_b [H, rank, nope] and attn_v_b [H, v, rank]."""
        heads, rank = self.spec.num_heads, ts.shape[1]
        k = self.tensor(name.replace("attn_kv_b", "attn_k_b"), key, ts.hf_name)
        v = self.tensor(name.replace("attn_kv_b", "attn_v_b"), key, ts.hf_name)
        if len(k.shape) != 3 or len(v.shape) != 3 or k.shape[:2] != (heads, rank) or v.shape[0] != heads \
                or v.shape[2] != rank or heads * (k.shape[2] + v.shape[1]) != ts.shape[0]:
            raise CheckpointFormatError(k.file, f"attn_k_b {list(k.shape)} and attn_v_b {list(v.shape)} do not make "
                                                f"kv_b_proj {list(ts.shape)} over {heads} heads", tensor=k.name)
        q = QuantSpec("gguf_kvb", ts.shape[0], rank, group=k.shape[2], heads=heads, gtype=k.gtype, gtype2=v.gtype)
        second = ts.hf_name + "#v_b"
        rk = self.record(ts.hf_name, k, None, k.shape)
        rv = self.record(second, v, None, v.shape)
        self.formats[ts.hf_name] = q
        return {primary_name(local, q): TensorSpec(ts.hf_name, rk.shape, dtype=rk.dtype),
                part_name(local, "vb"): TensorSpec(second, rv.shape, dtype=rv.dtype)}


def open_gguf_model(path: str | os.PathLike) -> ModelCheckpoint:
    """Open a GGUF file (or the first of a split set) and check every tensor its architecture needs."""
    g = read_gguf(path)
    config = build_config(g)
    spec = parse_config(config, g.path)
    naming = get_naming(spec.model_type, g.path)
    hooks = ARCH_HOOKS.get(naming.name, DEFAULT_HOOKS)
    args = hooks.args(naming.args(spec), g)
    b = _Builder(g, spec, hooks)
    schema, layouts = _resolve(b, naming.schema(args, fused_experts=False))
    index = CheckpointIndex(g.path, config, g.shards, b.records)
    unused = sorted(set(g.tensors) - b.used)
    return ModelCheckpoint(g.path, index, spec, naming, args, schema, layouts, False, unused, None, b.formats,
                           _mtp_units(g, spec, naming, args, hooks))


def _resolve(b: _Builder, wanted: ModelSchema) -> tuple[ModelSchema, dict[UnitKey, UnitLayout]]:
    """The schema's units as the file holds them, and their layouts (with the fix-ups of their tensors)."""
    schema = ModelSchema()
    for key, specs in wanted.units.items():
        for local, ts in specs.items():
            for part, part_spec in b.component(key, local, ts).items():
                schema.add(key, part, part_spec)
    return schema, {key: with_fixups(build_layout(key, specs, b.records), b.fixups)
                    for key, specs in schema.units.items()}


def _mtp_units(g: GGUFFile, spec: ModelSpec, naming, args, hooks: ArchHooks) -> PrebuiltUnits | None:
    """The MTP layers llama.cpp keeps as blocks N.. (N trunk layers), for runtime/mtp.attach_mtp_units."""
    make = getattr(naming, "mtp_schema", None)
    wanted = make(args) if make is not None and hooks.mtp_name is not None else None
    if wanted is None or not wanted.units:
        return None
    b = _Builder(g, spec, dataclasses.replace(hooks, name=functools.partial(hooks.mtp_name, layers=spec.num_layers)))
    schema, layouts = _resolve(b, wanted)
    return PrebuiltUnits(schema, layouts, b.formats, frozenset(b.used))
