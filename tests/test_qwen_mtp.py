"""Qwen3-Next / Qwen3.5-MoE multi-token prediction (`mtp.*`, tools/make_checkpoint.py --mtp N): the MTP forward
against a plain-torch reference of vLLM's Qwen3-Next MTP on the checkpoint's own tensors, the drafter's caches
against a from-scratch recomputation, lossless greedy speculative decoding with the mtp drafter at 100% and 25%
budgets, the linear-attention state rollback it relies on, and parameter counts."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from offload_engine import Budget, Engine
from offload_engine.checkpoint.model import open_model
from offload_engine.checkpoint.naming import UnitKey
from offload_engine.errors import ConfigError
from offload_engine.planner.plan import load_model_spec, model_shape
from offload_engine.planner.sizes import param_counts
from offload_engine.runtime.kv_cache import _StateHistory
from offload_engine.runtime.model import CausalLM
from offload_engine.runtime.mtp import MtpHead, attach_mtp_units, mtp_layer_count
from offload_engine.speculative.drafters import DraftBudget, TargetState
from offload_engine.speculative.drafters.mtp import MtpDrafter
from offload_engine.generate.sampling import SamplingParams
from offload_engine.store.resident import ResidentWeights
from tools.make_checkpoint import main as make_checkpoint_cli

ARCHS = ("qwen3_next", "qwen3_5_moe")  # qwen3_5_moe: the released vision-language layout, fused experts
PREFIX = {"qwen3_next": "model.", "qwen3_5_moe": "model.language_model."}
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
NEW = 48
N_TOKENS = 24


def checkpoint(factory, arch: str, preset: str = "tiny", mtp: int = 1) -> Path:
    return factory(arch, preset, mtp=mtp)


def resident(path: Path) -> CausalLM:
    ck = attach_mtp_units(open_model(path))
    cpu = torch.device("cpu")
    return CausalLM(ck, ResidentWeights(ck, cpu, torch.float32), cpu, torch.float32)


# ---- the reference: vLLM's Qwen3NextMultiTokenPredictor in plain torch -----------------------------------
def norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next RMSNorm: zero-centred weight, x_hat * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


class Reference:
    def __init__(self, path: Path, arch: str):
        cfg = json.loads((path / "config.json").read_text())
        self.cfg = cfg.get("text_config", cfg)
        self.t: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(f, "pt") as st:
                for k in st.keys():
                    if not k.startswith("model.visual."):
                        self.t[k] = st.get_tensor(k).float()
        self.prefix = PREFIX[arch]

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return norm(hidden, self.t[f"{self.prefix}norm.weight"], self.cfg["rms_norm_eps"])

    def rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        rope = c.get("rope_parameters") or {}
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
        D = x.shape[-1]
        rd = int(D * factor)
        inv = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)
        freqs = positions.float()[:, None] * inv[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        rot, rest = x[..., :rd], x[..., rd:]
        half = torch.cat([-rot[..., rd // 2:], rot[..., :rd // 2]], dim=-1)
        return torch.cat([rot * cos + half * sin, rest], dim=-1)

    def mtp(self, k: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer k over one sequence: tokens [T] at positions [T], hidden [T, H] (at positions - 1).
        Returns (logits [T, V], mtp.norm output [T, H])."""
        t, c, eps = self.t, self.cfg, self.cfg["rms_norm_eps"]
        p = f"mtp.layers.{k}."
        e = norm(F.embedding(tokens, t[f"{self.prefix}embed_tokens.weight"]), t["mtp.pre_fc_norm_embedding.weight"],
                 eps)
        h = norm(hidden, t["mtp.pre_fc_norm_hidden.weight"], eps)
        x = torch.cat([e, h], dim=-1) @ t["mtp.fc.weight"].T  # embedding first
        # gated full attention (q_proj yields [q | gate] per head), zero-centred q/k norms, partial rope
        T, heads, kv, D = x.shape[0], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        a = norm(x, t[p + "input_layernorm.weight"], eps)
        q, gate = (a @ t[p + "self_attn.q_proj.weight"].T).view(T, heads, 2 * D).chunk(2, dim=-1)
        key = (a @ t[p + "self_attn.k_proj.weight"].T).view(T, kv, D)
        val = (a @ t[p + "self_attn.v_proj.weight"].T).view(T, kv, D)
        q = self.rotary(norm(q, t[p + "self_attn.q_norm.weight"], eps), positions)
        key = self.rotary(norm(key, t[p + "self_attn.k_norm.weight"], eps), positions)
        key, val = key.repeat_interleave(heads // kv, dim=1), val.repeat_interleave(heads // kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, key) * D ** -0.5
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), val).reshape(T, heads * D)
        x = x + (att * torch.sigmoid(gate.reshape(T, heads * D))) @ t[p + "self_attn.o_proj.weight"].T
        # MoE: softmax top-k, renormalized; sigmoid-gated shared expert
        m = norm(x, t[p + "post_attention_layernorm.weight"], eps)
        probs = (m @ t[p + "mlp.gate.weight"].T).softmax(-1)
        top_w, top_i = probs.topk(c["num_experts_per_tok"], dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        moe = torch.zeros_like(m)
        for row in range(T):
            for w, ex in zip(top_w[row], top_i[row].tolist()):
                gate_w, up_w, down_w = self.expert(p, ex)
                moe[row] += w * ((F.silu(m[row] @ gate_w.T) * (m[row] @ up_w.T)) @ down_w.T)
        s = p + "mlp.shared_expert."
        shared = F.silu(m @ t[s + "gate_proj.weight"].T) * (m @ t[s + "up_proj.weight"].T) @ t[s + "down_proj.weight"].T
        x = x + moe + torch.sigmoid(m @ t[p + "mlp.shared_expert_gate.weight"].T) * shared
        out = norm(x, t["mtp.norm.weight"], eps)
        return out @ t["lm_head.weight"].T, out

    def expert(self, p: str, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self.t
        if p + "mlp.experts.gate_up_proj" in t:  # fused [E, 2I, H] / [E, H, I]
            gate, up = t[p + "mlp.experts.gate_up_proj"][e].chunk(2, dim=0)
            return gate, up, t[p + "mlp.experts.down_proj"][e]
        q = f"{p}mlp.experts.{e}."
        return t[q + "gate_proj.weight"], t[q + "up_proj.weight"], t[q + "down_proj.weight"]


def close(ours: torch.Tensor, theirs: torch.Tensor, atol: float = 1e-4) -> None:
    diff = (ours - theirs).abs().max().item()
    assert diff <= atol, f"max |diff| {diff:.3g} > {atol}"


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_forward_matches_the_reference(checkpoint_factory, arch):
    """Depth 0 from the trunk's final-normed hidden state, then depth 1 fed depth 0's normed output, each over
    the whole sequence and (depth 0) in two chunks through the layer's cache."""
    path = checkpoint(checkpoint_factory, arch)
    model, ref = resident(path), Reference(path, arch)
    head = MtpHead(model)
    ids = torch.randint(0, model.vocab_size, (N_TOKENS,), generator=torch.Generator().manual_seed(0))
    _, hidden = model.forward(ids, model.new_cache(N_TOKENS), return_hidden=True)
    h0 = head.trunk_hidden(hidden)
    close(h0, ref.final_norm(hidden))
    pos = torch.arange(1, N_TOKENS)
    ref_logits, ref_out = ref.mtp(0, ids[1:], ref.final_norm(hidden)[:-1], pos)
    assert len(set(ref_logits.argmax(-1).tolist())) > 1, "degenerate random MTP layer"
    logits, out = head.forward(0, ids[1:], h0[:-1], pos, head.new_cache(64))
    close(logits, ref_logits)
    close(out, ref_out)
    cache, split = head.new_cache(64), 10  # the same positions in two forwards: attention over the layer's cache
    first, _ = head.forward(0, ids[1:split], h0[:split - 1], pos[:split - 1], cache)
    second, _ = head.forward(0, ids[split:], h0[split - 1:-1], pos[split - 1:], cache)
    close(torch.cat([first, second]), ref_logits)
    assert cache.nbytes == 64 * model.ops.layer_kv_bytes_per_token(4)  # one full-attention layer's K and V
    chained, _ = head.forward(0, ids[2:], out[:-1], pos[1:], head.new_cache(64))  # next depth: the normed output
    close(chained, ref.mtp(0, ids[2:], ref_out[:-1], pos[1:])[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_units_and_layout(checkpoint_factory, arch):
    path = checkpoint(checkpoint_factory, arch)
    ck = attach_mtp_units(open_model(path))
    N, E = ck.spec.num_layers, ck.spec.num_experts
    assert mtp_layer_count(ck) == 1
    assert {k for k in ck.layouts if k.layer == N and k.kind != "head"} == (
        {UnitKey(N, "mtp")} | {UnitKey(N, "expert", e) for e in range(E)})
    assert not [n for n in ck.unused_tensors if n.startswith("mtp.")]
    assert ck.fused_experts == (arch == "qwen3_5_moe")
    from offload_engine.runtime.arch import build_ops

    ops = build_ops(ck.arch.name, ck.args, torch.device("cpu"), torch.float32)
    assert not ck.args.is_linear(N) and ops.is_moe(N)  # the MTP layer: full attention, MoE


def test_per_expert_mtp_beside_fused_trunk_experts(checkpoint_factory, tmp_path):
    """MTP experts may be stored per expert while the trunk's are fused (vLLM's Qwen3.5 MTP loader takes both):
    the same layer, the same logits."""
    src = checkpoint(checkpoint_factory, "qwen3_5_moe")
    dst = tmp_path / "split"
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    fused = "mtp.layers.0.mlp.experts."
    for shard in sorted({f for n, f in index["weight_map"].items() if n.startswith(fused)}):
        with safe_open(dst / shard, "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for name in [k for k in tensors if k.startswith(fused)]:
            stacked = tensors.pop(name)
            del index["weight_map"][name]
            for e in range(stacked.shape[0]):
                parts = (zip(("gate_proj", "up_proj"), stacked[e].chunk(2, dim=0)) if name.endswith("gate_up_proj")
                         else [("down_proj", stacked[e])])
                for proj, t in parts:
                    tensors[f"{fused}{e}.{proj}.weight"] = t.contiguous()
                    index["weight_map"][f"{fused}{e}.{proj}.weight"] = shard
        save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    logits = []
    for path in (src, dst):
        model = resident(path)
        assert model.checkpoint.fused_experts and mtp_layer_count(model.checkpoint) == 1
        head = MtpHead(model)
        ids = torch.randint(0, model.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
        _, hidden = model.forward(ids, model.new_cache(12), return_hidden=True)
        logits.append(head.forward(0, ids[1:], head.trunk_hidden(hidden)[:-1], torch.arange(1, 12),
                                   head.new_cache(16))[0])
    assert torch.equal(*logits)


def test_cli_mtp_zero_writes_none(tmp_path):
    """`--mtp 0` for a hybrid: config.json says 0 MTP layers, no mtp.* tensors, and --spec mtp is refused."""
    out = tmp_path / "no-mtp"
    assert make_checkpoint_cli(["--arch", "qwen3_5_moe_text", "--preset", "tiny", "--out", str(out), "--mtp", "0"]) == 0
    assert json.loads((out / "config.json").read_text())["mtp_num_hidden_layers"] == 0
    ck = open_model(out)
    assert attach_mtp_units(ck) is ck and not [n for n in ck.index.tensors if n.startswith("mtp.")]
    with pytest.raises(ConfigError, match="multi-token-prediction"):
        Engine.open(out, spec="mtp")
    assert make_checkpoint_cli(["--arch", "qwen3_moe", "--preset", "tiny", "--out", str(tmp_path / "x"),
                                "--mtp", "1"]) == 2  # no MTP format for this arch


def test_two_mtp_layers_and_the_drafter_caches(checkpoint_factory):
    """`--mtp 2`: layers N and N + 1. As the context grows by commits of varying sizes, each proposal's depth-1
    logits and its chain (layer 0, layer 1, then layer 1 again fed its own output) equal a from-scratch
    recomputation without the drafter's caches."""
    path = checkpoint(checkpoint_factory, "qwen3_next", mtp=2)
    assert json.loads((path / "config.json").read_text())["mtp_num_hidden_layers"] == 2
    model = resident(path)
    head = MtpHead(model)
    assert head.count == 2 and not model.ops.a.is_linear(model.num_layers + 1)
    ids = torch.randint(0, model.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    _, hidden = model.forward(ids, model.new_cache(40), return_hidden=True)
    drafter = MtpDrafter(model, 64)
    state = TargetState(SamplingParams(), torch.Generator(), keep_hidden=True)
    n = 9
    state.push_hidden(0, hidden[:n])
    for commit in (3, 1, 4, 2, 1):
        tree = drafter.propose(ids[:n + 1].tolist(), state, DraftBudget(depth=3, width=1))
        logits, drafts = from_scratch(head, ids, hidden, n, 3)
        close(drafter.logits, logits)
        assert tree.tokens == drafts
        state.push_hidden(n, hidden[n:n + commit])
        n += commit


def from_scratch(head: MtpHead, ids, hidden, n: int, depth: int) -> tuple[torch.Tensor, list[int]]:
    """Greedy chain from the root at n: layer k over positions k + 1 .. n + k (fed layer k - 1's outputs),
    then the last layer once more per further depth, fed its own output."""
    seq, drafts, M = ids[:n + 1].clone(), [], head.count
    prev, start, first = head.trunk_hidden(hidden[:n]), 0, None  # depth 0's input at positions 0 .. n - 1
    for k in range(min(depth, M)):
        lo, hi = k + 1, n + k
        cache = head.new_cache(64)
        logits, out = head.forward(k, seq[lo:hi + 1], prev[lo - 1 - start:hi - start], torch.arange(lo, hi + 1),
                                   cache)
        first = logits[-1] if k == 0 else first
        drafts.append(int(logits[-1].argmax()))
        seq = torch.cat([seq, torch.tensor(drafts[-1:])])
        prev, start = out, lo
    while len(drafts) < depth:
        p = n + len(drafts)
        logits, out = head.forward(M - 1, seq[p:p + 1], prev[-1:], torch.tensor([p]), cache)
        drafts.append(int(logits[-1].argmax()))
        seq = torch.cat([seq, torch.tensor(drafts[-1:])])
        prev = torch.cat([prev, out])
    return first, drafts


# ---- speculative decoding end to end ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(checkpoint_factory):
    opened: dict = {}

    def get(arch: str, budget: str) -> Engine:
        if (arch, budget) not in opened:
            path = checkpoint(checkpoint_factory, arch, "offload" if budget == "25%" else "tiny")
            opened[(arch, budget)] = Engine.open(path, budget=Budget(ram=budget), max_context=256, spec="mtp")
        return opened[(arch, budget)]

    yield get
    for engine in opened.values():
        engine.close()


@pytest.mark.parametrize("budget", ["100%", "25%"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_mtp_output_is_identical_to_plain_decoding(engines, arch, budget):
    engine = engines(arch, budget)
    plain = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, spec="off")
    assert len(set(plain.token_ids)) > 1
    for depth in (None, 1, 2):
        done = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, spec="mtp", spec_depth=depth)
        assert done.token_ids == plain.token_ids, depth
        st = done.stats
        assert st["spec"] == "mtp" and st["target_forwards"] + st["accepted_tokens"] >= NEW
        if depth is not None:
            assert st["spec_steps"] > 0 and st["by_drafter"]["mtp"]["steps"] > 0, st
        if budget == "25%":
            assert st["peak_bytes"]["host"] <= st["budget_bytes"]["host"]
            assert st["bytes_read_disk"] > 0
    if budget == "25%":
        assert engine.placement.home("mtp") == engine.placement.compute.name  # MTP units pinned


@pytest.mark.parametrize("budget", ["100%", "25%"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_ngram_and_self_drafts_are_identical_to_plain_decoding(engines, arch, budget):
    """The hybrids with the other drafters (chains only: recurrent state rewinds by replay)."""
    engine = engines(arch, budget)
    plain = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, spec="off")
    for drafter in ("ngram", "self"):
        done = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, spec=drafter, spec_depth=3,
                               spec_width=2)
        assert done.token_ids == plain.token_ids, drafter
        assert done.stats["spec_steps"] > 0, drafter


def test_skipping_the_linear_state_rollback_is_caught(engines, monkeypatch):
    """Rejected drafts are trimmed from the target's cache, which rewinds every DeltaNet layer's state; with the
    rewind skipped (each layer keeps the state it reached after the drafts) the mtp drafter's output changes."""
    engine = engines("qwen3_next", "100%")
    plain = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, spec="off")
    done = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, spec="mtp", spec_depth=2)
    assert done.token_ids == plain.token_ids and done.stats["spec_steps"] > 0
    monkeypatch.setattr(_StateHistory, "state_at", lambda self, position: self.head[1])
    broken = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, spec="mtp", spec_depth=2)
    assert broken.token_ids != plain.token_ids


# ---- parameter counts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_param_counts_keep_mtp_apart(checkpoint_factory, arch):
    path = checkpoint(checkpoint_factory, arch)
    plain, attached = open_model(path), attach_mtp_units(open_model(path))
    n = attached.spec.num_experts_per_tok
    before, after = param_counts(plain.schema, n), param_counts(attached.schema, n)
    mtp = sum(torch.Size(rec.shape).numel() for name, rec in attached.index.tensors.items() if name.startswith("mtp."))
    assert (after.total, after.active, after.mtp) == (before.total, before.active, mtp) and mtp > 0


@pytest.mark.parametrize("name, mtp_billions", [("Qwen3-Next-80B-A3B", 1.65), ("Qwen3.5-35B-A3B", 0.84)])
def test_released_configs_count_mtp(name, mtp_billions):
    shape = model_shape(load_model_spec(name))
    merged = shape.schema.units | shape.mtp.units
    counts = param_counts(type(shape.schema)(units=merged), shape.spec.num_experts_per_tok)
    assert counts.total == shape.params().total and counts.active == shape.params().active
    assert counts.mtp == sum(shape.mtp.unit_numel(k) for k in shape.mtp.units)
    assert abs(counts.mtp / 1e9 - mtp_billions) < 0.01
