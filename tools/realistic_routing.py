#!/usr/bin/env python3
"""Give a random-weight MoE checkpoint realistic routing: Zipf-like expert popularity and token-to-token locality.

A random checkpoint routes unrealistically. Its residual stream is dominated by the layers' outputs (at init
range 0.05 one attention output outweighs the embedding ~50x), so every token's router input is nearly the
same, greedy decoding repeats itself, and an LRU expert cache of a quarter of the experts hits 94% of the time;
real models hit 70-85% at comparable cache fractions (docs/PERF.md, /work/shared/FIELD-NOTES.md). This tool
rewrites three kinds of tensors of a built checkpoint (tools/make_checkpoint.py), in place, so that routing
becomes a controlled mix:

- **embed_tokens**: token t -> S * (a * e_t + b * topic(t) + c * common), unit random vectors. S (~2000) makes
  the embedding outweigh every layer's output, so each layer's router sees the token, its topic and the common
  direction. Tokens lie on one random cycle through the vocabulary; `segment` consecutive tokens of the cycle
  share a topic vector.
- **lm_head**: row j = e of j's predecessor on the cycle, so greedy decoding walks the cycle: no repetition,
  and consecutive tokens share a topic for ~`segment` steps (the locality).
- **mlp.gate.weight** (every MoE layer): random rows plus `popularity` * log(Zipf(`zipf`) weight) along the common
  direction, the experts' ranks shuffled per layer: a per-expert bias, as real routers' popularity skew.

Every tensor keeps its name, shape and dtype (the bytes the engine moves are unchanged); only values change.
Tuned on the bench checkpoint (tools/bench.py --routing realistic) so that the engine's LRU-floor cache at the
25% budget hits ~75-80%, and a replayed LRU at 25% of the experts ~75-85% (docs/PERF.md).

    python tools/realistic_routing.py bench-out/bench-model-realistic        # rewrite a built checkpoint
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

MARKER = "realistic_routing.json"  # written next to config.json: the settings applied


@dataclass(frozen=True)
class RoutingPreset:
    token: float = 1.0  # weight of the token's own direction in the embedding (and so in router inputs)
    topic: float = 1.3  # weight of the topic direction shared by `segment` consecutive tokens of the cycle
    common: float = 1.0  # weight of the direction shared by every token (carries the popularity bias)
    popularity: float = 1.3  # scale of log(Zipf weight) in router logits, relative to the random part
    zipf: float = 1.0  # Zipf exponent of expert popularity
    segment: int = 16  # tokens per topic along the cycle
    scale: float = 2000.0  # embedding norm: far above the layers' outputs (tens to a few hundred)
    head: float = 0.5  # lm_head row norm
    seed: int = 0


def _unit(rows: int, dim: int, gen: torch.Generator, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    v = torch.randn(rows, dim, generator=gen, dtype=dtype)
    return v / v.norm(dim=1, keepdim=True)


def routing_weights(vocab: int, hidden: int, experts: int, layers: list[int], p: RoutingPreset,
                    dtype: torch.dtype = torch.float64):
    """(embed [V, H], lm_head [V, H], {layer: router [E, H]}, cycle order) in `dtype` (float64 by default;
    float32 halves the peak for a full-size vocabulary: 151k x 2048 is 1.2 GB a matrix there)."""
    gen = torch.Generator().manual_seed(p.seed)
    tokens = _unit(vocab, hidden, gen, dtype)
    order = torch.randperm(vocab, generator=gen)  # the cycle: order[i] -> order[i + 1]
    pos = torch.empty(vocab, dtype=torch.long)
    pos[order] = torch.arange(vocab)
    topics = _unit(-(-vocab // p.segment), hidden, gen, dtype)
    common = _unit(1, hidden, gen, dtype)[0]
    # the token vectors carry no common part: lm_head (token vectors) then ignores it
    tokens = tokens - (tokens @ common)[:, None] * common[None, :]
    tokens = tokens / tokens.norm(dim=1, keepdim=True)
    mix = p.token * tokens + p.topic * topics[pos // p.segment] + p.common * common
    del topics
    embed = mix.div_(mix.norm(dim=1, keepdim=True)).mul_(p.scale)
    pred = torch.empty(vocab, dtype=torch.long)
    pred[order] = order.roll(1)  # pred[order[i]] = order[i - 1]
    head = tokens[pred].mul_(p.head)
    del tokens
    ranks = torch.arange(1, experts + 1, dtype=dtype)
    log_pop = -p.zipf * ranks.log()
    log_pop = log_pop - log_pop.mean()
    routers = {}
    for layer in layers:
        # the router's input is RMS-normed (norm sqrt(H)): <row, x> of a random row ~ N(0, 1); along the
        # common direction x has sqrt(H) * common / |mix|, so the bias row adds popularity * log_pop / |mix|
        # in the units where the token and topic parts have standard deviations `token` / |mix|, `topic` / |mix|
        rand = torch.randn(experts, hidden, generator=gen, dtype=dtype) / math.sqrt(hidden)
        bias = log_pop[torch.randperm(experts, generator=gen)] * p.popularity
        routers[layer] = rand + bias[:, None] * common[None, :] / (max(p.common, 1e-9) * math.sqrt(hidden))
    return embed, head, routers, order


def simulate_routing(vocab: int, hidden: int, experts: int, top_k: int, layers: list[int], p: RoutingPreset,
                     tokens: list[int]) -> list[tuple[int, list[list[int]]]]:
    """The routing the rewritten checkpoint would give `tokens` if the layers' outputs were negligible against
    the embedding (the design point): a trace in tools/trace_experts.py's format, one step per token."""
    embed, _, routers, _ = routing_weights(vocab, hidden, experts, layers, p)
    x = embed[tokens]
    x = x / x.norm(dim=1, keepdim=True) * math.sqrt(hidden)  # RMSNorm with unit weights
    steps = []
    for i in range(len(tokens)):
        for layer in layers:
            top = (routers[layer] @ x[i]).topk(top_k).indices.tolist()
            steps.append((layer, [top]))
    return steps


def apply(folder: str | Path, p: RoutingPreset = RoutingPreset()) -> Path:
    """Rewrite the checkpoint's embedding, lm_head and routers in place (shards holding none are untouched)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        raise ValueError(f"{folder}: tied embeddings: the head cannot differ from the embedding here")
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    experts = int(config.get("num_experts") or config.get("num_local_experts"))
    gate = ".mlp.gate.weight"
    shards = sorted(folder.glob("*.safetensors"))
    names = {}
    for shard in shards:
        with safe_open(shard, "pt") as f:
            names[shard] = list(f.keys())
    layers = sorted(int(n.split(".")[2]) for ns in names.values() for n in ns if n.endswith(gate))
    embed, head, routers, _ = routing_weights(vocab, hidden, experts, layers, p)
    new = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
    new.update({f"model.layers.{l}{gate}": w for l, w in routers.items()})
    missing = set(new) - {n for ns in names.values() for n in ns}
    if missing:
        raise ValueError(f"{folder}: tensors not found: {sorted(missing)}")
    for shard in shards:
        if not set(names[shard]) & set(new):
            continue
        with safe_open(shard, "pt") as f:
            meta = f.metadata()
            tensors = {n: f.get_tensor(n) for n in names[shard]}
        for n in set(tensors) & set(new):
            tensors[n] = new[n].to(tensors[n].dtype).contiguous()
        tmp = shard.with_name(shard.name + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(shard)
    (folder / MARKER).write_text(json.dumps(asdict(p), indent=2) + "\n")
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    for name, value in asdict(RoutingPreset()).items():
        ap.add_argument(f"--{name}", type=type(value), default=value)
    a = vars(ap.parse_args(argv))
    folder = a.pop("folder")
    print(apply(folder, RoutingPreset(**a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
