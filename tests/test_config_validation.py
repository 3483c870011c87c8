"""F13 and F16 at the architecture level: `open_model` checks every tensor against what config.json implies.

Presence, shape and dtype of each tensor (dtype mismatches refused unless allow_cast=True), unknown
model_type (the message lists the supported ones), a huge num_hidden_layers refused quickly against the
tensors, and auto_map never imported (a modeling_evil.py that would create a sentinel file on import).
Every refusal is a CheckpointError naming the file and, where one applies, the tensor.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import malformed as m  # noqa: E402

from offload_engine.errors import CheckpointError, OffloadEngineError  # noqa: E402

DEADLINE_S = 5.0
ANY_TENSOR = r"tensor '[^']+'"


@pytest.fixture
def open_model():
    try:
        from offload_engine.checkpoint import open_model as fn
    except ImportError:  # until the package re-exports it
        from offload_engine.checkpoint.model import open_model as fn
    return fn


def build(tmp_path: Path, **kw) -> Path:
    return m.build_valid_checkpoint(tmp_path / "model", **kw)


def refused(open_model, model_dir: Path, *, tensor: str | None = None, files: tuple[str, ...] = (),
            text: tuple[str, ...] = (), allow_cast: bool = False) -> str:
    """open_model must raise a CheckpointError within the deadline, naming a file of the model (one of
    `files` if given) and `tensor` (a regex) if given; returns the message."""
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        open_model(model_dir, allow_cast=allow_cast)
    assert time.monotonic() - t0 < DEADLINE_S
    msg = str(info.value)
    assert str(model_dir) in msg, msg
    if files:
        assert any(re.search(re.escape(f), msg) for f in files), (files, msg)
    if tensor is not None:
        assert re.search(tensor if tensor == ANY_TENSOR else "'" + re.escape(tensor) + "'", msg), (tensor, msg)
    for pattern in text:
        assert re.search(pattern, msg, re.I), (pattern, msg)
    return msg


SHARDS_OR_CONFIG = (m.SHARD1, m.SHARD2, m.CONFIG)


def test_valid_checkpoint_opens(tmp_path, open_model):
    ck = open_model(build(tmp_path))
    assert set(ck.index.tensors) == set(m.tensor_shapes())


# ---- F13: dtype -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])  # classic hub name, and transformers 5's
def test_config_dtype_disagrees_with_shards(tmp_path, open_model, key):
    overrides = {"torch_dtype": None, key: "bfloat16"}
    d = build(tmp_path, config_overrides=overrides)
    refused(open_model, d, tensor=ANY_TENSOR, files=(m.SHARD1, m.SHARD2), text=(r"bfloat16|BF16", r"F32",
                                                                                r"allow.cast"))
    open_model(d, allow_cast=True)  # the opt-in


def test_shard_dtype_disagrees_with_config(tmp_path, open_model):
    d = build(tmp_path, dtype=torch.float16)  # config still says float32
    refused(open_model, d, tensor=ANY_TENSOR, files=(m.SHARD1, m.SHARD2), text=(r"F16", r"float32|F32"))


def test_one_tensor_in_another_dtype(tmp_path, open_model):
    d = build(tmp_path)
    # rewrite shard 2 with one bf16 tensor (a half-converted checkpoint)
    from safetensors.torch import load_file, save_file
    tensors = load_file(d / m.SHARD2)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].bfloat16()
    save_file(tensors, str(d / m.SHARD2))
    refused(open_model, d, tensor="model.layers.1.mlp.up_proj.weight", files=(m.SHARD2,))


@pytest.mark.parametrize("value", ["int4_weird", "float8_nonsense", 5, ["float32"]])
def test_unknown_config_dtype_fails_closed(tmp_path, open_model, value):
    refused(open_model, build(tmp_path, config_overrides={"torch_dtype": value}), files=(m.CONFIG,),
            text=(r"dtype",))


# ---- F13: shapes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("hidden_size", 32), ("intermediate_size", 96), ("num_key_value_heads", 4),
                                         ("num_attention_heads", 8), ("vocab_size", 256), ("vocab_size", 10**12),
                                         ("head_dim", 8), ("hidden_size", 2**40)])
def test_config_shape_disagrees_with_tensors(tmp_path, open_model, field, value):
    refused(open_model, build(tmp_path, config_overrides={field: value}), tensor=ANY_TENSOR,
            files=SHARDS_OR_CONFIG)


def test_tensor_shape_disagrees_with_config(tmp_path, open_model):
    name = "model.layers.1.self_attn.k_proj.weight"
    d = build(tmp_path, shape_overrides={name: (16, 64)})
    refused(open_model, d, tensor=name, files=(m.SHARD2,), text=(r"\[16, 64\]", r"\[32, 64\]"))


@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight",
                                  "model.embed_tokens.weight"])
def test_missing_tensor(tmp_path, open_model, name):
    d = build(tmp_path, drop=(name,))
    refused(open_model, d, tensor=name, text=(r"missing",))


def test_one_layer_more_than_the_tensors(tmp_path, open_model):
    refused(open_model, build(tmp_path, config_overrides={"num_hidden_layers": 3}), files=(m.CONFIG,),
            text=(r"tensor 'model\.layers\.2\.[^']+'|num_hidden_layers",))


# ---- F16: config sanity -------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers", [10**9, 4000, 2**63])
def test_huge_num_hidden_layers_refused_quickly(tmp_path, open_model, layers):
    """cf. llama.cpp #25821: the layer count is checked against the tensors before anything sized by it."""
    d = build(tmp_path, config_overrides={"num_hidden_layers": layers})
    t0 = time.monotonic()
    msg = refused(open_model, d, files=(m.CONFIG,), text=(r"num_hidden_layers",))
    assert time.monotonic() - t0 < 1.0, msg


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 0), ("num_hidden_layers", -1),
                                         ("num_hidden_layers", "2"), ("num_hidden_layers", True),
                                         ("num_hidden_layers", 2.0), ("hidden_size", None), ("hidden_size", "64"),
                                         ("vocab_size", -128), ("num_attention_heads", 0), ("rms_norm_eps", "x"),
                                         ("model_type", None), ("model_type", ["llama"]), ("model_type", 3)])
def test_invalid_config_field(tmp_path, open_model, field, value):
    d = build(tmp_path, config_overrides={field: value})
    refused(open_model, d, files=(m.CONFIG,), text=(re.escape(field),))


@pytest.mark.parametrize("model_type", ["gpt_evil", "LLAMA", "", "../../llama", "modeling_evil"])
def test_unknown_model_type_lists_supported(tmp_path, open_model, model_type):
    d = build(tmp_path, config_overrides={"model_type": model_type})
    msg = refused(open_model, d, files=(m.CONFIG,), text=(r"llama",))
    assert repr(model_type) in msg or model_type in msg


def test_unsupported_feature_flag_is_a_clear_error(tmp_path, open_model):
    d = build(tmp_path, config_overrides={"mlp_bias": True})
    with pytest.raises(OffloadEngineError) as info:  # CheckpointError preferred; ConfigError tolerated
        open_model(d)
    assert str(d) in str(info.value) and "mlp_bias" in str(info.value)


# ---- auto_map: never imported ---------------------------------------------------------------------------------
def _assert_never_imported(tmp_path: Path) -> None:
    assert not list(tmp_path.rglob(m.SENTINEL)), "auto_map remote code was imported"
    assert not any(k.startswith(("modeling_evil", "configuration_evil")) for k in sys.modules)


def test_auto_map_is_ignored_for_a_native_architecture(tmp_path, open_model):
    d = build(tmp_path)
    m.add_auto_map(d)
    ck = open_model(d)
    assert set(ck.index.tensors) == set(m.tensor_shapes())
    _assert_never_imported(tmp_path)


def test_auto_map_with_unknown_model_type_is_refused_not_imported(tmp_path, open_model):
    d = build(tmp_path)
    m.add_auto_map(d)
    m.edit_config(lambda c: c.update(model_type="evil_remote", architectures=["EvilModel"]))(d)
    refused(open_model, d, files=(m.CONFIG,), text=(r"evil_remote",))
    _assert_never_imported(tmp_path)


def test_sentinel_module_really_fires(tmp_path):
    """The auto_map checks mean something: importing modeling_evil.py does create the sentinel."""
    import subprocess
    (tmp_path / "modeling_evil.py").write_text(m.EVIL_MODULE)
    subprocess.run([sys.executable, "-c", "import modeling_evil"], cwd=tmp_path, check=True, timeout=60)
    assert (tmp_path / m.SENTINEL).exists()


def test_config_on_disk_is_what_the_tests_think(tmp_path):
    d = build(tmp_path, config_overrides={"num_hidden_layers": 10**9, "rope_theta": None})
    cfg = json.loads((d / m.CONFIG).read_text())
    assert cfg["num_hidden_layers"] == 10**9 and "rope_theta" not in cfg


def test_the_default_device_comes_from_the_environment_and_bad_values_name_their_source(monkeypatch):
    from offload_engine.runtime.devices import resolve_device
    from offload_engine.errors import ConfigError

    monkeypatch.setenv("OFFLOAD_ENGINE_DEVICE", "cpu")
    assert resolve_device(None) == torch.device("cpu")
    monkeypatch.setenv("OFFLOAD_ENGINE_DEVICE", "tpu")
    with pytest.raises(ConfigError, match="OFFLOAD_ENGINE_DEVICE 'tpu'"):
        resolve_device(None)
    with pytest.raises(ConfigError, match="--device 'nonsense'"):
        resolve_device("nonsense")
    monkeypatch.delenv("OFFLOAD_ENGINE_DEVICE")
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda")
