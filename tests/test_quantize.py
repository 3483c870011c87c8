"""`offload-engine quantize` (issue 30 item 2): the folder it writes loads in transformers (with compressed-tensors)
and in this engine with matching logits and greedy tokens; its bytes equal the compressed-tensors library's own
compressors; a SIGINT at random points leaves nothing behind; the demo model's MTP layer survives and still
drafts; held-out perplexity of the demo model in int8 / int4 stays within 1% / 5% of bf16. Figures go to the
terminal report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from offload_engine import Engine
from offload_engine.cli import main
from offload_engine.defaults import PACKAGE_MODEL
from offload_engine.errors import ConfigError
from offload_engine.quantize.convert import quantize_checkpoint
from offload_engine.quantize.plan import QuantizeOptions
from offload_engine.quantize.scheme import WeightScheme, quantize_rows
from tests.figures import Figures
from tools.quantize_eval import bf16_copy, held_out_ppl, mtp_acceptance

ROOT = Path(__file__).resolve().parents[1]
FIGURES = Figures("quantize")
report_figures = FIGURES.fixture()
PROMPT = [5, 17, 200, 33, 9, 120, 64, 7, 301, 45]


def quantize(src: Path, out: Path, *flags: str) -> Path:
    assert main(["quantize", "--model", str(src), "--out", str(out), "--quiet", *flags]) == 0
    return out


def engine_greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    return engine.generate(ids, max_new_tokens=n, ignore_eos=True).token_ids


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


# ---- transformers and the engine read the written folder alike ------------------------------------------------
CASES = [("demo", "int4", ()), ("demo", "fp8", ()), ("qwen3_moe", "int8", ()), ("llama", "fp8", ("--group", "32")),
         ("llama", "int4", ("--group", "0", "--no-keep-head"))]


@pytest.mark.parametrize("source,weights,flags", CASES, ids=[f"{a}-{w}{''.join(f)}" for a, w, f in CASES])
def test_written_folder_matches_transformers(source, weights, flags, checkpoint_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    src = PACKAGE_MODEL if source == "demo" else checkpoint_factory(source)
    out = quantize(src, tmp_path / "q", "--weights", weights, *flags)
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) if (
        out / "model.safetensors.index.json").exists() else set(safe_open(out / "model.safetensors", "pt").keys())
    assert any(n.endswith("_packed" if weights != "fp8" else "_scale") for n in names)
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info.get("mismatched_keys")
    assert all(".layers.4." in k for k in info["unexpected_keys"]), info["unexpected_keys"]  # demo: its MTP layer
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0]
    with Engine.open(out, dtype="float32") as engine:
        got = engine.logits(PROMPT)
        tokens = engine_greedy(engine, PROMPT, 16)
    err = float((got - want).abs().max()) / float(want.abs().max())
    FIGURES[f"{source}-{weights}{''.join(flags)} rel logit err"] = f"{err:.1e}"
    assert err <= 1e-4
    assert tokens == hf_greedy(model, PROMPT, 16)


# ---- the bytes equal the library's compressors ------------------------------------------------------------------
SCHEMES = [(WeightScheme("int", 4, "group", group=16), (24, 48)), (WeightScheme("int", 4, "group", group=32), (8, 96)),
           (WeightScheme("int", 8, "channel"), (12, 40)), (WeightScheme("int", 4, "channel"), (5, 36)),
           (WeightScheme("float", 8, "channel"), (10, 30)), (WeightScheme("float", 8, "block", block=16), (40, 36))]


@pytest.mark.parametrize("scheme,shape", SCHEMES, ids=[f"{s.kind}{s.bits}-{s.strategy}" for s, _ in SCHEMES])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_stored_bytes_equal_compressed_tensors(scheme, shape, scale_dtype):
    from compressed_tensors.compressors import FloatQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])) * 0.05
    w[0, : min(16, shape[1])] = 0  # an all-zero group
    values, scale = quantize_rows(w, scheme, scale_dtype)
    args = QuantizationArgs(**scheme.config_weights())
    ct = QuantizationScheme(targets=["Linear"], weights=args)
    lib = (FloatQuantizationCompressor if scheme.kind == "float" else PackedQuantizationCompressor).compress(
        {"weight": w, "weight_scale": scale}, ct)
    key = "weight" if scheme.kind == "float" else "weight_packed"
    assert torch.equal(values.view(torch.uint8), lib[key].view(torch.uint8))
    state = {key: values, "weight_scale": scale, "weight_shape": torch.tensor(shape)}
    cls = FloatQuantizationCompressor if scheme.kind == "float" else PackedQuantizationCompressor
    back = cls.decompress(state, ct)["weight"].float()  # in the scale's dtype: bf16 rounds the product too
    rounding = float(w.abs().max()) * 2**-8 if scale_dtype == torch.bfloat16 else 0.0
    half_step = float(scale.float().abs().max()) * (0.5 if scheme.kind == "int" else 16)  # e4m3: 32 apart near 448
    assert float((back - w).abs().max()) <= half_step + rounding


# ---- interrupted runs leave nothing ----------------------------------------------------------------------------
HARNESS = r'''
import json, os, random, signal, sys, time
from offload_engine.cli import main
src, parent, errors, trials, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
rng = random.Random(seed)

def run(out, delay):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        os.write(w, b"1")
        try:
            rc = main(["quantize", "--model", src, "--out", out, "--weights", "int4", "--ram", "64KiB", "--quiet"])
        except BaseException:
            import traceback
            with open(errors, "a") as f:  # anything but main's own 130 or 0: the test shows it
                traceback.print_exc(file=f)
            rc = 99
        os._exit(rc)
    os.close(w); os.read(r, 1); start = time.monotonic()
    done, status = 0, 0
    if delay is not None:
        while time.monotonic() < start + delay and not done:
            done, status = os.waitpid(pid, os.WNOHANG)
            time.sleep(0.0005)
        if not done:
            os.kill(pid, signal.SIGINT)
    if not done:
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), time.monotonic() - start

# uninterrupted runs (the first also imports what the CLI imports lazily): the shortest sets the delays' range
duration = min(run(os.path.join(parent, f"whole{i}"), None)[1] for i in range(3))
results = []
for i in range(trials):
    out = os.path.join(parent, f"t{i}")
    delay = rng.uniform(0, 0.9 * duration)  # runs vary with the load: most must still be cut short
    rc, _ = run(out, delay)
    results.append({"rc": rc, "delay": delay, "out": os.path.exists(out), "left": sorted(
        n for n in os.listdir(parent) if n.startswith("." + os.path.basename(out) + ".tmp"))})
print(json.dumps({"duration": duration, "results": results}))
'''


def test_sigint_at_random_points_leaves_nothing(checkpoint_factory, tmp_path):
    src = checkpoint_factory("deepseek_v3")  # 6 shards; --ram 64KiB: a few rows at a time
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent, errors = tmp_path / "out", tmp_path / "errors.txt"
    parent.mkdir()
    proc = subprocess.run([sys.executable, "-c", HARNESS, str(src), str(parent), str(errors), "20", "30"], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not errors.exists(), errors.read_text()[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    results = report["results"]
    assert all(r["rc"] in (0, 130) for r in results), results
    assert all(not r["left"] for r in results), results
    # an interrupted run leaves no folder, unless the signal came after the rename that completes it (status 130
    # all the same): every folder there is complete, byte for byte
    interrupted = [r for r in results if r["rc"] == 130 and not r["out"]]
    written = [f"t{i}" for i, r in enumerate(results) if r["out"]]
    assert sorted(os.listdir(parent)) == sorted(["whole0", "whole1", "whole2", *written])  # no temporary folder
    whole = {f.name: f.read_bytes() for f in (parent / "whole0").iterdir()}
    for name in ["whole1", "whole2", *written]:
        assert {f.name: f.read_bytes() for f in (parent / name).iterdir()} == whole, name
    FIGURES["sigint trials"] = (f"{len(results)}: {len(interrupted)} left nothing, {len(written)} complete "
                                f"(run {report['duration']:.2f} s)")
    assert len(interrupted) >= 10


# ---- flags, refusals, budget ------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,flag", [(("--weights", "int4", "--group", "7"), "--group"),
                                        (("--weights", "int4", "--group", "20"), "--group"),
                                        (("--weights", "int8", "--ram", "lots"), "--ram"),
                                        (("--weights", "int8", "--ram", "0"), "--ram"),
                                        (("--weights", "int8", "--no-keep-embeddings"), "--no-keep-embeddings"),
                                        (("--weights", "int8", "--keep", "(["), "--keep"),
                                        (("--weights", "int4", "--ram", "4KiB"), "--ram")])
def test_bad_flags_name_the_flag(flags, flag, checkpoint_factory, tmp_path):
    from offload_engine.frontend.quantize import add_quantize_parser, cmd_quantize
    import argparse

    parser = argparse.ArgumentParser()
    add_quantize_parser(parser.add_subparsers())
    args = parser.parse_args(["quantize", "--model", str(checkpoint_factory("llama")), "--out",
                              str(tmp_path / "q"), "--quiet", *flags])
    with pytest.raises(ConfigError, match=flag):
        cmd_quantize(args)
    assert not list(tmp_path.iterdir())


def test_refuses_to_overwrite_and_to_requantize(checkpoint_factory, tmp_path, capsys):
    src = checkpoint_factory("llama")
    out = tmp_path / "q"
    out.mkdir()
    assert main(["quantize", "--model", str(src), "--out", str(out), "--weights", "int8"]) == 2
    assert "--out" in capsys.readouterr().err and not list(out.iterdir())
    done = quantize(src, tmp_path / "q2", "--weights", "int8")
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_checkpoint(done, tmp_path / "q3", QuantizeOptions("int4"))


def test_chunks_within_a_small_budget_write_the_same_bytes(checkpoint_factory, tmp_path):
    src = checkpoint_factory("qwen3_moe")
    a = quantize(src, tmp_path / "a", "--weights", "int4", "--ram", "64KiB")
    b = quantize(src, tmp_path / "b", "--weights", "int4")
    c = quantize(src, tmp_path / "c", "--weights", "fp8", "--group", "16", "--ram", "256KiB")
    d = quantize(src, tmp_path / "d", "--weights", "fp8", "--group", "16")
    for x, y in ((a, b), (c, d)):
        files = sorted(p.name for p in x.iterdir())
        assert files == sorted(p.name for p in y.iterdir())
        assert all((x / f).read_bytes() == (y / f).read_bytes() for f in files)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (a / f).read_bytes() == (src / f).read_bytes()


# ---- the demo model: MTP, perplexity ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_bf16(tmp_path_factory) -> Path:
    return bf16_copy(tmp_path_factory.mktemp("demo") / "bf16")


@pytest.fixture(scope="module")
def demo_quantized(demo_bf16) -> dict[str, Path]:
    return {w: quantize(demo_bf16, demo_bf16.parent / w, "--weights", w) for w in ("int8", "int4")}


def test_demo_perplexity_int8_within_1_and_int4_within_5_percent(demo_bf16, demo_quantized):
    base = held_out_ppl(demo_bf16)
    got = {w: held_out_ppl(p) for w, p in demo_quantized.items()}
    FIGURES["demo ppl"] = f"bf16 {base:.3f}, " + ", ".join(
        f"{w} {p:.3f} ({100 * (p / base - 1):+.2f}%)" for w, p in got.items())
    assert abs(got["int8"] / base - 1) <= 0.01
    assert abs(got["int4"] / base - 1) <= 0.05


def test_demo_mtp_layer_survives_and_int4_drafts_within_10_percent(demo_bf16, demo_quantized):
    out = demo_quantized["int4"]
    with safe_open(demo_bf16 / "model.safetensors", "pt") as a, safe_open(out / "model.safetensors", "pt") as b:
        mtp = [n for n in a.keys() if n.startswith("model.layers.4.")]
        assert len(mtp) > 100 and all(torch.equal(a.get_tensor(n), b.get_tensor(n)) for n in mtp)
        assert not [n for n in b.keys() if n.startswith("model.layers.4.") and n not in mtp]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "re:model\\.layers\\.4\\..*" in config["ignore"]
    base, quant = mtp_acceptance(demo_bf16)[1][0], mtp_acceptance(out)[1][0]
    FIGURES["demo mtp acceptance (depth 1)"] = f"bf16 {base:.3f}, int4 {quant:.3f}"
    assert quant >= 0.9 * base


def test_a_failed_run_leaves_nothing(checkpoint_factory, tmp_path, monkeypatch):
    from offload_engine.quantize import convert

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return quantize_rows(*args, **kwargs)

    monkeypatch.setattr(convert, "quantize_rows", failing)
    with pytest.raises(OSError, match="No space"):  # the folders it had to create for --out go too
        quantize_checkpoint(checkpoint_factory("qwen3_moe"), tmp_path / "a" / "b" / "q", QuantizeOptions("int4"))
    assert not list(tmp_path.iterdir())


def test_quantized_routers_and_mtp_layers_read_as_their_dequantized_values(tmp_path):
    """--no-keep-router / --no-keep-mtp: the engine reads them (transformers builds neither DeepSeek's router as
    a Linear nor the MTP layers): its logits equal those of a copy holding the library's dequantized weights."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    out = quantize(PACKAGE_MODEL, tmp_path / "q", "--weights", "int4", "--group", "0", "--no-keep-router",
                   "--no-keep-mtp")
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert not [i for i in qc["ignore"] if ("layers.4" in i or "mlp.gate" in i) and "shared_head.head" not in i]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**qc["config_groups"]["group_0"]["weights"]))
    tensors, plain = load_file(out / "model.safetensors"), {}
    for name, t in tensors.items():
        stem = name.removesuffix("_packed")
        if name.endswith(".weight_packed") and (".mlp.gate." in name or ".layers.4." in name):
            parts = {k.removeprefix(stem.removesuffix("weight")): tensors[k] for k in
                     (stem + "_packed", stem + "_scale", stem + "_shape")}
            plain[stem] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float()
            qc["ignore"].append(stem.removesuffix(".weight"))
    assert any(".mlp.gate." in n for n in plain) and any(".layers.4." in n for n in plain)
    ref = tmp_path / "ref"
    ref.mkdir()
    kept = {n: t for n, t in tensors.items() if n.removesuffix("_packed").removesuffix("_scale").removesuffix(
        "_shape") not in plain}
    save_file({**kept, **plain}, ref / "model.safetensors", metadata={"format": "pt"})
    (ref / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ref / f).write_bytes((out / f).read_bytes())
    with Engine.open(out, dtype="float32", spec="mtp") as a, Engine.open(ref, dtype="float32", spec="mtp") as b:
        assert torch.equal(a.logits(PROMPT), b.logits(PROMPT))
        assert engine_greedy(a, PROMPT, 12) == engine_greedy(b, PROMPT, 12)
        spec = a.generate(PROMPT, max_new_tokens=24, ignore_eos=True, spec="mtp", spec_depth=1, spec_width=1)
        assert spec.stats["spec_steps"] > 0 and spec.token_ids == engine_greedy(a, PROMPT, 24)


def test_plan_reports_what_it_keeps_and_the_groups_it_fits():
    from offload_engine.checkpoint.index import CheckpointIndex
    from offload_engine.quantize.plan import make_plan

    index = CheckpointIndex.open(PACKAGE_MODEL)
    plan = make_plan(index.tensors, 4, QuantizeOptions("int4", keep=(r"\.o_proj$",)))
    kv_b = {f"model.layers.{i}.self_attn.kv_b_proj" for i in range(4)}  # in_features 48: groups of 24
    assert plan.fitted == dict.fromkeys(kv_b, 24)
    assert {m for m, why in plan.kept.items() if why.startswith("--keep")} == {
        f"model.layers.{i}.self_attn.o_proj" for i in range(4)}
    assert plan.kept["lm_head"].startswith("head") and plan.kept["model.layers.1.mlp.gate"].startswith("router")
    config = plan.quantization_config()
    assert config["config_groups"]["group_1"]["targets"] == sorted(kv_b)
    assert config["config_groups"]["group_1"]["weights"]["group_size"] == 24
    assert "model.layers.0.self_attn.o_proj" in config["ignore"] and "lm_head" in config["ignore"]
    channel = make_plan(index.tensors, 4, QuantizeOptions("int8"))
    assert not channel.fitted and list(channel.quantization_config()["config_groups"]) == ["group_0"]


MEMORY = r'''
import sys, threading, time
import psutil
from importlib import import_module
from offload_engine.cli import COMMAND_IMPORTS, main
for name in COMMAND_IMPORTS["quantize"]:  # what main imports for the command, done before the baseline
    import_module(name)
proc, peak, done = psutil.Process(), [0], threading.Event()
def sample():  # resident size every millisecond (ru_maxrss would still hold the imports' own peak)
    while not done.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.001)
base = proc.memory_info().rss
sampler = threading.Thread(target=sample)
sampler.start()
rc = main(["quantize", "--model", sys.argv[1], "--out", sys.argv[2], "--weights", sys.argv[3], "--ram", "32MiB",
           "--quiet"])
done.set()
sampler.join()
print(rc, peak[0] - base)
'''


@pytest.mark.parametrize("weights", ["int4", "fp8"])
def test_peak_memory_stays_within_ram(weights, checkpoint_factory, tmp_path):
    """A 64 MiB weight and a 64 MiB embedding quantized and copied with --ram 32MiB: the process's resident size
    grows by at most the budget."""
    src = tmp_path / "big"
    src.mkdir()
    (src / "config.json").write_bytes((checkpoint_factory("llama") / "config.json").read_bytes())
    g = torch.Generator().manual_seed(0)
    save_file({"model.layers.0.mlp.up_proj.weight": torch.randn(8192, 4096, generator=g).to(torch.bfloat16),
               "model.embed_tokens.weight": torch.randn(8192, 4096, generator=g).to(torch.bfloat16)},
              src / "model.safetensors", metadata={"format": "pt"})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", MEMORY, str(src), str(tmp_path / "q"), weights], env=env,
                          capture_output=True, text=True, timeout=300)
    rc, grew = map(int, proc.stdout.split()[-2:])
    assert rc == 0, proc.stderr[-2000:]
    FIGURES[f"peak growth {weights} --ram 32MiB"] = f"{grew / 2**20:.0f} MiB"
    assert grew <= 32 << 20
