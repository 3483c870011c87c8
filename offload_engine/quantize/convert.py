"""quantize_checkpoint: a bf16/fp16/fp32 Hugging Face folder -> a compressed-tensors folder, one chunk of rows at
a time within the RAM budget, written into a staging folder beside the output and renamed onto it at the end.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.hf_config import parse_config
from ..checkpoint.index import CheckpointIndex
from ..errors import ConfigError
from ..interrupts import finish_despite_interrupts
from ..units import format_bytes
from .plan import QuantizeOptions, QuantPlan, TensorPlan, make_plan
from .scheme import quantize_rows, shape_tensor, stored_tensors
from .writer import COPY_CHUNK, ShardWriter, SourceReader, Staging

# peak bytes per weight value of a chunk, measured ~28: the rows read (2), their fp32 copy (4) and its scaled copy
# (4), the max's abs (4), int8 and int32 values (5-9), the packed words; tests/test_quantize.py checks the total
WORK_BYTES_PER_VALUE = 32
GPTQ_BYTES_PER_VALUE = 72  # --calibrate: the rows, their working copy and errors, RTN's result, both dequantized
SIDE_FILES = ("generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*",
              "merges.txt", "chat_template*", "*.jinja", "*.tiktoken", "preprocessor_config.json", "*.py")


@dataclass
class QuantizeReport:
    out: Path
    weights: str
    quantized: int
    kept: dict[str, str]
    fitted: dict[str, int]
    bytes_in: int
    bytes_out: int
    copied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        gib = 1 << 30
        lines = [f"wrote {self.out}: {self.quantized} weights in {self.weights}, "
                 f"{self.bytes_in / gib:.3f} GiB -> {self.bytes_out / gib:.3f} GiB of tensors"]
        reasons: dict[str, int] = {}
        for why in self.kept.values():
            reasons[why] = reasons.get(why, 0) + 1
        lines += [f"  kept {n} linear module(s): {why}" for why, n in sorted(reasons.items())]
        by_group: dict[int, list[str]] = {}
        for module, g in sorted(self.fitted.items()):
            by_group.setdefault(g, []).append(module)
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  group {g} for {len(ms)} module(s) whose in_features the group does not divide: "
                  f"{', '.join(ms[:3])}{', ...' if len(ms) > 3 else ''}" for g, ms in sorted(by_group.items())]
        return "\n".join(lines)


def quantize_checkpoint(model: str | os.PathLike, out: str | os.PathLike, options: QuantizeOptions, *,
                        ram: int = 4 << 30, progress: bool = False) -> QuantizeReport:
    src, out = Path(model), Path(out)
    if out.exists() or out.is_symlink():
        raise ConfigError(f"--out {out}: already exists; quantize never overwrites (remove it or choose another)")
    index = CheckpointIndex.open(src)
    config_path = index.root / "config.json"
    if index.config.get("quantization_config") is not None:
        method = index.config["quantization_config"].get("quant_method", "?")
        raise ConfigError(f"--model {src}: already quantized ({method}); quantize reads bf16/fp16/fp32 folders")
    spec = parse_config(index.config, config_path)
    if spec.model_type == "gpt_oss":
        raise ConfigError(f"--model {src}: gpt_oss stores its experts input-major and is released in MXFP4; "
                          "quantize does not rewrite it")
    plan = make_plan(index.tensors, spec.num_layers, options)
    chunk_values = _chunk_values(plan, ram, calibrated=options.calibrate is not None)
    reader, staging = SourceReader(), Staging(out)
    rounding = None
    try:
        if options.calibrate is not None:
            rounding = _calibrated_rounding(src, plan, reader, options, ram)
        tmp = staging.create()
        bytes_out = _write_shards(index, plan, reader, tmp, chunk_values, progress, rounding)
        config = dict(index.config)
        config["quantization_config"] = plan.quantization_config()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copied = _copy_side_files(index.root, tmp)
        staging.publish()
    finally:
        finish_despite_interrupts(staging.discard)
        reader.close()
    notes = plan.notes() + (rounding.notes() if rounding is not None else [])
    return QuantizeReport(out, options.weights, plan.quantized, plan.kept, plan.fitted, index.total_bytes, bytes_out,
                          copied, notes)


def _calibrated_rounding(src: Path, plan: QuantPlan, reader: SourceReader, options: QuantizeOptions, ram: int):
    """GPTQ over the calibration text's activations (calibrated.py), the model opened by the engine's reader."""
    from ..checkpoint.model import open_model
    from .calibrated import GptqRounding
    from .calibration import calibration_windows

    checkpoint = open_model(src)
    windows = calibration_windows(options.calibrate, checkpoint.root, options.calibration_tokens,
                                  checkpoint.spec.max_position_embeddings, options.calibration_window)
    return GptqRounding(checkpoint, plan, reader, windows, ram)


def _chunk_values(plan: QuantPlan, ram: int, calibrated: bool = False) -> int:
    """Weight values quantized at once: half the budget's worth (the rest: what the run itself allocates, and the
    allocator's slack); refused by naming --ram when one block's rows (fp8 block strategy) or one row does not
    fit. Calibrated: a quarter, at GPTQ's cost per value (calibrated.py holds its own state within another half)."""
    values = ram // 4 // GPTQ_BYTES_PER_VALUE if calibrated else ram // 2 // WORK_BYTES_PER_VALUE
    for tp in plan.tensors:
        if tp.scheme is not None and tp.scheme.row_multiple * tp.record.shape[-1] > values:
            per = 4 * GPTQ_BYTES_PER_VALUE if calibrated else 2 * WORK_BYTES_PER_VALUE
            need = per * tp.scheme.row_multiple * tp.record.shape[-1]
            raise ConfigError(f"--ram {format_bytes(ram)} is too small: quantizing {tp.name} needs at least "
                              f"{format_bytes(need)}")
    return max(values, 1)


def _write_shards(index: CheckpointIndex, plan: QuantPlan, reader: SourceReader, tmp: Path, chunk_values: int,
                  progress: bool, rounding=None) -> int:
    """Every output shard laid out first (headers from the plan), then the tensors written in shard order, or
    layer by layer when calibrated (`rounding.order`): the bytes are the same in any order."""
    from tqdm import tqdm

    copy_chunk = min(COPY_CHUNK, max(chunk_values * WORK_BYTES_PER_VALUE // 2, 1))  # a quarter of --ram

    by_shard: dict[Path, list[TensorPlan]] = {}
    for tp in plan.tensors:
        by_shard.setdefault(tp.record.file, []).append(tp)
    weight_map: dict[str, str] = {}
    total = 0
    writers: dict[Path, ShardWriter] = {}
    bar = tqdm(total=index.total_bytes, unit="B", unit_scale=True, desc="quantizing", disable=not progress)
    if rounding is not None:
        rounding.describe = bar.set_description_str
    try:
        for shard in sorted(by_shard):
            entries = [e for tp in by_shard[shard] for e in _entries(tp)]
            writers[shard] = ShardWriter(tmp / shard.name, entries)
            weight_map.update({name: shard.name for name, _, _ in entries})
            total += sum(torch.Size(s).numel() * d.itemsize for _, d, s in entries)
        ordered = [tp for shard in sorted(by_shard) for tp in by_shard[shard]]
        for tp in (ordered if rounding is None else rounding.order(ordered)):
            if tp.scheme is None:
                reader.copy(tp.record, writers[tp.record.file], copy_chunk)
            else:
                _quantize(tp, reader, writers[tp.record.file], chunk_values, rounding)
            bar.update(tp.record.nbytes)
        for writer in writers.values():
            writer.finish()
    finally:
        bar.close()
        for writer in writers.values():
            writer.close()
    if (index.root / "model.safetensors.index.json").exists():
        text = json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
        (tmp / "model.safetensors.index.json").write_text(text + "\n")
    return total


def _entries(tp: TensorPlan) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    if tp.scheme is None:
        return [(tp.name, tp.record.torch_dtype, tuple(tp.record.shape))]
    return stored_tensors(tp.name, tuple(tp.record.shape), tp.scheme, tp.scale_dtype)


def _quantize(tp: TensorPlan, reader: SourceReader, writer: ShardWriter, chunk_values: int, rounding=None) -> None:
    """Rows in chunks (within one expert of a fused tensor), each chunk's values and scales written at their
    place; rounded to nearest, or by `rounding`'s row function for the weight where it has one (--calibrate)."""
    s, rec = tp.scheme, tp.record
    *lead, out, inp = rec.shape
    experts = int(torch.Size(lead).numel())
    values, scale, *shape = [name for name, _, _ in _entries(tp)]
    step = max(s.row_multiple, chunk_values // inp // s.row_multiple * s.row_multiple)
    for e in range(experts):
        round_rows = rounding.rounding(tp, e) if rounding is not None else None
        for first in range(0, out, step):
            n = min(step, out - first)
            rows = reader.rows(rec, e * out + first, n)
            q, sc = round_rows(rows) if round_rows is not None else quantize_rows(rows, s, tp.scale_dtype)
            scale_first = first // s.row_multiple
            writer.write(values, q, (e * out + first) * q.shape[1] * q.element_size())
            scale_rows = -(-out // s.row_multiple)
            writer.write(scale, sc, (e * scale_rows + scale_first) * sc.shape[1] * sc.element_size())
        if shape:
            writer.write(shape[0], shape_tensor((out, inp)), e * 16)


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    """Tokenizer, chat template, generation config (and remote code) as they are."""
    copied = []
    for pattern in SIDE_FILES:
        for f in sorted(src.glob(pattern)):
            if f.is_file() and not (dst / f.name).exists():
                shutil.copy2(f, dst / f.name)
                copied.append(f.name)
    return copied
