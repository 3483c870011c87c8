"""gpt-oss GGUF files (llama.cpp's arch `gpt-oss`) read back as the gpt_oss schema (checkpoint/arch/gpt_oss.py),
undoing what convert_hf_to_gguf's GptOssModel (conversion/gpt_oss.py) does:

  config   `attention.sliding_window` is the window; which layers slide: `attention.sliding_window_pattern` (one
           flag per layer, or a period) where present, else llama.cpp's gpt-oss rule (period 2, layer 0 sliding:
           transformers' default layer_types too). The expert width is `expert_feed_forward_length`. YaRN is not
           truncated: GGUF has no key for it, and gpt-oss (the releases, transformers' default) does not truncate.
  names    self_attn.sinks -> attn_sinks.weight, mlp.router -> ffn_gate_inp, post_attention_layernorm ->
           post_attention_norm (not ffn_norm, as in the other archs).
  experts  the fused gate_up (gate the even rows, up the odd ones) is split into ffn_gate_exps / ffn_up_exps
           [E, I, H] and its bias into ffn_{gate,up}_exps.bias [E, I]; down_proj is stored output-major
           ffn_down_exps [E, H, I] (a bf16 source's [E, I, H] transposed), its bias ffn_down_exps.bias [E, H]. An
           expert unit holds `gate`, `up`, `down` [out, in] and their biases; runtime/arch/gpt_oss.py multiplies gate
           and up apart (gate_up's even and odd outputs, the same dot products). An MXFP4 source keeps its bits:
           the converter moves each block's e8m0 scale in front of its 16 bytes and reorders the nibbles into
           GGUF's MXFP4 blocks, which runtime/gguf_dequant.mxfp4 decodes to the same values (2^(e-128) times the
           doubled e2m1 code; +0 where the source's code 8 is -0).
"""
from __future__ import annotations

from typing import Any, Protocol

from ...errors import CheckpointFormatError, ConfigError
from ..naming import TensorSpec, UnitKey
from .reader import GGUFFile, GGUFTensor

ARCH = "gpt-oss"
SLIDING, FULL = "sliding_attention", "full_attention"
# llama.cpp's names of the dense unit's tensors where they differ from the generic mapping (checkpoint/gguf/names.py)
NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight", "self_attn.sinks": "attn_sinks.weight",
         "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias"}
# the schema's expert parts (bf16 `_t` and MXFP4 names alike) -> (unit part, GGUF tensor suffix, rows, cols) with
# rows/cols "I" (expert width) or "H" (hidden); a bias has no cols
EXPERT = {
    "gate_up": (("gate", "ffn_gate_exps.weight", "I", "H"), ("up", "ffn_up_exps.weight", "I", "H")),
    "down": (("down", "ffn_down_exps.weight", "H", "I"),),
    "gate_up_bias": (("gate_bias", "ffn_gate_exps.bias", "I", None), ("up_bias", "ffn_up_exps.bias", "I", None)),
    "down_bias": (("down_bias", "ffn_down_exps.bias", "H", None),),
}
EXPERT["gate_up_t"], EXPERT["down_t"] = EXPERT["gate_up"], EXPERT["down"]


class Builder(Protocol):
    """What this module uses of checkpoint/gguf/model.py's builder."""
    g: GGUFFile
    spec: Any

    def tensor(self, name: str, key: UnitKey, want: str) -> GGUFTensor: ...
    def record(self, key_name: str, t: GGUFTensor, expert: int | None, shape: tuple[int, ...]) -> Any: ...
    def stored(self, key: UnitKey, local: str, ts: TensorSpec, name: str, expert: int | None) -> dict[str, TensorSpec]: ...


# ---- metadata -> config.json fields --------------------------------------------------------------------------
def _sliding(g: GGUFFile, layers: int) -> list[bool]:
    pattern = g.get(f"{ARCH}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise CheckpointFormatError(g.path, f"{ARCH}.attention.sliding_window_pattern has {len(pattern)} "
                                                f"entries for {layers} layers")
        return [bool(x) for x in pattern]
    period = 2 if pattern is None else pattern
    if isinstance(period, bool) or not isinstance(period, int) or period < 0:
        raise CheckpointFormatError(g.path, f"{ARCH}.attention.sliding_window_pattern is {pattern!r}, expected a "
                                            f"period >= 0 or one flag per layer")
    return [period == 0 or l % period < period - 1 for l in range(layers)]  # llama_hparams::set_swa_pattern


def config(g: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """The gpt_oss fields of config.json that the generic ones (checkpoint/gguf/config.py `cfg`) leave out."""
    layers = cfg["num_hidden_layers"]
    sliding = _sliding(g, layers)
    window = g.get(f"{ARCH}.attention.sliding_window")
    if any(sliding) and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise CheckpointFormatError(g.path, f"{ARCH}.attention.sliding_window is {window!r}, expected an integer "
                                            f">= 1 for the sliding layers")
    width = g.get(f"{ARCH}.expert_feed_forward_length")
    if isinstance(width, list):
        if len(set(width)) != 1:
            raise ConfigError(f"{g.path}: {ARCH}.expert_feed_forward_length varies by layer ({width[:8]}...), which "
                              f"the engine does not support")
        width = width[0]
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise CheckpointFormatError(g.path, f"metadata key {ARCH}.expert_feed_forward_length missing or not a "
                                            f"positive integer ({width!r})")
    out: dict[str, Any] = {
        "intermediate_size": width, "num_local_experts": int(g.get(f"{ARCH}.expert_count") or 0),
        "num_experts_per_tok": int(g.get(f"{ARCH}.expert_used_count") or 0),
        "layer_types": [SLIDING if s else FULL for s in sliding], "sliding_window": window if any(sliding) else None}
    if "rope_scaling" in cfg and cfg["rope_scaling"].get("rope_type") == "yarn":
        out["rope_scaling"] = {**cfg["rope_scaling"], "truncate": False}
    return out


# ---- tensors -------------------------------------------------------------------------------------------------
def component(b: Builder, key: UnitKey, local: str, ts: TensorSpec) -> dict[str, TensorSpec] | None:
    """The unit parts of schema tensor `ts` (local name `local`) as the GGUF file holds them; None where the
    generic mapping applies (embedding, head, norms and attention projections)."""
    if key.kind == "expert":
        if local not in EXPERT:
            raise CheckpointFormatError(b.g.path, f"no GGUF tensor for gpt-oss expert part {local!r} of unit {key}")
        parts: dict[str, TensorSpec] = {}
        for part in EXPERT[local]:
            parts.update(_expert_part(b, key, *part))
        return parts
    rest = ts.hf_name.removeprefix(f"model.layers.{key.layer}.")
    if key.kind == "dense" and rest in NAMES:
        return b.stored(key, local, ts, f"blk.{key.layer}.{NAMES[rest]}", None)
    return None


def _expert_part(b: Builder, key: UnitKey, part: str, suffix: str, rows: str, cols: str | None
                 ) -> dict[str, TensorSpec]:
    """Expert `key.expert`'s slice of the fused GGUF tensor `blk.L.<suffix>`, under a per-expert name of its own
    (`model.layers.L.mlp.experts.E.<part>`), the form the generic builder records."""
    dims = {"I": b.spec.intermediate_size, "H": b.spec.hidden_size}
    layer, e = key.layer, key.expert
    name = f"blk.{layer}.{suffix}"
    proj = part.removesuffix("_bias")
    own = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.{'bias' if cols is None else 'weight'}"
    if cols is not None:
        return b.stored(key, part, TensorSpec(own, (dims[rows], dims[cols])), name, e)
    t = b.tensor(name, key, own)
    want = (b.spec.num_experts, dims[rows])
    if t.shape != want:
        raise CheckpointFormatError(t.file, f"shape {list(t.shape)} disagrees with the metadata: expected "
                                            f"{list(want)} for unit {key}", tensor=t.name)
    if t.gtype not in ("F32", "F16", "BF16"):
        raise ConfigError(f"{t.file}: tensor {t.name} has type {t.gtype}; expert biases are read in F32, F16 or "
                          f"BF16 only")
    b.record(own, t, e, (dims[rows],))
    return {part: TensorSpec(own, (dims[rows],))}
