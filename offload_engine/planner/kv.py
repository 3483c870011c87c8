"""KV cache and recurrent-state bytes from config.json alone: the one formula `plan` predicts with and
Engine.open charges (the engine adds its speculation room and rollback logs through the arguments)."""
from __future__ import annotations

from ..checkpoint.hf_config import ModelSpec
from ..config import check_cache_ram, check_kv_dtype

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


KV_VALUE_BYTES = {"bf16": 2, "fp8": 1, "int8": 1}  # --kv-dtype -> bytes per cached value ("auto": the compute dtype's)
QUANTIZED_KV = ("fp8", "int8")  # with one fp32 scale per row (one position's head of K or V, MLA's latent or rope key)
KV_SCALE_BYTES = 4


def kv_row_bytes(width: int, kv_dtype: str, itemsize: int) -> int:
    """One cached row of `width` values (the unit a quantized cache scales): its data and, quantized, its scale.
    runtime/kv_storage.py allocates exactly this (tests/test_kv_quant.py checks the two agree)."""
    if check_kv_dtype(kv_dtype) == "auto":
        return width * itemsize
    return width * KV_VALUE_BYTES[kv_dtype] + (KV_SCALE_BYTES if kv_dtype in QUANTIZED_KV else 0)


def layer_kv_bytes_per_token(spec: ModelSpec, itemsize: int, kv_dtype: str = "auto") -> int:
    """One attention layer's cache entry for one position: MLA's latent and rope key, else K and V (a row per
    KV head each). itemsize: the compute dtype's, which `auto` stores."""
    if spec.get("kv_lora_rank"):
        return (kv_row_bytes(spec.get("kv_lora_rank"), kv_dtype, itemsize)
                + kv_row_bytes(spec.get("qk_rope_head_dim"), kv_dtype, itemsize))
    return 2 * spec.num_kv_heads * kv_row_bytes(spec.head_dim, kv_dtype, itemsize)


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
             mtp_positions: int | None = None, rollback: int = 0, kv_dtype: str = "auto",
             layers: range | None = None) -> int:
    """Per-sequence state for `positions`: every attention layer's KV (stored as `kv_dtype`), each linear-attention
    layer's fixed state (with `rollback` logs; always the compute dtype), and `mtp_layers` MTP layers' own caches of
    `mtp_positions` (default `positions`) entries each. A sliding-window layer (gpt-oss) is charged every position:
    runtime/kv_cache.py keeps a full-length cache for it and masks to the window (a ring buffer of `sliding_window`
    entries would save the rest). layers: only these decoder layers (a pipeline stage's, checkpoint/stage.py);
    None: all."""
    per_token = layer_kv_bytes_per_token(spec, itemsize, kv_dtype)
    # MLA (DeepSeek): every layer caches its latent, whatever else the config says
    types = ["full_attention"] * spec.num_layers if spec.get("kv_lora_rank") else layer_types(spec)
    total = 0
    for t in (types if layers is None else [types[l] for l in layers]):
        if t in ("full_attention", "sliding_attention"):
            total += per_token * positions
        else:
            total += linear_state_bytes(spec, itemsize, rollback)
    return total + mtp_layers * per_token * (positions if mtp_positions is None else mtp_positions)


def kv_bytes_per_position(spec: ModelSpec, itemsize: int, kv_dtype: str = "auto") -> int:
    """What one more position costs: every attention layer's entry (the recurrent state is fixed)."""
    return kv_bytes(spec, 1, itemsize, kv_dtype=kv_dtype) - kv_bytes(spec, 0, itemsize, kv_dtype=kv_dtype)


def _reads_a_copy(kv_dtype: str, itemsize: int) -> bool:
    """Whether attention reads a compute-dtype copy of the cache rather than the cache in place."""
    return kv_dtype in QUANTIZED_KV or kv_dtype == "bf16" and itemsize != 2


def kv_read_bytes(spec: ModelSpec, positions: int, itemsize: int, kv_dtype: str = "auto") -> int:
    """Bytes a forward moves through attention at `positions`: the cache as stored and, where that is not the
    compute dtype, the compute-dtype copy runtime/kv_storage.py writes and attention then reads (it dequantizes
    rather than attending over the stored bytes: a smaller cache, not a faster one)."""
    stored = kv_bytes(spec, positions, itemsize, kv_dtype=kv_dtype)
    if not _reads_a_copy(check_kv_dtype(kv_dtype), itemsize):
        return stored
    return stored + 2 * positions * kv_bytes_per_position(spec, itemsize)


def kv_copy_bytes(spec: ModelSpec, positions: int, itemsize: int, kv_dtype: str = "auto") -> int:
    """The transient of one attention layer's read where the storage is not the compute dtype: its entries for
    `positions` in the compute dtype, and a quantized read's fp32 product of the wider one (QuantizedStorage.read)."""
    if not _reads_a_copy(check_kv_dtype(kv_dtype), itemsize):
        return 0
    widest = spec.get("kv_lora_rank") or spec.num_kv_heads * spec.head_dim
    return positions * (layer_kv_bytes_per_token(spec, itemsize) + (widest * 4 if kv_dtype in QUANTIZED_KV else 0))


# serve --cache-ram auto: this share of the host budget for saved prompt prefixes, at most CACHE_RAM_AUTO_MAX (and
# that much without a host budget): a few conversations' KV without taking much from the weights' cache
CACHE_RAM_AUTO_SHARE = 32
CACHE_RAM_AUTO_MAX = 1 << 30


def prompt_cache_bytes(value: object, host_budget: int | None, model_bytes: int) -> int:
    """--cache-ram in bytes: a size ('512MiB', '2GiB', 0: off; a percentage is of the model's bytes, as --ram's),
    or 'auto': 1/CACHE_RAM_AUTO_SHARE of the host budget, at most CACHE_RAM_AUTO_MAX (that without a budget)."""
    size = check_cache_ram(value, model_bytes)
    if size is None:  # auto
        return CACHE_RAM_AUTO_MAX if host_budget is None else min(CACHE_RAM_AUTO_MAX,
                                                                  host_budget // CACHE_RAM_AUTO_SHARE)
    return size


def context_limit(spec: ModelSpec) -> int:
    """The positions a model supports: max_position_embeddings, or the original length times the rope scaling's
    factor where a scaling stretches it further (YaRN, llama3, longrope, linear, dynamic)."""
    limit = spec.max_position_embeddings
    params = spec.rope.params
    if spec.rope.rope_type != "default" and isinstance(params.get("factor"), (int, float)):
        original = params.get("original_max_position_embeddings") or limit
        limit = max(limit, int(original * params["factor"]))
    return limit
