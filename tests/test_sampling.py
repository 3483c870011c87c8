"""Sampling: params validation, transformers-equivalent warpers, greedy, seeded draws, distribution."""
from __future__ import annotations

import math

import pytest
import torch

from offload_engine.errors import ConfigError
from offload_engine.generate.sampling import Sampler, SamplingParams, probabilities

V = 50


def _hf_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The same chain transformers' generate() builds for do_sample=True."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    warpers = []
    if params.temperature != 1.0:
        warpers.append(lp.TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        warpers.append(lp.TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(lp.TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(lp.MinPLogitsWarper(params.min_p))
    scores = logits.clone()
    for w in warpers:
        scores = w(None, scores)
    return scores.softmax(dim=-1)


# ---------------------------------------------------------------------------------------------- params

@pytest.mark.parametrize("kwargs, needle", [
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"temperature": -0.1}, "temperature must be"),
    ({"temperature": float("nan")}, "temperature must be"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0"),
    ({"min_p": 1.2}, "min_p must be in [0, 1], got 1.2"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
    ({"seed": "x"}, "seed must be an integer or None"),
    ({"stop": [""]}, "stop strings must be non-empty"),
    ({"stop": [3]}, "stop must contain only str values"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be >= 0"),
    ({"temperature": "hot"}, "temperature must be a number"),
])
def test_params_errors_name_the_parameter(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        SamplingParams(**kwargs)
    assert needle in str(err.value)


def test_params_normalise_lists_and_strings():
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[1, 2])
    assert p.stop == ("a", "bc") and p.stop_token_ids == (1, 2)
    assert SamplingParams(stop="END").stop == ("END",)
    assert hash(p) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=(1, 2)))
    assert SamplingParams().greedy and not SamplingParams(temperature=0.7).greedy


# ---------------------------------------------------------------------------------------------- greedy

def test_greedy_is_one_hot_argmax_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0]])
    probs = probabilities(logits, SamplingParams())
    assert probs.dtype == torch.float32
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    sampler = Sampler(SamplingParams())
    assert sampler.sample(logits[0]) == 1
    assert sampler.sample(logits[1]) == 0


# ---------------------------------------------------------------------------------------------- vs transformers

CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=V + 10),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.3),
    SamplingParams(temperature=2.0, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.5, min_p=0.9),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.5, top_k=10, top_p=0.95, min_p=0.2),
]


@pytest.mark.parametrize("params", CASES, ids=repr)
def test_matches_transformers_warpers(params):
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(64, V, generator=gen) * 3
    ours = probabilities(logits, params)
    ref = _hf_probabilities(logits, params)
    assert torch.equal(ours > 0, ref > 0), "different sets of surviving tokens"
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.sum(-1), torch.ones(64), atol=1e-5, rtol=0)
    assert ((ours > 0).sum(-1) >= 1).all()


def test_batched_over_leading_dims():
    params = SamplingParams(temperature=0.9, top_k=7, top_p=0.85, min_p=0.02)
    logits = torch.randn(3, 4, V, generator=torch.Generator().manual_seed(0))
    batched = probabilities(logits, params)
    assert batched.shape == (3, 4, V)
    for i in range(3):
        for j in range(4):
            torch.testing.assert_close(batched[i, j], probabilities(logits[i, j], params), atol=0, rtol=0)


def test_top_p_ties_keep_lowest_ids_first():
    logits = torch.zeros(8)  # uniform: top_p 0.3 keeps 3 of 8 (mass before each kept token < 0.3)
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.3))
    assert (probs > 0).nonzero().flatten().tolist() == [0, 1, 2]
    again = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.3))
    assert torch.equal(probs, again)


def test_top_k_keeps_boundary_ties_like_transformers():
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0])
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [True, False, True, True, False]


def test_handles_minus_inf_logits():
    logits = torch.tensor([-math.inf, 0.0, 1.0, -math.inf])
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1))
    assert probs.tolist() == [0.0, 0.0, 1.0, 0.0]


# ---------------------------------------------------------------------------------------------- sampler

def test_same_seed_same_tokens_different_seed_differs():
    logits = torch.randn(V, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, seed=42)

    def draw(p: SamplingParams) -> list[int]:
        sampler = Sampler(p)
        return [sampler.sample(logits) for _ in range(200)]

    assert draw(params) == draw(params)
    assert draw(params) != draw(SamplingParams(temperature=1.0, seed=43))


def test_unseeded_sampler_gets_a_recorded_seed():
    a, b = Sampler(SamplingParams(temperature=1.0)), Sampler(SamplingParams(temperature=1.0))
    assert isinstance(a.seed, int) and a.seed != b.seed
    assert isinstance(a.generator, torch.Generator)


def test_sample_rejects_batched_logits():
    with pytest.raises(ValueError, match=r"shape \[V\]"):
        Sampler(SamplingParams(temperature=1.0)).sample(torch.zeros(2, V))


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty approximation; no scipy needed)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=7),
    SamplingParams(temperature=1.2, top_k=6, top_p=0.9, min_p=0.05, seed=8),
], ids=["temperature", "all-warpers"])
def test_sample_matches_probabilities(params):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(3)) * 1.5
    expected = probabilities(logits, params)
    sampler = Sampler(params)
    n = 20_000
    counts = torch.bincount(torch.tensor([sampler.sample(logits) for _ in range(n)]), minlength=12).double()
    observed = counts / n
    assert (counts[expected == 0] == 0).all(), "sampled a filtered token"
    tv = 0.5 * (observed - expected.double()).abs().sum().item()
    assert tv < 0.02, f"total variation distance {tv:.4f}"
    support = expected > 0
    exp_counts = expected.double()[support] * n
    chi2 = (((counts[support] - exp_counts) ** 2) / exp_counts).sum().item()
    assert chi2 < _chi2_critical(int(support.sum()) - 1), f"chi-square {chi2:.2f}"
