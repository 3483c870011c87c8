"""Sizes from config fields alone, for what the runtime does not run: the vision tower a text-only engine skips
(counted, not placed)."""
from __future__ import annotations

from typing import Any, Mapping


def vision_params(v: Mapping[str, Any]) -> int:
    """Qwen3.5's ViT: patch embed, position embedding, `depth` blocks, patch merger (text-only engine skips it)."""
    h, i, depth = v.get("hidden_size", 0), v.get("intermediate_size", 0), v.get("depth", 0)
    merge, out = v.get("spatial_merge_size", 2), v.get("out_hidden_size", 0)
    block = (3 * h * h + 3 * h) + (h * h + h) + (i * h + i) + (h * i + h) + 4 * h
    patch = v.get("in_channels", 3) * v.get("temporal_patch_size", 2) * v.get("patch_size", 16) ** 2 * h + h
    m = h * merge * merge
    merger = 2 * h + (m * m + m) + (out * m + out)
    return depth * block + patch + v.get("num_position_embeddings", 0) * h + merger
