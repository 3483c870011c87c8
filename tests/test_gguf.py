"""GGUF files read in place (checkpoint/gguf/, runtime/gguf_dequant.py): parity with transformers on the source
folder for files written by llama.cpp's own converter and by the `gguf` package's writer, the quantized types
bit-identical to the `gguf` package's own dequantizer, the tokenizer from the metadata, split sets, and bad files
refused by name."""
from __future__ import annotations

import glob
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

from offload_engine import Engine
from offload_engine.checkpoint.model import open_model
from offload_engine.errors import CheckpointError, ConfigError
from offload_engine.runtime import gguf_dequant
from offload_engine.tokenizer import Tokenizer
from tests.test_formats_parity import check_against  # logits and greedy tokens at each budget
from tools.gguf_from_hf import write_gguf

gguf = pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN, NEW_TOKENS = 48, 16
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")


def llama_cpp_dir() -> Path | None:
    """llama.cpp's sources as vendored in the llama-cpp-python sdist: $OFFLOAD_ENGINE_LLAMA_CPP, else the bench's
    cache (`python tools/llama_peer.py fetch`, which `make test` runs where the package index answers), else an
    sdist unpacked under /tmp/lcp."""
    from tools.llama_peer import source_dir

    env = os.environ.get("OFFLOAD_ENGINE_LLAMA_CPP")
    found = [env] if env else [str(source_dir()), *sorted(glob.glob("/tmp/lcp/llama_cpp_python-*/vendor/llama.cpp"))]
    for d in found:
        if (Path(d) / "convert_hf_to_gguf.py").is_file() and (Path(d) / "conversion").is_dir():
            return Path(d)
    return None


def convert(folder: Path, out: Path, outtype: str = "f32") -> Path:
    lcp = llama_cpp_dir()
    if lcp is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py not found (unpack the llama-cpp-python sdist into /tmp/lcp "
                    "or set OFFLOAD_ENGINE_LLAMA_CPP)")
    if not out.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "llamacpp_convert.py"), "--llama-cpp", str(lcp),
                        str(folder), "--outtype", outtype, "--outfile", str(out)], check=True, capture_output=True,
                       timeout=600)
    return out


def prompt(vocab: int) -> list[int]:
    return torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()


def dequantized_folder(src: Path, gguf_path: Path, out: Path) -> Path:
    """`src` with every weight replaced by the `gguf` package's dequantization of the GGUF's tensor (names by
    gguf.TensorNameMap; experts split from the fused tensor): what the quantized file holds, as transformers
    reads it. For archs without llama.cpp's q/k permutation or kv_b split (qwen*)."""
    reader = gguf.GGUFReader(gguf_path)
    deq = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    cfg = json.loads((src / "config.json").read_text())
    arch = gguf.MODEL_ARCH[{"qwen3": "QWEN3", "qwen3_moe": "QWEN3MOE", "qwen2": "QWEN2"}[cfg["model_type"]]]
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    generic = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    plain = {}
    for f in src.glob("*.safetensors"):
        for name, t in load_file(f).items():
            m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight$", name)
            if m:
                value = deq[f"blk.{m.group(1)}.ffn_{m.group(3)}_exps.weight"][int(m.group(2))]
            else:
                stem = name.removesuffix(".weight")
                value = deq[(names.get_name(stem) or generic.get_name(stem)) + ".weight"]
            plain[name] = torch.from_numpy(np.array(value, dtype=np.float32)).reshape(t.shape)
    out.mkdir(parents=True, exist_ok=True)
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix == ".json" and "index" not in f.name:
            shutil.copy(f, out / f.name)
    return out


# ---- llama.cpp's own converter --------------------------------------------------------------------------------
# The `offload` preset (experts ~97% of the bytes, no dense layers: llama.cpp's Qwen-MoE archs have none) is where
# a 25% budget holds the minimum working set; a tiny dense model's working set (two layer slots, staging, KV
# cache) is more than the model, so the dense archs run fully resident only.
ALL = (None,)
CONVERTED = [("llama", "tiny", ALL), ("qwen3_moe", "offload", (None, "25%")), ("deepseek_v3", "tiny", ALL),
             ("deepseek_v3", "offload", ("25%",)), ("qwen2", "tiny", ALL), ("qwen3", "tiny", ALL),
             ("mixtral", "tiny", ALL), ("qwen2_moe", "offload", ("25%",))]


@pytest.mark.parametrize("arch,preset,budgets", CONVERTED)
def test_llama_cpp_converter_f32_matches_transformers(checkpoint_factory, tmp_path, arch, preset, budgets):
    folder = checkpoint_factory(arch, preset)
    check_against(convert(folder, tmp_path / f"{arch}.gguf"), folder, budgets)


def test_llama_cpp_converter_bf16(checkpoint_factory, tmp_path):
    """A BF16 file holds the bf16 folder's bits: the engine on it equals transformers on that folder."""
    folder = checkpoint_factory("qwen3_moe", "offload", dtype="bfloat16")
    check_against(convert(folder, tmp_path / "bf16.gguf", "bf16"), folder, ALL)


def test_llama_cpp_converter_q8_0(checkpoint_factory, tmp_path):
    folder = checkpoint_factory("qwen3_moe", "offload")
    path = convert(folder, tmp_path / "q8.gguf", "q8_0")
    assert "Q8_0" in {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    check_against(path, dequantized_folder(folder, path, tmp_path / "ref"), ("25%",))


# ---- the gguf package's writer (tools/gguf_from_hf.py) ---------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3", "qwen2_moe"])
def test_written_f32_matches_transformers(checkpoint_factory, tmp_path, arch):
    """Dense layers inside a Qwen-MoE (mlp_only_layers), which llama.cpp cannot convert, read too."""
    folder = checkpoint_factory(arch)
    (path,) = write_gguf(folder, tmp_path / f"{arch}.gguf")
    check_against(path, folder, ALL)


@pytest.mark.parametrize("gtype,preset,budgets", [("Q8_0", "offload", (None, "25%")), ("Q4_0", "offload", ("25%",)),
                                                   ("F16", "tiny", ALL), ("BF16", "tiny", ALL)])
def test_block_32_types_match_transformers_on_the_dequantized_weights(checkpoint_factory, tmp_path, gtype, preset,
                                                                       budgets):
    folder = checkpoint_factory("qwen3_moe", preset)
    (path,) = write_gguf(folder, tmp_path / f"{gtype}.gguf", gtype)
    check_against(path, dequantized_folder(folder, path, tmp_path / "ref"), budgets)


@pytest.mark.parametrize("gtype", ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_k_quants_match_transformers_on_the_dequantized_weights(checkpoint_factory, tmp_path, gtype):
    """256-value super-blocks: the `small` preset's widths are multiples of 256 (the embedding too: its rows are
    decoded per lookup)."""
    folder = checkpoint_factory("qwen3", "small")
    (path,) = write_gguf(folder, tmp_path / f"{gtype}.gguf", gtype)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["token_embd.weight"] == gtype and types["blk.0.ffn_down.weight"] == gtype
    check_against(path, dequantized_folder(folder, path, tmp_path / "ref"), ALL)


@pytest.mark.parametrize("gtype", BLOCK_TYPES + ("F16", "BF16"))
def test_dequantize_is_bit_identical_to_the_gguf_package(gtype):
    """Every byte value in every field (random blocks, scales included: inf where the bits say so; NaN at the same
    places, whose payload bits IEEE leaves to the implementation)."""
    qt = gguf.GGMLQuantizationType[gtype]
    per, size = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(40, 3 * size), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # random scales include inf and NaN
        ref = gguf.quants.dequantize(raw, qt).astype(np.float32)
    data = torch.from_numpy(raw.copy())
    if gtype in ("F16", "BF16"):
        data = data.view(getattr(torch, {"F16": "float16", "BF16": "bfloat16"}[gtype]))
    got = gguf_dequant.dequantize(data, gtype, 3 * per).numpy()
    nan = np.isnan(ref)
    assert got.shape == ref.shape and np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert (~nan).mean() > 0.8


def test_expert_slices_are_byte_ranges_of_the_fused_tensor(checkpoint_factory, tmp_path):
    folder = checkpoint_factory("qwen3_moe")
    (path,) = write_gguf(folder, tmp_path / "q4.gguf", "Q4_0")
    ck = open_model(path)
    fused = {t.name: t for t in gguf.GGUFReader(path).tensors}["blk.1.ffn_down_exps.weight"]
    per_expert = int(fused.n_bytes) // int(fused.shape[-1])
    for e in (0, 5):
        (s,) = [s for s in ck.layouts[(1, "expert", e)].slices if s.local.startswith("down@")]
        assert (s.file_offset, s.nbytes) == (int(fused.data_offset) + e * per_expert, per_expert)


# ---- tokenizer, split sets, CLI -----------------------------------------------------------------------------------
def test_tokenizer_and_chat_template_from_the_metadata(checkpoint_factory, tmp_path):
    folder = checkpoint_factory("llama")
    path = convert(folder, tmp_path / "llama.gguf")
    ours, theirs = Tokenizer.load_optional(path), Tokenizer(folder)
    text = Path(json.__file__).read_text()[:4000] + " <|im_start|>user\nhé 🚀<|im_end|>"
    assert ours.encode(text) == theirs.encode(text) and ours.decode(ours.encode(text)) == theirs.decode(
        theirs.encode(text))
    chat = [{"role": "user", "content": "hello"}]
    assert ours.encode_chat(chat) == theirs.encode_chat(chat)
    assert ours.eos_token_ids == theirs.eos_token_ids and ours.bos_token_id == theirs.bos_token_id


def test_header_walk_reads_what_the_gguf_package_reads(checkpoint_factory, tmp_path):
    """read_gguf's own header walk (checkpoint/gguf/prescan.py) against llama.cpp's Python reader: every metadata
    value (the tokenizer's arrays included) and every tensor's type, shape and byte range, on a file llama.cpp's
    converter wrote and one written by the `gguf` package's writer."""
    import gguf

    from offload_engine.checkpoint.gguf.reader import read_gguf

    files = [convert(checkpoint_factory("llama"), tmp_path / "llama.gguf"),
             *write_gguf(checkpoint_factory("qwen3_moe"), tmp_path / "moe.gguf", "Q8_0")]
    for path in files:
        ours, theirs = read_gguf(path), gguf.GGUFReader(path, "r")
        expected = {}
        for key, field in theirs.fields.items():
            if key.startswith("GGUF."):  # the reader's own fields (version, counts), not the file's keys
                continue
            value = field.contents()
            floats = field.types and field.types[0] == gguf.GGUFValueType.FLOAT32
            expected[key] = float(f"{value:.7g}") if floats else value
        assert ours.metadata == expected and len(expected) > 10
        assert any(isinstance(v, list) and len(v) > 100 for v in expected.values())  # the vocabulary
        assert {t.name: (t.tensor_type.name, tuple(reversed(t.shape.tolist())), int(t.data_offset), int(t.n_bytes))
                for t in theirs.tensors} == {n: (t.gtype, t.shape, t.offset, t.nbytes) for n, t in ours.tensors.items()}


def test_split_set_reads_like_one_file(checkpoint_factory, tmp_path):
    folder = checkpoint_factory("qwen3_moe", "offload")
    files = write_gguf(folder, tmp_path / "m.gguf", split_tensors=12)
    assert len(files) >= 3 and files[0].name.endswith("-00001-of-%05d.gguf" % len(files))
    ck = open_model(files[1])  # any part names the set
    assert len(ck.index.shards) == len(files)
    check_against(files[0], folder, budgets=("25%",))
    files[-1].unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        open_model(files[0])


def test_cli_inspect_plan_run(checkpoint_factory, tmp_path):
    folder = checkpoint_factory("deepseek_v3")
    (path,) = write_gguf(folder, tmp_path / "ds.gguf", "Q8_0")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-c", "import sys; from offload_engine.cli import main; sys.exit(main())"]
    out = subprocess.run(cli + ["inspect", str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "GGUF" in out.stdout and "Q8_0" in out.stdout, out.stderr
    out = subprocess.run(cli + ["plan", "--model", str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "deepseek_v3" in out.stdout, out.stderr
    out = subprocess.run(cli + ["run", "--model", str(path), "--prompt", "def f", "--max-new-tokens", "4"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr


# ---- bad files ----------------------------------------------------------------------------------------------------
@pytest.fixture
def good(checkpoint_factory, tmp_path) -> Path:
    (path,) = write_gguf(checkpoint_factory("qwen3_moe"), tmp_path / "good.gguf")
    return path


def test_truncated_file_is_refused_by_name(good):
    with open(good, "r+b") as f:
        f.truncate(good.stat().st_size - 1000)
    with pytest.raises(CheckpointError, match=r"truncated") as e:
        open_model(good)
    assert "good.gguf" in str(e.value)


def test_unsupported_type_is_refused_naming_tensor_and_type(checkpoint_factory, tmp_path):
    folder = checkpoint_factory("qwen3_moe")
    (path,) = write_gguf(folder, tmp_path / "q2.gguf", override={"blk.0.attn_q.weight": "Q5_0"})
    with pytest.raises(ConfigError, match=r"blk\.0\.attn_q\.weight has type Q5_0"):
        open_model(path)


def test_unknown_type_id_is_refused(good):
    reader = gguf.GGUFReader(good, "r+")
    reader.tensors[3].field.parts[4][0] = 250  # the tensor info's type field
    del reader
    with pytest.raises(CheckpointError, match=r"unknown tensor type"):
        open_model(good)


def test_unknown_architecture_is_refused_by_name(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ConfigError, match=r"architecture 'mamba' is not supported"):
        open_model(tmp_path / "m.gguf")


@pytest.mark.parametrize("field,value,message", [
    ("n_tensors", 2 ** 60, "more than a"), ("overlap", None, "overlaps"), ("misaligned", None, "alignment"),
    ("past_end", None, "past (the|its) end")])
def test_malformed_headers_are_refused_before_reading(good, field, value, message):
    if field == "n_tensors":
        with open(good, "r+b") as f:
            f.seek(8)
            f.write(value.to_bytes(8, "little"))
    else:
        reader = gguf.GGUFReader(good, "r+")
        a, b = reader.tensors[2].field.parts[5], reader.tensors[3].field.parts[5]
        if field == "overlap":
            b[0] = a[0]
        elif field == "misaligned":
            b[0] = b[0] + 4
        else:
            b[0] = good.stat().st_size
        del reader, a, b
    with pytest.raises(CheckpointError, match=message) as e:
        open_model(good)
    assert "good.gguf" in str(e.value)
    if field != "n_tensors":  # the tensor at fault is named
        assert re.search(r"blk\.\d+\.|token_embd|output", str(e.value)), str(e.value)


def test_a_folder_error_names_gguf(tmp_path, good):
    with pytest.raises(CheckpointError, match=r"\.gguf file"):
        open_model(tmp_path / "nothing-here")
    with pytest.raises(CheckpointError, match=r"pass the file itself: --model .*good\.gguf"):
        open_model(good.parent)


def test_absurd_string_length_is_refused(good):
    with open(good, "r+b") as f:
        f.seek(24)  # the first key's length
        f.write((2 ** 63).to_bytes(8, "little"))
    with pytest.raises(CheckpointError, match=r"only \d+ left in the file"):
        open_model(good)


def test_header_fuzz_raises_only_our_errors(good, tmp_path):
    """Random bytes of the header (metadata and tensor infos) changed: the file opens or is refused with the
    engine's own errors, each within a second, never by a crash, a hang or a stray exception."""
    import time

    raw = bytearray(good.read_bytes())
    header = int(gguf.GGUFReader(good).data_offset)
    rng = np.random.default_rng(7)
    bad = tmp_path / "fuzz.gguf"
    for trial in range(300):
        data = bytearray(raw)
        for at in rng.integers(8, header, size=int(rng.integers(1, 4))):
            data[at] = int(rng.integers(0, 256))
        bad.write_bytes(bytes(data))
        start = time.perf_counter()
        try:
            open_model(bad)
        except (CheckpointError, ConfigError):
            pass
        assert time.perf_counter() - start < 2.0, trial


@pytest.mark.parametrize("arch,preset,gtype,fast", [("llama", "tiny", "Q4_0", True), ("qwen3_moe", "tiny", "Q4_0", True),
                                                    ("qwen3", "small", "Q4_K", True), ("qwen3", "small", "Q6_K", False),
                                                    ("qwen3_moe", "tiny", "Q8_0", False)])
def test_cpu_int4_kernel_matches_dequantize(checkpoint_factory, tmp_path, arch, preset, gtype, fast):
    """Q4_0 / Q4_K weights take the CPU int4 kernel (repacked once into their own slots; Llama's permuted q/k
    rows put back in order): float32 logits within 1e-5 x max|logit| of dequantize-then-multiply, greedy
    identical; the other types stay on the dequantize path, bit for bit."""
    (path,) = write_gguf(checkpoint_factory(arch, preset), tmp_path / f"{gtype}.gguf", gtype)
    out = {}
    for kernels in ("dequantize", "auto"):
        with Engine.open(path, dtype="float32", kernels=kernels, max_context=PROMPT_LEN + NEW_TOKENS) as engine:
            ids = prompt(engine.model.vocab_size)
            tokens = engine.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
            prepared = engine.store.prepared
            out[kernels] = engine.logits(ids), tokens, prepared.built if prepared else 0
    (ref, ref_tokens, none), (got, tokens, built) = out["dequantize"], out["auto"]
    assert none == 0 and (built > 0) == fast
    scale, diff = ref.abs().max().item(), (got - ref).abs().max().item()
    assert diff <= 1e-5 * scale, f"max |diff| {diff:.3g} > 1e-5 x max|logit| {scale:.3g}"
    assert tokens == ref_tokens
    if not fast:
        assert torch.equal(got, ref)
