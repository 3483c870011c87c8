#!/usr/bin/env python3
"""Train the bundled demo model: a small DeepSeek-V3-style MoE (MLA, shared expert, 32 routed experts top-2,
grouped sigmoid routing, one MTP layer trained jointly) on the Python standard library's own source.

  python tools/train_demo.py --out offload_engine/data/demo-model        # ~25 min on 2 CPU cores
  python tools/train_demo.py --eval --out offload_engine/data/demo-model # held-out figures (~30 s, tools/eval_demo.py)

--eval writes eval.json and the model card README.md into --out: held-out perplexity against a unigram baseline,
MTP speculative-decoding acceptance (and that its output equals plain decoding), expert-prefetch recall.

Every machine has the training text offline. A fixed set of files (every 20th, sorted) is held out for
evaluation. Deterministic given --seed: data order, initialization and the number of steps are fixed.
Routing balance uses DeepSeek-V3's auxiliary-loss-free rule: after each step every layer's
e_score_correction_bias moves by `bias_rate` toward equal expert loads.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.make_checkpoint import EOT, released_mtp_tensors, train_tokenizer, write_tokenizer  # noqa: E402

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__", "ensurepip"}


@dataclass(frozen=True)
class TrainConfig:
    vocab: int = 2048
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    dense_intermediate: int = 384
    experts: int = 32
    top_k: int = 2
    moe_intermediate: int = 128
    seq_len: int = 128
    batch: int = 16
    steps: int = 2400
    lr: float = 4e-3
    warmup: int = 100
    mtp_weight: float = 0.3
    bias_rate: float = 1e-3
    corpus_bytes: int = 16 << 20
    seed: int = 0


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out): every 20th file of the sorted stdlib sources is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1]))
    return [f for i, f in enumerate(files) if i % 20], [f for i, f in enumerate(files) if i % 20 == 0]


def read_texts(files: list[Path], cap: int) -> list[str]:
    texts, total = [], 0
    for f in files:
        t = f.read_text(encoding="utf-8", errors="replace")
        texts.append(t)
        total += len(t)
        if total >= cap:
            break
    return texts


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids + [eot]
    return torch.tensor(ids, dtype=torch.long)


def model_config(c: TrainConfig, vocab: int, eot: int):
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=vocab, hidden_size=c.hidden, intermediate_size=c.dense_intermediate, num_hidden_layers=c.layers,
        num_attention_heads=c.heads, num_key_value_heads=c.heads, n_routed_experts=c.experts,
        num_experts_per_tok=c.top_k, moe_intermediate_size=c.moe_intermediate, n_shared_experts=1,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True,
        # as the releases' config.json says (transformers implies them; llama.cpp's converter reads them)
        scoring_func="sigmoid", topk_method="noaux_tc",
        q_lora_rank=64, kv_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        max_position_embeddings=2048, rope_theta=10000.0, initializer_range=0.02, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, num_nextn_predict_layers=1)


def build(c: TrainConfig, vocab: int, eot: int):
    from transformers import DeepseekV3ForCausalLM
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(c.seed)
    model = DeepseekV3ForCausalLM(model_config(c, vocab, eot))
    model.config.num_mtp_layers = 1
    mtp = MtpModel(model, 1)
    for module in mtp.layers.modules():  # MtpModel leaves its block uninitialized
        model._init_weights(module)
    return model, mtp


def losses(model, mtp, batch: torch.Tensor, c: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Main next-token loss, and the MTP loss for token t+2 from (hidden_t after the final norm, embed(t+1))."""
    T = c.seq_len
    inputs = batch[:, :T]
    hidden = model.model(input_ids=inputs).last_hidden_state
    logits = model.lm_head(hidden)
    main = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:T + 1].flatten())
    positions = torch.arange(1, T + 1).expand(batch.shape[0], -1)
    h2 = mtp.forward_layer(0, hidden, positions, None, input_ids=batch[:, 1:T + 1])
    mtp_loss = F.cross_entropy(mtp._project_to_logits(h2).flatten(0, 1), batch[:, 2:T + 2].flatten())
    return main, mtp_loss


class LoadBalancer:
    """Counts each MoE layer's routed experts per step (from the routers' outputs) and nudges the correction
    bias toward equal loads: DeepSeek-V3's auxiliary-loss-free balancing."""

    def __init__(self, model, rate: float):
        self.rate, self.loads = rate, {}
        self.routers = {name: m for name, m in model.named_modules() if name.endswith("mlp.gate")}
        for name, router in self.routers.items():
            router.register_forward_hook(self._record(name))  # training tool only: the engine has no hooks

    def _record(self, name: str):
        def hook(module, args, output):  # the router returns (logits, top-k weights, top-k indices)
            counts = torch.bincount(output[-1].flatten(), minlength=module.weight.shape[0]).float()
            self.loads[name] = self.loads.get(name, 0) + counts
        return hook

    @torch.no_grad()
    def step(self) -> None:
        for name, counts in self.loads.items():
            bias = self.routers[name].e_score_correction_bias
            bias += self.rate * torch.sign(counts.mean() - counts)
        self.loads.clear()


def train(args: argparse.Namespace, c: TrainConfig) -> None:
    torch.manual_seed(c.seed)
    train_files, held_out = stdlib_files()
    texts = read_texts(train_files, c.corpus_bytes)
    tok = train_tokenizer(c.vocab, texts[: max(1, len(texts) // 4)])
    eot = tok.token_to_id(EOT)
    stream = token_stream(tok, texts)
    print(f"corpus: {len(texts)} files, {stream.numel():,} tokens; held out: {len(held_out)} files")
    model, mtp = build(c, tok.get_vocab_size(), eot)
    balancer = LoadBalancer(model, c.bias_rate)
    params = [p for p in list(model.parameters()) + list(mtp.layers.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=c.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / c.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / c.steps))))
    gen = torch.Generator().manual_seed(c.seed)
    curve = []
    model.train()
    start = time.time()
    for step in (bar := tqdm(range(c.steps), desc="training", unit="step")):
        starts = torch.randint(0, stream.numel() - c.seq_len - 2, (c.batch,), generator=gen)
        batch = torch.stack([stream[s:s + c.seq_len + 2] for s in starts.tolist()])
        main, mtp_loss = losses(model, mtp, batch, c)
        loss = main + c.mtp_weight * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        balancer.step()
        curve.append((step, main.item(), mtp_loss.item()))
        bar.set_postfix(loss=f"{main.item():.3f}", mtp=f"{mtp_loss.item():.3f}")
    print(f"trained {c.steps} steps in {time.time() - start:.0f} s")
    save(args.out, model, mtp, tok, c, curve)


def save(out: Path, model, mtp, tok, c: TrainConfig, curve: list) -> None:
    from safetensors.torch import load_file, save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.eval()
    model.save_pretrained(tmp, max_shard_size="100MB")
    weights = load_file(tmp / "model.safetensors")
    weights.update(released_mtp_tensors(model, mtp))
    save_file(split_fused_experts(weights), tmp / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(tok, tmp, 2048)
    (tmp / "train_config.json").write_text(json.dumps(asdict(c), indent=2) + "\n")
    (tmp / "loss_curve.json").write_text(json.dumps(curve))
    plot_curve(curve, tmp / "loss_curve.png")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB)")


def split_fused_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert names, as DeepSeek's released checkpoints have them, for tensors still in transformers'
    fused form (the MTP layer's: save_pretrained converted only the trunk's): gate_up_proj [E, 2I, H] ->
    experts.{e}.gate_proj / up_proj [I, H] (gate first), down_proj [E, H, I] -> experts.{e}.down_proj [H, I]."""
    out = {}
    for name, t in weights.items():
        prefix, fused, kind = name.rpartition(".experts.")[0], ".experts." in name, name.rsplit(".", 1)[-1]
        if fused and kind == "gate_up_proj":
            gates, ups = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.gate_proj.weight"] = gates[e].contiguous()
                out[f"{prefix}.experts.{e}.up_proj.weight"] = ups[e].contiguous()
        elif fused and kind == "down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def plot_curve(curve: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, main, mtp = zip(*curve)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, main, label="next token", lw=0.8)
    ax.plot(steps, mtp, label="MTP (token t+2)", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "offload_engine" / "data" / "demo-model")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval", action="store_true", help="evaluate an already trained --out on held-out files")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    c = TrainConfig(steps=args.steps, seed=args.seed)
    if args.eval:
        from tools.eval_demo import evaluate

        evaluate(args.out, stdlib_files()[1])
        return 0
    train(args, c)
    return 0


if __name__ == "__main__":
    sys.exit(main())
