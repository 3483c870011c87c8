"""Multi-token prediction: checkpoint format (tools/make_checkpoint.py --mtp), units, and the MTP forward against
transformers' own MtpModel (the module generate(use_mtp=True) drafts with), including the drafter's caches."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers.modeling_layers import MtpModel  # noqa: E402

from offload_engine.checkpoint.model import open_model  # noqa: E402
from offload_engine.checkpoint.naming import UnitKey  # noqa: E402
from offload_engine.errors import CheckpointFormatError  # noqa: E402
from offload_engine.runtime.model import CausalLM  # noqa: E402
from offload_engine.runtime.mtp import MtpHead, attach_mtp_units, mtp_layer_count  # noqa: E402
from offload_engine.speculative.drafters import MAX_CHUNKS, DraftBudget, TargetState  # noqa: E402
from offload_engine.speculative.drafters.mtp import MtpDrafter  # noqa: E402
from offload_engine.generate.sampling import SamplingParams  # noqa: E402
from offload_engine.store.resident import ResidentWeights  # noqa: E402
from tools.make_checkpoint import make_checkpoint  # noqa: E402

N_TOKENS = 24


class Pair:
    """Our CausalLM (MTP units attached) and transformers' model + MtpModel on the same checkpoint."""

    def __init__(self, path):
        self.ck = attach_mtp_units(open_model(path))
        cpu = torch.device("cpu")
        self.model = CausalLM(self.ck, ResidentWeights(self.ck, cpu, torch.float32), cpu, torch.float32)
        self.head = MtpHead(self.model)
        self.main = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.mtp = reference_mtp(self.main, self.ck)
        self.ids = torch.randint(0, self.ck.spec.vocab_size, (N_TOKENS,), generator=torch.Generator().manual_seed(0))
        logits, self.hidden = self.model.forward(self.ids, self.model.new_cache(64), return_hidden=True)
        with torch.no_grad():
            self.ref_hidden = self.main(self.ids[None], output_hidden_states=True).hidden_states[-1][0]

    def reference_drafts(self, n: int) -> tuple[list[int], torch.Tensor]:
        """transformers' drafts from context ids[:n + 1] (the root at position n): one per MTP layer."""
        with torch.no_grad():
            tokens, logits, _ = self.mtp(self.ids[None, 1:n + 1], self.ref_hidden[None, :n], None,
                                         torch.arange(1, n + 1)[None], None)
        return tokens[0].tolist(), logits[0]


def reference_mtp(main, ck) -> MtpModel:
    """MtpModel loaded from the checkpoint's released-format tensors (its from_pretrained only matches layer 61)."""
    L, n, E = main.config.num_hidden_layers, main.config.num_mtp_layers, main.config.n_routed_experts
    mtp = MtpModel(main, n).eval()
    sd = {}
    for rec in ck.index.tensors.values():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.*)", rec.name)
        if not m or int(m.group(1)) < L or m.group(2) in ("shared_head.head.weight", "embed_tokens.weight"):
            continue
        k, rest = int(m.group(1)) - L, m.group(2)
        with safe_open(rec.file, "pt") as f:
            t = f.get_tensor(rec.name).float()
        if rest == "shared_head.norm.weight":
            rest = "post_norm.weight"
        elif rest.split(".")[0] not in ("enorm", "hnorm", "eh_proj"):
            rest = "mtp_block." + rest
        sd[f"layers.{k}.{rest}"] = t
    for k in range(n):  # per-expert tensors -> transformers' fused experts
        p = f"layers.{k}.mtp_block.mlp.experts."
        if p + "0.gate_proj.weight" in sd:
            sd[p + "gate_up_proj"] = torch.stack([torch.cat([sd.pop(f"{p}{e}.gate_proj.weight"),
                                                             sd.pop(f"{p}{e}.up_proj.weight")]) for e in range(E)])
            sd[p + "down_proj"] = torch.stack([sd.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
    result = mtp.load_state_dict(sd, strict=False)
    assert sorted(result.missing_keys) == ["embed_tokens.weight", "shared_head.weight"] and not result.unexpected_keys
    return mtp


@pytest.fixture(scope="module")
def pairs(checkpoint_factory):
    cache = {}

    def get(layers: int, fused: bool = False) -> Pair:
        if (layers, fused) not in cache:
            opts = {"mtp": layers, **({"fused_experts": True} if fused else {})}
            cache[(layers, fused)] = Pair(checkpoint_factory("deepseek_v3", "tiny", **opts))
        return cache[(layers, fused)]

    return get


def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    scale, diff = theirs.abs().max().item(), (ours - theirs).abs().max().item()
    assert diff <= 1e-4 * scale, f"max |diff| {diff:.3g} > 1e-4 x {scale:.3g}"


@pytest.mark.parametrize("fused", [False, True])
def test_mtp_logits_match_transformers_at_every_position(pairs, fused):
    m = pairs(1, fused)
    h0 = m.head.trunk_hidden(m.hidden)
    close(h0, m.ref_hidden)  # the trunk's final-normed output is what depth 0 consumes
    logits, _ = m.head.forward(0, m.ids[1:], h0[:-1], torch.arange(1, N_TOKENS), m.head.new_cache(64))
    with torch.no_grad():
        hid = m.mtp.forward_layer(0, m.ref_hidden[None, :-1], torch.arange(1, N_TOKENS)[None], None,
                                  input_ids=m.ids[None, 1:])
        ref = m.mtp._project_to_logits(hid)[0]
    close(logits, ref)


@pytest.mark.parametrize("layers", [1, 2])
def test_drafter_caches_match_a_from_scratch_reference_as_the_context_grows(pairs, layers):
    """Commits of varying sizes (as accepted runs arrive) keep every layer's cache exact: each proposal's drafts
    equal transformers' (one per MTP layer) and its depth-1 logits match; past the last layer the chain reuses
    it, checked against a from-scratch recomputation of that rule."""
    m = pairs(layers)
    drafter = MtpDrafter(m.model, 64)
    state = TargetState(SamplingParams(), torch.Generator(), keep_hidden=True)
    n = 9  # prompt: positions 0..8; the root (first generated token) at 9
    state.push_hidden(0, m.hidden[:n])
    for commit in (3, 1, 4, 2, 1):
        tree = drafter.propose(m.ids[:n + 1].tolist(), state, DraftBudget(depth=layers + 1, width=1))
        tokens, ref_logits = m.reference_drafts(n)
        assert tree.tokens[:layers] == tokens
        close(drafter.logits, ref_logits[0])
        assert tree.tokens[layers] == reuse_reference(m, n, tree.tokens[:layers])
        state.push_hidden(n, m.hidden[n:n + commit])  # root + accepted drafts are now in the target's cache
        n += commit


def reuse_reference(m: Pair, n: int, drafts: list[int]) -> int:
    """Depth M + 1 with M layers: the last layer once more, at position n + M with token d_M, fed its own output
    at n + M - 1. Recomputed without the drafter's caches: every layer k over all its positions k + 1 .. n + k."""
    M = m.head.count
    seq = torch.cat([m.ids[:n + 1], torch.tensor(drafts)])  # positions 0 .. n + M
    prev, start = m.head.trunk_hidden(m.hidden[:n]), 0  # depth 0's input at positions 0 .. n - 1
    for k in range(M):
        cache = m.head.new_cache(64)
        lo, hi = k + 1, n + k
        _, out = m.head.forward(k, seq[lo:hi + 1], prev[lo - 1 - start:hi - start], torch.arange(lo, hi + 1), cache)
        prev, start = out, lo
    logits, _ = m.head.forward(M - 1, seq[n + M:n + M + 1], prev[-1:], torch.tensor([n + M]), cache)
    return int(logits[-1].argmax())


def test_checkpoint_format_and_units(pairs, checkpoint_factory, tmp_path):
    m = pairs(1)
    L = m.ck.spec.num_layers
    names = set(m.ck.index.tensors)
    for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                   "shared_head.head.weight", "embed_tokens.weight", "self_attn.kv_a_proj_with_mqa.weight",
                   "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight",
                   "mlp.experts.7.up_proj.weight"):
        assert f"model.layers.{L}.{suffix}" in names  # the released naming
    assert json.loads((m.ck.root / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert mtp_layer_count(m.ck) == 1
    experts = {UnitKey(L, "expert", e) for e in range(m.ck.spec.num_experts)}
    assert {k for k in m.ck.layouts if k.layer == L and k.kind != "head"} == {UnitKey(L, "mtp")} | experts
    assert m.ck.unused_tensors == [f"model.layers.{L}.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight"]
    # transformers' own save: config says 1 MTP layer, no tensors -> nothing attached, nothing refused
    plain = open_model(checkpoint_factory("deepseek_v3", "tiny"))
    assert attach_mtp_units(plain) is plain and plain.args.num_nextn_predict_layers == 1
    with pytest.raises(ValueError, match="--mtp"):
        make_checkpoint("qwen3_moe", "tiny", tmp_path / "x", mtp=1)


def test_partial_mtp_tensors_are_refused(pairs, tmp_path):
    src = pairs(1).ck.root
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    gone = f"model.layers.{pairs(1).ck.spec.num_layers}.hnorm.weight"
    shard = dst / index["weight_map"].pop(gone)
    with safe_open(shard, "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != gone}
    save_file(kept, str(shard), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match="MTP tensor missing") as err:
        attach_mtp_units(open_model(dst))
    assert gone in str(err.value)


def test_hidden_rows_are_kept_in_chunks_and_bounded():
    state = TargetState(SamplingParams(), torch.Generator(), keep_hidden=True, max_hidden=6)
    rows = torch.arange(40.0).view(20, 2)
    state.push_hidden(0, rows[:4])
    state.push_hidden(4, rows[4:5])
    state.push_hidden(5, rows[5:9])  # 9 rows: at most 6 are kept, 0 .. 2 are dropped
    assert (state.hidden_start, state.hidden_end) == (3, 9)
    state.push_hidden(7, rows[7:8])  # a rewritten tail (a shorter accepted path) replaces rows 7 and 8
    assert (state.hidden_start, state.hidden_end) == (3, 8)
    assert torch.equal(state.take_hidden(3, 6), rows[3:6])
    assert state.hidden_start == 3  # consumed rows before 3 are gone
    with pytest.raises(ValueError, match="not recorded"):
        state.take_hidden(2, 4)
    with pytest.raises(ValueError, match="gap"):
        state.push_hidden(10, rows[10:11])


def test_hidden_rows_recorded_one_by_one_are_coalesced():
    """Rows pushed one position at a time while no drafter consumes them (plain steps) stay bounded in chunks."""
    state = TargetState(SamplingParams(), torch.Generator(), keep_hidden=True, max_hidden=100)
    rows = torch.arange(400.0).view(200, 2)
    for p in range(200):
        state.push_hidden(p, rows[p:p + 1])
        assert state.chunk_count <= MAX_CHUNKS
    assert (state.hidden_start, state.hidden_end) == (100, 200)
    assert torch.equal(state.take_hidden(150, 200), rows[150:200])


def test_mtp_drafter_restarts_on_a_window_when_rows_were_dropped(pairs):
    """A drafter that fell behind further than the rows kept drafts from a window: still a valid drafter."""
    m = pairs(1)
    drafter = MtpDrafter(m.model, 64)
    state = TargetState(SamplingParams(), torch.Generator(), keep_hidden=True, max_hidden=4)
    state.push_hidden(0, m.hidden[:12])  # 12 positions, only the last 4 are kept
    tree = drafter.propose(m.ids[:13].tolist(), state, DraftBudget(depth=2, width=2))
    assert len(tree) == 4 and drafter.end[0] == 12 and drafter.caches[0].length == 4 + 1  # + one draft entry


def test_only_the_decoder_layers_decide_the_fused_expert_layout():
    """MTP layers (numbered after the decoder's, or under `mtp.`) may store their experts the other way than
    the trunk; runtime/mtp.py reads either, and they must not flip the layout expected of the trunk."""
    from offload_engine.checkpoint.model import fused_expert_layout

    per_expert = [f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight" for i in range(2) for e in range(4)]
    fused_mtp = ["model.layers.2.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"]
    assert not fused_expert_layout(per_expert + fused_mtp, num_layers=2)
    assert fused_expert_layout(["model.language_model.layers.1.mlp.experts.gate_up_proj"], num_layers=2)
    assert fused_expert_layout(["model.layers.0.mlp.experts.down_proj"] + per_expert, num_layers=2)
