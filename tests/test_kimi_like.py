"""A Kimi-K2-like folder as users download it, run from the CLI: config.json with model_type "kimi_k2" and its
remote-code auto_map (never imported), MLA with 384 routed experts (test-sized widths), fp8 blocks of 128x128 with
`weight_scale_inv` as released, and a tiktoken tokenizer (tiktoken.model + tokenizer_config.json, no
tokenizer.json). The prompt is text, plain and through the chat template; greedy CLI output equals the Python API's,
resident and at a budget that streams the experts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload_engine import Budget, Engine
from tests.test_tokenizer_tiktoken import MESSAGES, _kimi_folder
from tools.quant_writers import QuantOptions
from tools.synthetic_quant import write_synthetic

ROOT = Path(__file__).resolve().parent.parent
KIMI = json.loads((ROOT / "configs/models/Kimi-K2.json").read_text())
PROMPT = MESSAGES[1]["content"]
# Kimi K2's own fields, at test widths: 384 routed experts (8 per token), one shared, one leading dense layer,
# no grouping (n_group 1), its routed_scaling_factor, YaRN and rope_theta
SHRUNK = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 32, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
          "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 4096,
          "rope_scaling": {**KIMI["rope_scaling"], "original_max_position_embeddings": 128}}


@pytest.fixture(scope="module")
def kimi_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kimi") / "Kimi-K2-like"
    tok_dir = _kimi_folder(tmp_path_factory.mktemp("kimi-tok"))
    vocab = len((tok_dir / "tiktoken.model").read_text().splitlines()) + 256
    config = {k: v for k, v in KIMI.items() if k not in ("quantization_config", "auto_map", "architectures")}
    config.update(SHRUNK, vocab_size=vocab, model_type="deepseek_v3", bos_token_id=vocab - 256,
                  eos_token_id=vocab - 255)
    write_synthetic(config, folder, "fp8-block", QuantOptions(block=128), shard_bytes=4 << 20)
    written = json.loads((folder / "config.json").read_text())
    written.update(model_type="kimi_k2", architectures=KIMI["architectures"], auto_map=KIMI["auto_map"])
    (folder / "config.json").write_text(json.dumps(written, indent=2))
    for f in tok_dir.iterdir():  # tiktoken.model, tokenizer_config.json, tokenization_kimi.py (must never run)
        (folder / f.name).write_bytes(f.read_bytes())
    assert not (folder / "tokenizer.json").exists()
    return folder


def run_cli(folder: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "offload_engine.cli", "run", "--model", str(folder), "--prompt",
                           PROMPT, "--max-new-tokens", "8", "--context", "256", "--json", *args],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_the_folder_is_kimi_shaped(kimi_folder):
    from offload_engine.checkpoint.model import open_model

    ck = open_model(kimi_folder)
    assert ck.spec.model_type == "kimi_k2" and ck.spec.num_experts == 384 and ck.quant.method == "fp8"
    assert {q.kind for q in ck.formats.values()} == {"fp8_block"} and not ck.unused_tensors
    assert sum(1 for k in ck.layouts if k.kind == "expert") == 2 * 384


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
@pytest.mark.parametrize("ram", [None, "30%"], ids=["resident", "streaming"])
def test_cli_runs_a_text_prompt_and_matches_the_api(kimi_folder, chat, ram):
    extra = (["--chat"] if chat else []) + (["--ram", ram] if ram else [])
    out = run_cli(kimi_folder, *extra)
    assert len(out["token_ids"]) == 8 and out["text"] is not None
    with Engine.open(kimi_folder, budget=Budget(ram=ram), max_context=256) as engine:
        ids = engine.encode(PROMPT, chat=chat)  # the template's role markers are single special tokens
        assert out["stats"]["prompt_tokens"] == len(ids) and (len(ids) > len(engine.encode(PROMPT))) == chat
        expected = engine.generate(ids, max_new_tokens=8, ignore_eos=True).token_ids
    assert out["token_ids"][:len(expected)] == expected
    if ram is not None:
        assert out["stats"]["bytes_read_disk"] > 0  # the experts streamed through the budget
