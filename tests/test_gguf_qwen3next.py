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

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload_engine import Budget, Engine
from offload_engine.checkpoint.model import open_model
from offload_engine.checkpoint.naming import UnitKey
from offload_engine.runtime.model import CausalLM
from offload_engine.runtime.mtp import MtpHead, attach_mtp_units, mtp_layer_count
from offload_engine.store.resident import ResidentWeights
from tests.test_formats_parity import check_against
from tests.test_gguf import ALL, ROOT, convert
from tests.test_qwen_mtp import NEW, PROMPT

gguf = pytest.importorskip("gguf")
HALF = (None, "25%")  # the `offload` preset: experts ~94% of the bytes, so a 25% budget streams them
GGUF_ARCH = {"qwen3_next": "QWEN3NEXT", "qwen3_5_moe": "QWEN35MOE", "qwen3_5_moe_text": "QWEN35MOE"}


@pytest.mark.parametrize("arch,preset,budgets", [("qwen3_next", "offload", HALF), ("qwen3_5_moe", "offload", HALF),
                                                 ("qwen3_5_moe_text", "tiny", ALL)])
def test_llama_cpp_converter_f32_matches_transformers(checkpoint_factory, tmp_path, arch, preset, budgets):
    """qwen3_5_moe: the released vision-language layout (Qwen3_5MoeForConditionalGeneration, fused experts);
    qwen3_5_moe_text: transformers' text-only save. Both have Hv = 2 Hk, so the value heads were reordered."""
    folder = checkpoint_factory(arch, preset)
    check_against(convert(folder, tmp_path / f"{arch}.gguf"), folder, budgets)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_llama_cpp_converter_bf16(checkpoint_factory, tmp_path, arch):
    folder = checkpoint_factory(arch, "offload", dtype="bfloat16")
    check_against(convert(folder, tmp_path / "bf16.gguf", "bf16"), folder, ("25%",))


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
def test_llama_cpp_converter_q8_0(checkpoint_factory, tmp_path, arch, preset):
    folder = checkpoint_factory(arch, preset)
    path = convert(folder, tmp_path / "q8.gguf", "q8_0")
    assert "Q8_0" in {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if "attn_qkv" in t.name}
    check_against(path, q8_round_trip_folder(folder, path, tmp_path / "ref"), ("25%",) if preset == "offload" else ALL)


def block(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


@pytest.mark.parametrize("arch,preset", [("qwen3_next", "offload"), ("qwen3_5_moe_text", "tiny")])
def test_fixups_undo_the_converter_and_bytes_stay_as_stored(checkpoint_factory, tmp_path, arch, preset):
    """Norms come back bit for bit (the runtime's 1 + w equals the stored 1 + w), A_log within an ulp of exp,
    conv taps as [C, 1, K] views; every byte of a unit is a byte of the file, and the units hold exactly the
    trunk's tensors (the MTP blocks aside)."""
    folder = checkpoint_factory(arch, preset)
    path = convert(folder, tmp_path / "m.gguf")
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
def test_mtp_layers_read_and_draft_as_the_folders_do(checkpoint_factory, tmp_path, arch):
    """The MTP forward on the GGUF equals the folder's; greedy MTP drafting at a 25% budget is lossless and
    accepts what it accepts on the folder (random MTP layers: the logits above are the check that matters)."""
    folder = checkpoint_factory(arch, "offload")
    path = convert(folder, tmp_path / "m.gguf")
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


def test_cli_inspect_plan_run(checkpoint_factory, tmp_path):
    """`inspect` counts the MTP blocks as MTP units (none unused), `plan` and `run` take the file."""
    path = convert(checkpoint_factory("qwen3_5_moe_text"), tmp_path / "q8.gguf", "q8_0")
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
