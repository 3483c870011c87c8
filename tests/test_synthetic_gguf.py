"""tools/synthetic_gguf.py: a real model's shape as GGUF, streamed. Checked with the `gguf` package's own reader and
dequantization (code the project did not write), at CI sizes; the full 30B-A3B shape is the bench's (docs/PERF.md)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
gguf = pytest.importorskip("gguf")

from tools import synthetic_gguf  # noqa: E402
from tools.realistic_routing import RoutingPreset, routing_weights  # noqa: E402

TINY = {**json.loads((ROOT / "configs/models/Qwen3-30B-A3B.json").read_text()),
        "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "num_hidden_layers": 2, "vocab_size": 2304}


@pytest.mark.parametrize("gtype", ["Q4_0", "Q8_0"])
def test_the_file_reads_back_with_the_gguf_package(tmp_path, gtype):
    out = tmp_path / f"m-{gtype}.gguf"
    result = synthetic_gguf.write_synthetic_gguf(TINY, out, gtype)
    assert result["tensors"] == 1 + 12 * 2 + 2 and not out.with_name(out.name + ".part").exists()
    r = gguf.GGUFReader(out)
    tensors = {t.name: t for t in r.tensors}
    assert set(tensors) == {s.name for s in synthetic_gguf.plan_tensors(TINY, gtype, True)}
    experts = tensors["blk.1.ffn_down_exps.weight"]
    assert experts.tensor_type.name == gtype and list(experts.shape) == [64, 64, 4]  # ggml order: [I, H, E]
    w = gguf.quants.dequantize(experts.data, experts.tensor_type)
    assert w.shape == (4, 64, 64) and 0.015 < float(w.std()) < 0.025  # the std the writer aims at
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert int(r.fields["qwen3moe.expert_count"].parts[-1][0]) == 4
    tokens = r.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == TINY["vocab_size"]  # padded to the config's vocabulary

    # the realistic embedding and routers are tools/realistic_routing.py's, quantized by the gguf package
    embed, _, routers, _ = routing_weights(2304, 64, 4, [0, 1], RoutingPreset(), dtype=__import__("torch").float32)
    got = gguf.quants.dequantize(tensors["token_embd.weight"].data, tensors["token_embd.weight"].tensor_type)
    cos = (got * embed.numpy()).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(embed.numpy(), axis=1))
    assert cos.min() > (0.99 if gtype == "Q4_0" else 0.9999)
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.ffn_gate_inp.weight"].data), routers[1].numpy())


def test_free_space_is_checked_before_writing(tmp_path):
    with pytest.raises(SystemExit, match=r"needs .* GiB .* has .* GiB free"):
        synthetic_gguf.check_disk(tmp_path / "x.gguf", 1 << 60)


def test_an_interrupted_write_leaves_nothing(tmp_path):
    out = tmp_path / "m.gguf"

    def stop(done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        synthetic_gguf.write_synthetic_gguf(TINY, out, "Q4_0", progress=stop)
    assert list(tmp_path.iterdir()) == []


def test_widths_that_are_not_whole_blocks_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="moe_intermediate_size 40 is not a multiple of 32"):
        synthetic_gguf.write_synthetic_gguf({**TINY, "moe_intermediate_size": 40}, tmp_path / "m.gguf")


def test_the_engine_runs_the_file(tmp_path):
    """A smoke test of the engine on the file (its GGUF parity is tests/test_gguf.py's): it opens and decodes."""
    from offload_engine import Engine

    out = tmp_path / "m.gguf"
    synthetic_gguf.write_synthetic_gguf(TINY, out, "Q8_0")
    with Engine.open(out) as engine:
        result = engine.generate([5, 6, 7], max_new_tokens=3)
    assert len(result.token_ids) == 3 and all(0 <= t < TINY["vocab_size"] for t in result.token_ids)
    assert math.isfinite(result.stats["decode_tok_s"])
