"""gpt-oss GGUF files read in place (checkpoint/gguf/gpt_oss.py): files written by llama.cpp's own converter from
the test checkpoints (F32 and BF16 from float folders; MXFP4 experts kept from an MXFP4 folder; Q8_0) give
transformers' logits and greedy tokens on the source folder (for Q8_0: on the `gguf` package's dequantization of
the file), streamed too; GGUF's MXFP4 blocks decode bit for bit as the `gguf` package's dequantizer does, and to
the source's MXFP4 values (the converter's repacking undone exactly); the `gpt-4o` pre-tokenizer is o200k's."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from offload_engine.checkpoint.model import open_model
from offload_engine.runtime import gguf_dequant
from tests.test_formats_parity import check_against, dequantized_folder, ref_mxfp4
from tests.test_gguf import ROOT, convert

gguf = pytest.importorskip("gguf")
BUDGETS = (None, "25%")  # the `offload` preset: experts most of the bytes, so 25% streams them


def types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("dtype,outtype,stored", [("float32", "f32", "F32"), ("bfloat16", "bf16", "BF16")])
def test_converter_output_matches_transformers(checkpoint_factory, tmp_path, dtype, outtype, stored):
    """A float folder's experts (input-major gate_up [E, H, 2I], down [E, I, H]) come out split and transposed;
    sinks, router, biases renamed; the sliding layers from llama.cpp's pattern."""
    folder = checkpoint_factory("gpt_oss", "offload", dtype=dtype)
    path = convert(folder, tmp_path / f"{outtype}.gguf", outtype)
    kinds = types(path)
    assert kinds["blk.0.ffn_gate_exps.weight"] == kinds["blk.0.attn_q.weight"] == stored
    ck = open_model(path)
    assert list(ck.args.layer_types) == json.loads((folder / "config.json").read_text())["layer_types"]
    assert ck.args.sliding_window == 4 and ck.spec.rope.params["truncate"] is False
    check_against(path, folder, BUDGETS)


@pytest.fixture(scope="module")
def mxfp4_gguf(tmp_path_factory, checkpoint_factory) -> tuple[Path, Path]:
    folder = checkpoint_factory("gpt_oss", "offload", quant="mxfp4")
    return folder, convert(folder, tmp_path_factory.mktemp("gguf_gpt_oss") / "mxfp4.gguf", "f32")


def test_converter_mxfp4_experts_match_transformers_on_the_dequantized_weights(mxfp4_gguf, tmp_path):
    folder, path = mxfp4_gguf
    kinds = types(path)
    assert {kinds[f"blk.1.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")} == {"MXFP4"}
    assert kinds["blk.1.attn_q.weight"] == kinds["blk.1.ffn_gate_exps.bias"] == "F32"
    check_against(path, dequantized_folder(folder, tmp_path / "ref"), BUDGETS)


def gguf_dequantized_folder(src: Path, gguf_path: Path, out: Path) -> Path:
    """A float gpt_oss folder of the `gguf` package's dequantization of every tensor of the GGUF file, mapped back
    to transformers' names and layouts here, apart from the engine: gate and up re-interleaved into gate_up_proj
    [E, H, 2I] (input-major) with its bias, down_proj transposed back to [E, I, H]."""
    deq = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
           for t in gguf.GGUFReader(gguf_path).tensors}
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    state = {"model.embed_tokens.weight": deq["token_embd.weight"], "model.norm.weight": deq["output_norm.weight"],
             "lm_head.weight": deq["output.weight"]}
    plain = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias", "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}
    for proj, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
        plain.update({f"self_attn.{proj}_proj.{leaf}": f"{name}.{leaf}" for leaf in ("weight", "bias")})

    def interleave(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.stack((a, b), dim=dim + 1).flatten(dim, dim + 1)

    for l in range(config["num_hidden_layers"]):
        p, b = f"model.layers.{l}.", f"blk.{l}."
        state.update({p + hf: deq[b + name] for hf, name in plain.items()})
        state[p + "mlp.experts.gate_up_proj"] = interleave(deq[b + "ffn_gate_exps.weight"],
                                                           deq[b + "ffn_up_exps.weight"], 1).transpose(1, 2)
        state[p + "mlp.experts.gate_up_proj_bias"] = interleave(deq[b + "ffn_gate_exps.bias"],
                                                                deq[b + "ffn_up_exps.bias"], 1)
        state[p + "mlp.experts.down_proj"] = deq[b + "ffn_down_exps.weight"].transpose(1, 2)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("quant,experts", [(None, "Q8_0"), ("mxfp4", "MXFP4")])
def test_converter_q8_0_matches_transformers_on_the_dequantized_weights(checkpoint_factory, tmp_path, quant, experts):
    """`--outtype q8_0`: attention, embedding and head Q8_0; the experts Q8_0 too from a float folder, kept MXFP4
    from an MXFP4 one (the form of llama.cpp's own gpt-oss files)."""
    folder = checkpoint_factory("gpt_oss", "offload", **({"quant": quant} if quant else {}))
    path = convert(folder, tmp_path / "q8.gguf", "q8_0")
    kinds = types(path)
    assert kinds["blk.0.attn_q.weight"] == kinds["token_embd.weight"] == "Q8_0"
    assert kinds["blk.0.ffn_gate_exps.weight"] == kinds["blk.0.ffn_down_exps.weight"] == experts
    check_against(path, gguf_dequantized_folder(folder, path, tmp_path / "ref"), BUDGETS)


def _source_mxfp4(folder: Path, name: str) -> torch.Tensor:
    """The folder's MXFP4 tensor `name` as [E, out, in], by transformers' own decoder."""
    found = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            found.update({k: st.get_tensor(k) for k in st.keys() if k.startswith(name + "_")})
    return ref_mxfp4(found[name + "_blocks"], found[name + "_scales"])


def test_mxfp4_repacking_is_undone_exactly(mxfp4_gguf):
    """GGUF gate = the source's even gate_up rows, up = the odd ones, down as is: every value equal (the source's
    -0 code decodes to +0 in GGUF's table, equal as a number)."""
    folder, path = mxfp4_gguf
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for layer in range(json.loads((folder / "config.json").read_text())["num_hidden_layers"]):
        source = {"gate_up": _source_mxfp4(folder, f"model.layers.{layer}.mlp.experts.gate_up_proj"),
                  "down": _source_mxfp4(folder, f"model.layers.{layer}.mlp.experts.down_proj")}
        want = {"gate": source["gate_up"][:, ::2], "up": source["gate_up"][:, 1::2], "down": source["down"]}
        for proj, expected in want.items():
            t = stored[f"blk.{layer}.ffn_{proj}_exps.weight"]
            cols = expected.shape[-1]
            got = gguf_dequant.dequantize(torch.from_numpy(np.array(t.data)), "MXFP4", cols)
            assert torch.equal(got.reshape(expected.shape), expected), (layer, proj)


def test_mxfp4_dequantize_is_bit_identical_to_the_gguf_package():
    """Random blocks with every exponent byte 0..255 (subnormal scales, and inf where 2^127 x 12 overflows)."""
    qt = gguf.GGMLQuantizationType.MXFP4
    per, size = gguf.GGML_QUANT_SIZES[qt]
    raw = np.random.default_rng(1).integers(0, 256, size=(256, 3 * size), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    with np.errstate(over="ignore"):
        ref = gguf.quants.dequantize(raw, qt).astype(np.float32)
    got = gguf_dequant.dequantize(torch.from_numpy(raw.copy()), "MXFP4", 3 * per).numpy()
    assert got.shape == ref.shape and np.isinf(ref).any() and (ref[:2] != 0).any()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_cli_inspect_plan_run(mxfp4_gguf):
    _, path = mxfp4_gguf
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-c", "import sys; from offload_engine.cli import main; sys.exit(main())"]
    out = subprocess.run(cli + ["inspect", str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "GGUF" in out.stdout and "MXFP4" in out.stdout, out.stderr
    out = subprocess.run(cli + ["plan", "--model", str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "gpt_oss" in out.stdout, out.stderr
    assert "weights mxfp4 experts" in out.stdout  # sized as the file holds them (general.file_type MXFP4_MOE)
    out = subprocess.run(cli + ["run", "--model", str(path), "--prompt", "def f", "--max-new-tokens", "4"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr


def test_gpt_4o_pre_tokenizer_splits_as_o200k(monkeypatch):
    """gpt-oss files say tokenizer.ggml.pre "gpt-4o": its pieces are those of OpenAI's own o200k pattern (tiktoken's,
    taken without downloading the ranks)."""
    regex = pytest.importorskip("regex")
    openai_public = pytest.importorskip("tiktoken_ext.openai_public")
    from tokenizers import Regex, pre_tokenizers

    from offload_engine.checkpoint.gguf.tokenizer import PRE

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *args, **kwargs: {})
    pattern = openai_public.o200k_base()["pat_str"]
    (ours,), ignore_merges = PRE["gpt-4o"]
    split = pre_tokenizers.Split(Regex(ours), behavior="isolated", invert=False)
    text = (Path(json.__file__).read_text()[:3000] + " HTTPServer's JSONDecoder don'T I'LL 12345 3.14159 "
            "naïve café ÉCOLE Straße ΑΒΓαβγ Привет мир 你好世界 こんにちは 한국어 e\u0301 😀👍 a/b//\n\r\n\t  x  \n")
    assert [piece for piece, _ in split.pre_tokenize_str(text)] == regex.findall(pattern, text)
    assert ignore_merges is False  # as llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O
