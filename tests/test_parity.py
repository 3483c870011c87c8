"""The engine's fp32 logits and greedy tokens against transformers on the same files (DESIGN: correctness floor)."""
from __future__ import annotations

import pytest
import torch
import transformers

from offload_engine import Engine

from conftest import ARCHS, MOE_ARCHS

PROMPT_LEN, NEW_TOKENS = 64, 32


def reference(path):
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.generation_config.eos_token_id = None  # compare full-length greedy runs
    return ref.eval()


def prompt_ids(vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (PROMPT_LEN,), generator=g).tolist()


def check_parity(path, **open_kw) -> None:
    ref = reference(path)
    with Engine.open(path, dtype="float32", **open_kw) as engine:
        ids = prompt_ids(engine.model.vocab_size)
        ours = engine.logits(ids)
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits[0].float()
        scale = theirs.abs().max().item()
        diff = (ours - theirs).abs().max().item()
        assert diff <= 1e-4 * scale, f"max |diff| {diff:.3g} > 1e-4 x max|logit| {scale:.3g}"

        completion = engine.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        with torch.no_grad():
            expected = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    pad_token_id=0)[0, PROMPT_LEN:].tolist()
        assert completion.token_ids == expected
        assert len(set(expected)) > 1, "degenerate random model: greedy output is one repeated token"


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_logits_and_greedy_match_transformers(checkpoint_factory, arch):
    check_parity(checkpoint_factory(arch))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_bf16_weights_upcast_like_transformers(checkpoint_factory, arch):
    check_parity(checkpoint_factory(arch, dtype="bfloat16"))


@pytest.mark.parametrize("arch", [a for a in MOE_ARCHS])
def test_fused_expert_tensors(checkpoint_factory, arch):
    path = checkpoint_factory(arch, fused_experts=True)
    check_parity(path)


def test_decode_token_by_token_matches_prefill(checkpoint_factory):
    """The KV-cache path: logits of a token decoded after a prefill equal those of one long prefill."""
    with Engine.open(checkpoint_factory("qwen3_moe")) as engine:
        ids = prompt_ids(engine.model.vocab_size)
        full = engine.logits(ids).to(engine.device)
        model = engine.model
        cache = model.new_cache(len(ids))
        model.forward(torch.tensor(ids[:48], device=engine.device), cache)
        steps = torch.cat([model.forward(torch.tensor([t], device=engine.device), cache) for t in ids[48:]])
        assert torch.allclose(steps, full[48:], atol=1e-5 * full.abs().max().item())


def _random_experts(gen: torch.Generator, dtype: torch.dtype, H: int, I: int, E: int):
    """E random gated-SiLU experts ({gate, up, down}) of hidden size H and I, and the function computing one."""
    from offload_engine.runtime.layers import gated_mlp

    experts = {e: {n: torch.randn(*shape, generator=gen).to(dtype)
                   for n, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))} for e in range(E)}
    return experts, lambda w, x: gated_mlp(x, w["gate"], w["up"], w["down"], torch.nn.functional.silu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_routing_is_bitwise_the_general_path(dtype):
    """A few rows (a draft tree's verification) read their routing once (moe.RowRouting) and take consecutive rows
    as views: the expert sum and the experts' order must equal the general path's (torch.where, gathers, the
    scatter-add, the vectorized routed_experts) bit for bit, for chains where consecutive rows share experts and
    for scattered routings."""
    from offload_engine.runtime import moe

    gen = torch.Generator().manual_seed(1)
    H, E, k = 64, 8, 2
    experts, fn = _random_experts(gen, dtype, H, 32, E)
    for trial in range(40):
        T = 2 + trial % (moe.SMALL_ROWS - 1)
        x = torch.randn(T, H, generator=gen).to(dtype)
        if trial % 2:  # the same experts for runs of consecutive rows, in varying slots
            base = torch.randperm(E, generator=gen)[:k]
            indices = torch.stack([base.roll(t // 3) if t % 4 else torch.randperm(E, generator=gen)[:k]
                                   for t in range(T)])
        else:
            indices = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        weights = torch.softmax(torch.randn(T, k, generator=gen), -1).to(dtype)
        routing = moe.RowRouting(indices, weights)
        w = weights.reshape(-1).float()  # the order by definition: last row routed to, its weight there, the index
        last = {e: (i // k, float(w[i]), e) for i, e in enumerate(indices.reshape(-1).tolist())}
        assert routing.order == sorted(last, key=last.__getitem__) == moe.routed_experts(indices, weights), trial
        fast = moe.combine(x, {e: moe.expert_part(x, indices, weights, e, experts[e], fn, routing)
                               for e in reversed(routing.order)})
        general = moe.combine(x, {e: moe.expert_part(x, indices, weights, e, experts[e], fn)
                                  for e in routing.order})
        assert torch.equal(fast, general), trial


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_short_path_of_the_expert_sum_is_bitwise_the_general_one(dtype):
    """runtime/moe.py computes one token's expert sum without index ops; the bits must equal the general path
    (gather the token rows, scale, scatter-add in ascending expert order)."""
    from offload_engine.runtime.moe import combine, expert_part, routed_experts

    gen = torch.Generator().manual_seed(0)
    H, E, k = 64, 16, 4
    experts, fn = _random_experts(gen, dtype, H, 32, E)
    for trial in range(20):
        x = torch.randn(1, H, generator=gen).to(dtype)
        indices = torch.randperm(E, generator=gen)[:k].unsqueeze(0)
        weights = torch.softmax(torch.randn(1, k, generator=gen), -1)
        order = routed_experts(indices, weights)
        assert sorted(order) == torch.unique(indices).tolist()
        fast = combine(x, {e: expert_part(x, indices, weights, e, experts[e], fn) for e in reversed(order)})
        general = torch.zeros_like(x)
        for e in sorted(order):
            tok, slot = torch.where(indices == e)
            general[tok] += fn(experts[e], x[tok]) * weights[tok, slot, None].to(dtype)
        assert torch.equal(fast, general), trial
