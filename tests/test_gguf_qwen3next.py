"""Qwen3-Next (`qwen3next`) and Qwen3.5-MoE (`qwen35moe`) GGUF files as llama.cpp's own converter writes them
(checkpoint/gguf/hybrid.py, fixups.py): parity with transformers on the source folder, F32 and BF16 at full and
25% budgets, Q8_0 against transformers on the round-tripped weights, the converter's transforms undone exactly
where they can be, and bytes read = bytes on disk. Skipped when the converter is absent (tests/test_gguf.py)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from offload_engine import Budget, Engine
from offload_engine.checkpoint.model import open_model
from offload_engine.checkpoint.naming import UnitKey
from offload_engine.errors import CheckpointFormatError, ConfigError
from offload_engine.runtime.model import CausalLM
from offload_engine.runtime.mtp import MtpHead, attach_mtp_units, mtp_layer_count
from offload_engine.store.resident import ResidentWeights
from tests.test_formats_parity import check_against
from offload_engine.checkpoint.gguf.tokenizer import QWEN35
from offload_engine.tokenizer import Tokenizer
from tests.test_gguf import ALL, ROOT, convert, llama_cpp_dir
from tests.test_qwen_mtp import NEW, PROMPT
from tools.gguf_from_hf import encode_tensor

gguf = pytest.importorskip("gguf")
HALF = (None, "25%")  # the `offload` preset: experts ~94% of the bytes, so a 25% budget streams them
GGUF_ARCH = {"qwen3_next": "QWEN3NEXT", "qwen3_5_moe": "QWEN35MOE", "qwen3_5_moe_text": "QWEN35MOE"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """converted(folder, outtype="f32") -> the folder as llama.cpp's converter writes it, once per module."""
    root = tmp_path_factory.mktemp("gguf")
    return lambda folder, outtype="f32": convert(folder, root / f"{folder.name}.{outtype}.gguf", outtype)


@pytest.mark.parametrize("arch,preset,budgets", [("qwen3_next", "offload", HALF), ("qwen3_5_moe", "offload", HALF),
                                                 ("qwen3_5_moe_text", "tiny", ALL)])
def test_llama_cpp_converter_f32_matches_transformers(checkpoint_factory, converted, arch, preset, budgets):
    """qwen3_5_moe: the released vision-language layout (Qwen3_5MoeForConditionalGeneration, fused experts);
    qwen3_5_moe_text: transformers' text-only save. Both have Hv = 2 Hk, so the value heads were reordered."""
    folder = checkpoint_factory(arch, preset)
    check_against(converted(folder), folder, budgets)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_llama_cpp_converter_bf16(checkpoint_factory, converted, arch):
    folder = checkpoint_factory(arch, "offload", dtype="bfloat16")
    check_against(converted(folder, "bf16"), folder, ("25%",))


def q8_round_trip_folder(src: Path, gguf_path: Path, out: Path) -> Path:
    """`src` with every tensor the file stores as Q8_0 replaced by its Q8_0 round trip through the `gguf`
    package (the converter's own quantizer), in the source's layout: Q8_0 blocks run along 32 inputs of a row,
    and what the converter moved (qkvz rows into qkv and z, value heads: whole rows, or 32-column blocks of
    out_proj with dv = 32) moves whole blocks, so this is what the file holds. Names by gguf's TensorNameMap."""
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(gguf_path).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[GGUF_ARCH[cfg["model_type"]]], text["num_hidden_layers"] + 1)
    q8 = gguf.GGMLQuantizationType.Q8_0
    plain, rounded = {}, 0
    for f in src.glob("*.safetensors"):
        for name, t in load_file(f).items():
            if name.startswith("mtp."):
                continue
            if t.ndim < 2:  # vectors stay F32 in every llama.cpp file type
                plain[name] = t
                continue
            m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.\d+\.(\w+)_proj\.weight$", name)
            if m:
                stored = [f"blk.{m.group(1)}.ffn_{m.group(2)}_exps.weight"]
            elif name.endswith("in_proj_qkvz.weight"):  # the converter splits it
                layer = name.split(".")[2]
                stored = [f"blk.{layer}.attn_qkv.weight", f"blk.{layer}.attn_gate.weight"]
            else:
                stem, _, leaf = name.rpartition(".") if name.endswith((".weight", ".bias")) else (name, "", "")
                stored = [names.get_name(stem) + (f".{leaf}" if leaf else "")]
            kinds = {types[s] for s in stored}
            assert len(kinds) == 1, (name, kinds)
            if kinds == {q8}:
                flat = t.float().numpy().reshape(-1, t.shape[-1])
                t = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(flat, q8), q8)).reshape(t.shape)
                rounded += 1
            plain[name] = t
    assert rounded > 10
    out.mkdir(parents=True, exist_ok=True)
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix == ".json" and "index" not in f.name:
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("arch,preset", [("qwen3_next", "offload"), ("qwen3_5_moe_text", "tiny")])
def test_llama_cpp_converter_q8_0(checkpoint_factory, converted, tmp_path, arch, preset):
    folder = checkpoint_factory(arch, preset)
    path = converted(folder, "q8_0")
    assert "Q8_0" in {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if "attn_qkv" in t.name}
    check_against(path, q8_round_trip_folder(folder, path, tmp_path / "ref"), ("25%",) if preset == "offload" else ALL)


def block(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


@pytest.mark.parametrize("arch,preset", [("qwen3_next", "offload"), ("qwen3_5_moe_text", "tiny")])
def test_fixups_undo_the_converter_and_bytes_stay_as_stored(checkpoint_factory, converted, arch, preset):
    """Norms come back bit for bit (the runtime's 1 + w equals the stored 1 + w), A_log within an ulp of exp,
    conv taps as [C, 1, K] views; every byte of a unit is a byte of the file, and the units hold exactly the
    trunk's tensors (the MTP blocks aside)."""
    folder = checkpoint_factory(arch, preset)
    path = converted(folder)
    ck = open_model(path)
    src = {}
    for f in folder.glob("*.safetensors"):
        src.update(load_file(f))
    w = ResidentWeights(ck, torch.device("cpu"), torch.float32)
    unit = w.units[UnitKey(0, "dense")]
    norm = unit["input_layernorm.weight"]
    assert torch.equal(1 + norm, 1 + src["model.layers.0.input_layernorm.weight"])
    a_log = unit["linear_attn.A_log"]
    ref = src["model.layers.0.linear_attn.A_log"]
    if arch != "qwen3_next":  # value heads tiled: head i of the file is head (i % Hk) * r + i // Hk of the source
        d = ck.args.deltanet
        r = d.num_v_heads // d.num_k_heads
        ref = ref.view(d.num_k_heads, r).T.reshape(-1)
    torch.testing.assert_close(a_log.exp(), ref.exp(), rtol=2 ** -23, atol=0)
    assert unit["linear_attn.conv1d.weight"].shape == src["model.layers.0.linear_attn.conv1d.weight"].shape
    layout = ck.layouts[UnitKey(0, "dense")]  # a slot's bytes stay the file's; each build fixes them afresh
    blob = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for r in layout.read_ranges():
        with open(r.file, "rb") as f:
            f.seek(r.file_offset)
            data = bytearray(f.read(r.nbytes))
        blob[r.blob_offset:r.blob_offset + r.nbytes] = torch.frombuffer(data, dtype=torch.uint8)
    stored = blob.clone()
    first, again = layout.views(blob), layout.views(blob)
    assert torch.equal(blob, stored) and torch.equal(first["input_layernorm.weight"], again["input_layernorm.weight"])
    assert torch.equal(first["input_layernorm.weight"], norm)
    on_disk = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    trunk = sum(n for name, n in on_disk.items() if block(name) < ck.spec.num_layers)
    assert sum(s.nbytes for layout in ck.layouts.values() for s in layout.slices) == trunk
    assert all(name.startswith(f"blk.{ck.spec.num_layers}.") for name in ck.unused_tensors)


# ---- MTP layers (kept by the converter as blocks N.. with nextn.* names) -----------------------------------------
def resident(path: Path) -> CausalLM:
    ck = attach_mtp_units(open_model(path))
    cpu = torch.device("cpu")
    return CausalLM(ck, ResidentWeights(ck, cpu, torch.float32), cpu, torch.float32)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_mtp_layers_read_and_draft_as_the_folders_do(checkpoint_factory, converted, arch):
    """The MTP forward on the GGUF equals the folder's; greedy MTP drafting at a 25% budget is lossless and
    accepts what it accepts on the folder (random MTP layers: the logits above are the check that matters)."""
    folder = checkpoint_factory(arch, "offload")
    path = converted(folder)
    ck = attach_mtp_units(open_model(path))
    assert mtp_layer_count(ck) == 1 and not ck.unused_tensors
    ids = torch.randint(0, ck.spec.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    logits = []
    for source in (folder, path):
        model = resident(source)
        head = MtpHead(model)
        _, hidden = model.forward(ids, model.new_cache(len(ids)), return_hidden=True)
        h0 = head.trunk_hidden(hidden)
        logits.append(head.forward(0, ids[1:], h0[:-1], torch.arange(1, len(ids)), head.new_cache(64))[0])
    assert (logits[0] - logits[1]).abs().max() <= 1e-4 * logits[0].abs().max()
    accepted = []
    for source in (folder, path):
        with Engine.open(source, budget=Budget(ram="25%"), max_context=256, spec="mtp") as engine:
            plain = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, spec="off")
            done = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, spec="mtp", spec_depth=2)
            assert done.token_ids == plain.token_ids and done.stats["by_drafter"]["mtp"]["steps"] > 0
            accepted.append(done.stats["accepted_tokens"])
    assert accepted[0] == accepted[1]


def test_cli_inspect_plan_run(checkpoint_factory, converted):
    """`inspect` counts the MTP blocks as MTP units (none unused), `plan` and `run` take the file."""
    path = converted(checkpoint_factory("qwen3_5_moe_text"), "q8_0")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-c", "import sys; from offload_engine.cli import main; sys.exit(main())"]
    out = subprocess.run(cli + ["inspect", str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "GGUF qwen35moe" in out.stdout and "Q8_0" in out.stdout, out.stderr
    assert re.search(r"^\s+mtp\s+\d+", out.stdout, re.M) and "unused" not in out.stdout, out.stdout
    out = subprocess.run(cli + ["plan", "--model", str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "qwen3_5_moe" in out.stdout, out.stderr
    out = subprocess.run(cli + ["run", "--model", str(path), "--prompt", "def f", "--max-new-tokens", "4"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr


# ---- K-quants: 256-value blocks that span value heads --------------------------------------------------------------
def reencoded(src: Path, out: Path, gtype: str, override: dict[str, str] | None = None, drop: str = "",
              legacy: bool = False, meta: dict[str, str] | None = None) -> Path:
    """The converter's F32 file with its matrices re-encoded as `gtype` (tools/gguf_from_hf.py's encoder: random
    valid blocks for the K-quants) where their rows are whole blocks, routers and conv taps F32 as llama.cpp keeps
    them; metadata and every other tensor as they are (bad files: `override` some tensors' types, `drop` a key;
    `meta`: string values replaced).
    `legacy`: Qwen3-Next's attn_qkv and attn_gate merged back into the source's in_proj_qkvz, named ssm_in, as
    llama.cpp's earlier converter wrote it (its runtime still reads those files, per key head)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if not key.startswith("GGUF.") and key not in ("general.architecture", drop):
            value = (meta or {}).get(key, field.contents())
            w.add_key_value(key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
    rng = np.random.default_rng(0)
    per = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gtype]][0]
    arrays = {t.name: np.array(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in r.tensors}
    if legacy:
        meta = {k.rpartition(".")[2]: int(f.contents()) for k, f in r.fields.items() if ".ssm." in k}
        hk, dk = meta["group_count"], meta["state_size"]
        for name in [n for n in arrays if n.endswith("attn_qkv.weight")]:
            qkv, z = arrays.pop(name), arrays.pop(name.replace("attn_qkv", "attn_gate"))
            q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
            per_head = [x.reshape(hk, -1, x.shape[-1]) for x in (q, k, v, z)]
            arrays[name.replace("attn_qkv", "ssm_in")] = np.concatenate(per_head, axis=1).reshape(-1, qkv.shape[-1])
    for name, data in arrays.items():
        keep = data.ndim < 2 or data.shape[-1] % per or "ffn_gate_inp" in name or "ssm_conv1d" in name
        data, qt = encode_tensor(data, (override or {}).get(name, "F32" if keep else gtype), rng)
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return out


def grouped(t: torch.Tensor, dim: int, k_heads: int, head_dim: int) -> torch.Tensor:
    """The converter's value-head reorder (grouped by key head -> tiled) undone along `dim`."""
    shape = list(t.shape)
    r = shape[dim] // (k_heads * head_dim)
    return t.reshape(*shape[:dim], r, k_heads, head_dim, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def dequantized_source(src: Path, path: Path, out: Path) -> Path:
    """The text-only Qwen3.5 folder `src` with every matrix the file stores quantized replaced by the `gguf`
    package's dequantization of it, the converter's reorders undone (value heads back to grouped order in
    in_proj_qkv's v rows, in_proj_z / b / a rows and out_proj's columns)."""
    cfg = json.loads((src / "config.json").read_text())
    hk, dk, dv = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE, cfg["num_hidden_layers"] + 1)
    plain, replaced = {}, 0
    for f in src.glob("*.safetensors"):
        for name, t in load_file(f).items():
            m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight$", name)
            stem = name.removesuffix(".weight")
            stored = f"blk.{m.group(1)}.ffn_{m.group(3)}_exps.weight" if m else f"{names.get_name(stem)}.weight"
            if name.startswith("mtp.") or t.ndim < 2 or tensors[stored].tensor_type.name == "F32":
                plain[name] = t
                continue
            value = torch.from_numpy(np.array(gguf.quants.dequantize(tensors[stored].data,
                                                                     tensors[stored].tensor_type), np.float32))
            value = value[int(m.group(2))] if m else value.reshape(t.shape)
            if name.endswith("in_proj_qkv.weight"):
                value = torch.cat([value[:2 * hk * dk], grouped(value[2 * hk * dk:], 0, hk, dv)])
            elif name.endswith("in_proj_z.weight"):
                value = grouped(value, 0, hk, dv)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
                value = grouped(value, 0, hk, 1)
            elif name.endswith("linear_attn.out_proj.weight"):
                value = grouped(value, 1, hk, dv)
            plain[name] = value.reshape(t.shape)
            replaced += 1
    assert replaced > 10
    out.mkdir(parents=True, exist_ok=True)
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix == ".json" and "index" not in f.name:
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("gtype", ["Q4_K", "Q6_K"])
def test_k_quants_match_transformers_on_the_dequantized_weights(checkpoint_factory, converted, tmp_path, gtype):
    """The `small` preset (hidden 256, dv 128): a 256-value block of out_proj spans two value heads, so its
    columns cannot be put back in the source's order before decoding; the engine reads them as stored (Q4_K
    through the CPU int4 kernel)."""
    folder = checkpoint_factory("qwen3_5_moe_text", "small")
    path = reencoded(converted(folder), tmp_path / f"{gtype}.gguf", gtype)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ssm_out.weight"] == types["blk.0.attn_qkv.weight"] == gtype
    check_against(path, dequantized_source(folder, path, tmp_path / "ref"), ALL)


def test_bad_files_are_refused_by_name(checkpoint_factory, converted, tmp_path):
    """A tensor with a fix-up (a norm stored as 1 + w) in a block type, and a missing DeltaNet key."""
    f32 = converted(checkpoint_factory("qwen3_5_moe_text"))
    bad = reencoded(f32, tmp_path / "norm.gguf", "F32", override={"blk.1.attn_norm.weight": "Q8_0"})
    with pytest.raises(ConfigError, match=r"blk\.1\.attn_norm\.weight \(zero-centred norm stored as 1 \+ w\) is Q8_0"):
        open_model(bad)
    with pytest.raises(CheckpointFormatError, match=r"qwen35moe\.ssm\.group_count missing"):
        open_model(reencoded(f32, tmp_path / "key.gguf", "F32", drop="qwen35moe.ssm.group_count"))


def test_legacy_qwen3next_file_with_ssm_in(checkpoint_factory, converted, tmp_path):
    """Qwen3-Next files from llama.cpp's earlier converter hold in_proj_qkvz as the source has it (`ssm_in`)."""
    folder = checkpoint_factory("qwen3_next", "offload")
    path = reencoded(converted(folder), tmp_path / "legacy.gguf", "F32", legacy=True)
    assert "blk.0.ssm_in.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    assert not open_model(path).args.split_qkvz
    check_against(path, folder, ALL)


def test_qwen35_pre_tokenizer(checkpoint_factory, converted, tmp_path):
    """Qwen3.5/3.6 files say tokenizer.ggml.pre "qwen35": its regex is the one llama.cpp quotes from the release's
    tokenizer.json (llama-vocab.cpp), and a file saying it opens and round-trips text."""
    source = (llama_cpp_dir() or Path("/nonexistent")) / "src" / "llama-vocab.cpp"
    if not source.is_file():
        pytest.skip(f"llama.cpp's {source.name} not found")
    case = source.read_text().split("case LLAMA_VOCAB_PRE_TYPE_QWEN35:", 1)[1]
    quoted = re.search(r'// original regex from tokenizer.json\s*// "(.*)"', case).group(1)
    assert "".join(QWEN35) == quoted.replace("\\\\", "\\")
    path = reencoded(converted(checkpoint_factory("qwen3_5_moe_text")), tmp_path / "q35.gguf", "F32",
                     meta={"tokenizer.ggml.pre": "qwen35"})
    tok = Tokenizer.load_optional(path)
    text = "def café(x):\n    return x + 12345  # naïve\u0301 'll"
    assert tok.decode(tok.encode(text)) == text
