"""KV cache and recurrent-state bytes from config.json alone: the one formula `plan` predicts with and
Engine.open charges (the engine adds its speculation room and rollback logs through the arguments)."""
from __future__ import annotations

from ..checkpoint.hf_config import ModelSpec

HYBRID_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")  # Gated DeltaNet + full attention


def layer_types(spec: ModelSpec) -> list[str]:
    """Each layer's attention: config.json's layer_types; for the hybrids without it, every
    full_attention_interval-th layer is full attention and the rest linear; otherwise all full attention."""
    types = spec.get("layer_types")
    if isinstance(types, list) and len(types) == spec.num_layers:
        return [str(t) for t in types]
    if spec.model_type in HYBRID_TYPES:
        interval = spec.get("full_attention_interval") or 4
        return ["full_attention" if (l + 1) % interval == 0 else "linear_attention" for l in range(spec.num_layers)]
    return ["full_attention"] * spec.num_layers


def layer_kv_bytes_per_token(spec: ModelSpec, itemsize: int) -> int:
    """One attention layer's cache entry for one position: MLA's latent and rope key, else K and V."""
    if spec.get("kv_lora_rank"):
        return (spec.get("kv_lora_rank") + spec.get("qk_rope_head_dim")) * itemsize
    return 2 * spec.num_kv_heads * spec.head_dim * itemsize


def linear_state_bytes(spec: ModelSpec, itemsize: int, rollback: int = 0) -> int:
    """One linear-attention (DeltaNet) layer's fixed state: the conv state in the compute dtype and the fp32
    recurrent state. rollback > 0 adds what the cache keeps to rewind that many positions: two more state
    checkpoints and the step logs (conv row, and k, v, g, beta in fp32) of up to 3 * rollback positions."""
    nk, nv = spec.get("linear_num_key_heads", 16), spec.get("linear_num_value_heads", 32)
    dk, dv = spec.get("linear_key_head_dim", 128), spec.get("linear_value_head_dim", 128)
    conv_dim = 2 * nk * dk + nv * dv
    live = conv_dim * (spec.get("linear_conv_kernel_dim", 4) - 1) * itemsize + nv * dk * dv * 4
    if rollback <= 0:
        return live
    return 3 * live + 3 * rollback * (conv_dim * itemsize + 4 * nv * (dk + dv + 2))


def kv_bytes(spec: ModelSpec, positions: int, itemsize: int, *, mtp_layers: int = 0,
             mtp_positions: int | None = None, rollback: int = 0, layers: range | None = None) -> int:
    """Per-sequence state for `positions`: every attention layer's KV, each linear-attention layer's fixed state
    (with `rollback` logs), and `mtp_layers` MTP layers' own caches of `mtp_positions` (default `positions`) entries
    each. A sliding-window layer (gpt-oss) is charged every position: runtime/kv_cache.py keeps a full-length cache
    for it and masks to the window (a ring buffer of `sliding_window` entries would save the rest). layers: only
    these decoder layers (a pipeline stage's, checkpoint/stage.py); None: all."""
    per_token = layer_kv_bytes_per_token(spec, itemsize)
    # MLA (DeepSeek): every layer caches its latent, whatever else the config says
    types = ["full_attention"] * spec.num_layers if spec.get("kv_lora_rank") else layer_types(spec)
    total = 0
    for t in (types if layers is None else [types[l] for l in layers]):
        if t in ("full_attention", "sliding_attention"):
            total += per_token * positions
        else:
            total += linear_state_bytes(spec, itemsize, rollback)
    return total + mtp_layers * per_token * (positions if mtp_positions is None else mtp_positions)
