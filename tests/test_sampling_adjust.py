"""logit_bias, presence / frequency penalties and logprobs: the formula OpenAI documents, checked value by value;
the engine's logprobs equal log_softmax of its own Engine.logits; and speculative decoding (n-gram, MTP: draft trees
whose rows each continue a different path) gives the plain decoder's tokens and logprobs with penalties on."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from offload_engine.api import Engine
from offload_engine.errors import ConfigError
from offload_engine.generate.sampling import Sampler, SamplingParams, adjusted_logits

DEMO = Path(__file__).resolve().parents[1] / "offload_engine" / "data" / "demo-model"


def openai_formula(logits: list[float], history: list[int], params: SamplingParams) -> list[float]:
    """mu[j] + bias[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence, one token at a time (the formula in
    OpenAI's parameter documentation; c[j]: how often j was generated before this position)."""
    bias = dict(params.logit_bias)
    out = []
    for j, mu in enumerate(logits):
        c = history.count(j)
        out.append(mu + bias.get(j, 0.0) - c * params.frequency_penalty - (c > 0) * params.presence_penalty)
    return out


def test_adjusted_logits_follow_the_documented_formula():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g)
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3, logit_bias={"3": 5.0, 7: -100})
    histories = [[], [1, 1, 3], [39, 2, 2, 2, 0]]
    got = adjusted_logits(logits, params, histories)
    for r, history in enumerate(histories):
        assert got[r].tolist() == pytest.approx(openai_formula(logits[r].tolist(), history, params), abs=1e-5)
    assert params.logit_bias == ((3, 5.0), (7, -100.0))


@pytest.mark.parametrize("kwargs, needle", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": "a"}, "frequency_penalty must be a number"),
    ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {1: 101}}, "logit_bias[1] must be in [-100, 100]"),
    ({"logit_bias": 5}, "logit_bias must map token ids to numbers"),
    ({"logprobs": 21}, "logprobs must be None or an integer from 0 to 20"),
    ({"logprobs": True}, "logprobs must be None or an integer"),
])
def test_bad_values_name_the_parameter(kwargs, needle):
    with pytest.raises(ConfigError) as e:
        SamplingParams(**kwargs)
    assert needle in str(e.value)


def test_greedy_sampler_with_a_frequency_penalty_moves_off_a_repeated_token():
    logits = torch.tensor([0.0, 3.0, 2.5, 1.0])
    plain = Sampler(SamplingParams(temperature=0))
    penalised = Sampler(SamplingParams(temperature=0, frequency_penalty=1.0, logprobs=2))
    assert [plain.sample(logits) for _ in range(3)] == [1, 1, 1]
    assert [penalised.sample(logits) for _ in range(3)] == [1, 2, 1]  # 3-1 < 2.5; then 2.5-1 < 3-1
    # logprobs are the model's, before the penalty: the same row every time
    want = torch.log_softmax(logits, -1).tolist()
    assert [r.logprob for r in penalised.logprobs] == pytest.approx([want[1], want[2], want[1]])
    assert penalised.logprobs[1].top == ((1, pytest.approx(want[1])), (2, pytest.approx(want[2])))


@pytest.fixture(scope="module")
def engine():
    e = Engine.open(DEMO, spec="mtp")  # the MTP layers loaded: each request picks its mode
    yield e
    e.close()


def test_logprobs_are_log_softmax_of_engine_logits(engine):
    ids = engine.encode("def fib(n):")
    out = engine.generate(ids, max_new_tokens=10, temperature=0, logprobs=4, spec="off")
    logp = torch.log_softmax(engine.logits(ids + out.token_ids), dim=-1)[len(ids) - 1:]
    events = list(engine.stream(ids, max_new_tokens=10, temperature=0, logprobs=4, spec="off"))
    records = events[-1].logprobs
    assert [e.logprob for e in events[:-1]] == records and len(records) == len(out.token_ids)
    assert [r.logprob for r in out.logprobs] == pytest.approx([r.logprob for r in records], abs=1e-4)
    for i, (token, r) in enumerate(zip(out.token_ids, records)):
        assert r.token_id == token and r.logprob == pytest.approx(float(logp[i, token]), abs=1e-4)
        top = torch.topk(logp[i], 4)
        assert [t for t, _ in r.top] == top.indices.tolist()
        assert [v for _, v in r.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert engine.generate(ids, max_new_tokens=3, temperature=0).stats.get("logprobs") is None


def test_logit_bias_outside_the_vocabulary_is_refused_before_generating(engine):
    with pytest.raises(ConfigError, match=r"logit_bias: token id 5000 is outside the vocabulary \[0, 2048\)"):
        engine.stream("x", max_new_tokens=2, logit_bias={5000: 1.0})


@pytest.mark.parametrize("spec", ["ngram", "mtp"])
def test_speculation_keeps_penalties_bias_and_logprobs(engine, spec):
    """Each draft-tree row is penalised by the tokens along its own path: the greedy answer (and its logprobs) equal
    plain decoding's, and some drafts were accepted (rows past the first were used). On this prompt a stepper that
    penalised every row by the tokens before the root only (not its path) answers differently with both drafters."""
    ids = engine.encode("Hello")
    sampling = dict(max_new_tokens=32, temperature=0, frequency_penalty=0.8, presence_penalty=0.4, logprobs=1)
    plain = engine.stream(ids, spec="off", **sampling)
    fast = engine.stream(ids, spec=spec, spec_depth=3, spec_width=2, **sampling)
    plain, fast = [e for e in plain][-1], [e for e in fast][-1]
    assert fast.token_ids == plain.token_ids
    assert plain.token_ids != engine.generate(ids, max_new_tokens=32, temperature=0, spec="off").token_ids
    assert fast.stats["accepted_tokens"] > 0
    assert [r.logprob for r in fast.logprobs] == pytest.approx([r.logprob for r in plain.logprobs], abs=1e-4)
    assert all(math.isfinite(r.logprob) for r in fast.logprobs)
    # a bias (the same on every row) that moves the greedy answer
    first = plain.token_ids[0]
    biased = dict(max_new_tokens=16, temperature=0, logit_bias={first: -100})
    want = engine.generate(ids, spec="off", **biased).token_ids
    assert want[0] != first and engine.generate(ids, spec=spec, spec_depth=3, spec_width=2, **biased).token_ids == want
