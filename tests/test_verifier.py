"""The verifier and the draft tree: greedy rules, exact rejection sampling (a distribution test), tree masks."""
from __future__ import annotations

import pytest
import torch

from offload_engine.generate.sampling import SamplingParams, probabilities
from offload_engine.speculative.tree import DraftTree, chain_with_siblings, tree_inputs
from offload_engine.speculative.verifier import node_step, verify

V = 1000


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def distributions(seed: int, vocab: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    """A target p and a draft q over `vocab` tokens that overlap but differ (as a real drafter's would)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(vocab, generator=g) * 2.0
    p = torch.softmax(base + 0.7 * torch.randn(vocab, generator=g), -1)
    q = torch.softmax(base + 0.7 * torch.randn(vocab, generator=g), -1)
    return p, q


def simulate(p: torch.Tensor, q: torch.Tensor, layout: str, n: int, seed: int) -> torch.Tensor:
    """n independent verifications of one node with the given children; returns the output token counts [V].

    layouts: "sampled" (one child drawn from q), "sampled+chosen" (that child, then two fixed alternatives),
    "chosen" (three fixed alternatives, e.g. n-gram candidates), "sampled x2" (two i.i.d. draws from q)."""
    g = torch.Generator().manual_seed(seed)
    fixed = torch.topk(q, 3).indices
    counts = torch.zeros(V)
    for start in range(0, n, 10_000):
        B = min(10_000, n - start)
        draw = lambda: torch.multinomial(q, B, replacement=True, generator=g)[:, None]  # noqa: E731
        if layout == "sampled":
            tokens, sampled = draw(), [True]
        elif layout == "sampled+chosen":
            tokens, sampled = torch.cat([draw(), fixed[1:].expand(B, 2)], 1), [True, False, False]
        elif layout == "chosen":
            tokens, sampled = fixed.expand(B, 3), [False, False, False]
        else:
            tokens, sampled = torch.cat([draw(), draw()], 1), [True, True]
        K = tokens.shape[1]
        u = torch.rand((B, K), generator=g)
        choice, residual = node_step(p.expand(B, V), tokens, q.expand(B, K, V), sampled, u)
        accepted = choice >= 0
        out = tokens.gather(1, choice.clamp_min(0)[:, None])[:, 0]
        out[~accepted] = torch.multinomial(residual[~accepted], 1, generator=g)[:, 0]
        counts += torch.bincount(out, minlength=V).float()
    return counts


@pytest.mark.parametrize("layout", ["sampled", "sampled+chosen", "chosen", "sampled x2"])
def test_rejection_sampling_reproduces_the_target_distribution(layout):
    p, q = distributions(0)
    small, large = 1_000, 16_000
    emp_small = simulate(p, q, layout, small, seed=1) / small
    emp_large = simulate(p, q, layout, large, seed=2) / large
    noise = 0.5 * float(torch.sqrt(p * (1 - p) / large).sum()) * (2 / torch.pi) ** 0.5  # E[TV] at n = large
    assert tv(emp_large, p) < 2.0 * noise, (tv(emp_large, p), noise)
    assert tv(emp_large, p) < 0.5 * tv(emp_small, p)  # converges (1/sqrt(n): 16x the samples, ~4x closer)
    g = torch.Generator().manual_seed(3)
    far = [q] + [torch.distributions.Dirichlet(torch.ones(V)).sample() for _ in range(2)]
    near = torch.softmax(torch.log(p) + 0.7 * torch.randn(V, generator=g), -1)  # close to p, still wrong
    for ref in far:
        assert tv(emp_large, ref) > 5 * tv(emp_large, p)
    assert tv(emp_large, near) > 2 * tv(emp_large, p)


def test_verify_follows_the_same_rule_along_a_tree():
    """The tree walker (batch of one, shared generator) gives the same first-token distribution."""
    vocab = 50
    p, q = distributions(4, vocab)
    logits = torch.log(p)
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(5)
    n, counts = 2_000, torch.zeros(vocab)
    alt = int(torch.topk(q, 2).indices[1])
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=g))
        tree = DraftTree([x, alt], [-1, -1], q.expand(2, vocab).clone(), [True, False])
        verdict = verify(tree, logits.expand(3, vocab), params, g)
        counts[verdict.tokens[0]] += 1
    emp = counts / n
    noise = 0.5 * float(torch.sqrt(p * (1 - p) / n).sum()) * (2 / torch.pi) ** 0.5
    assert tv(emp, p) < 2.0 * noise
    assert tv(emp, q) > 3 * tv(emp, p)


def test_identical_draft_is_always_accepted_and_deterministic_zero_mass_never():
    p, _ = distributions(6)
    B = 5000
    g = torch.Generator().manual_seed(7)
    x = torch.multinomial(p, B, replacement=True, generator=g)[:, None]
    choice, _ = node_step(p.expand(B, V), x, p.expand(B, 1, V), [True], torch.rand((B, 1), generator=g))
    assert bool((choice == 0).all())  # q == p: min(1, p/q) = 1
    zero = torch.zeros(V)
    zero[:2] = 0.5
    choice, residual = node_step(zero.expand(B, V), torch.full((B, 1), 5), None, [False], torch.rand((B, 1)))
    assert bool((choice == -1).all()) and torch.allclose(residual, zero.expand(B, V))


def test_greedy_walks_the_argmax_path_and_tries_siblings_in_order():
    # tree: root -> a(1) -> c(3); root -> b(2) (sibling of a); a -> d(4) (sibling of c)
    tree = DraftTree(tokens=[1, 2, 3, 4], parents=[-1, -1, 0, 0])
    logits = torch.full((5, 8), -5.0)
    # rows: root, a, b, c, d; root wants 1 (a), a wants 3 (c), c wants 7 (the bonus), d wants 5
    for row, best in enumerate([1, 3, 0, 7, 5]):
        logits[row, best] = 5.0
    v = verify(tree, logits, SamplingParams())
    assert v.nodes == [0, 2] and v.tokens == [1, 3, 7] and v.ranks == [0, 0]
    logits[1] = -5.0
    logits[1, 4] = 5.0  # a now wants 4: its second child d
    v = verify(tree, logits, SamplingParams())
    assert v.nodes == [0, 3] and v.tokens == [1, 4, 5] and v.ranks == [0, 1]
    logits[0] = -5.0
    logits[0, 6] = 5.0  # root wants 6: no child -> correction token
    v = verify(tree, logits, SamplingParams())
    assert v.nodes == [] and v.tokens == [6] and v.ranks == [-1]
    ties = torch.zeros((5, 8))  # all equal: argmax = lowest id = 0, no child has token 0
    assert verify(tree, ties, SamplingParams()).tokens == [0]


def test_warpers_apply_to_both_sides():
    """top-k 1 makes the target deterministic: a draft outside its top-1 is never accepted."""
    p, q = distributions(8)
    logits = torch.log(p)
    best, other = int(p.argmax()), int(torch.topk(p, 2).indices[1])
    params = SamplingParams(temperature=0.7, top_k=1)
    g = torch.Generator().manual_seed(9)
    qq = probabilities(torch.log(q), params)
    for token, expect in ((best, [best, best]), (other, [best])):
        tree = DraftTree([token], [-1], qq[None], [True])
        for _ in range(50):
            assert verify(tree, logits.expand(2, V), params, g).tokens == expect


def test_tree_inputs_mask_and_positions():
    tree = chain_with_siblings([[10, 11], [12, 13], [14]])  # nodes: 10, 11 | 12 (child of 10), 13 | 14 (child of 12)
    assert tree.parents == [-1, -1, 0, 0, 2]
    tokens, positions, mask = tree_inputs(tree, root=9, prefix=5)
    assert tokens.tolist() == [9, 10, 11, 12, 13, 14]
    assert positions.tolist() == [5, 6, 6, 7, 7, 8]
    assert mask.shape == (6, 11) and bool(mask[:, :5].all())
    local = mask[:, 5:].int().tolist()
    assert local == [[1, 0, 0, 0, 0, 0],
                     [1, 1, 0, 0, 0, 0],
                     [1, 0, 1, 0, 0, 0],
                     [1, 1, 0, 1, 0, 0],
                     [1, 1, 0, 0, 1, 0],
                     [1, 1, 0, 1, 0, 1]]
    assert tree.path(4) == [0, 2, 4] and tree.depths() == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        DraftTree([1, 2], [1, -1])  # a parent after its child


def test_seeded_verification_is_reproducible():
    p, q = distributions(10)
    tree = chain_with_siblings([[int(q.argmax()), 3]], [q], sampled_first=True)
    params = SamplingParams(temperature=1.0)
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(11)
        runs.append([verify(tree, torch.log(p).expand(3, V), params, g).tokens for _ in range(30)])
    assert runs[0] == runs[1]
