"""A request is checked once: Engine.prepare refuses each bad argument by name and returns a PreparedRequest that
stream / generate (and the server's worker) run as is, any number of times; a draft model's vocabulary is
compared with the target's once, when the engine opens."""
from __future__ import annotations

from pathlib import Path

try:
    import httpx2 as httpx  # the openai client's HTTP library where it is httpx's successor
except ImportError:
    import httpx
import pytest

from offload_engine import api
from offload_engine.api import Engine
from offload_engine.errors import ConfigError
from offload_engine.generate.request import PreparedRequest, RequestError
from offload_engine.server.app import ServerSettings
from offload_engine.speculative.drafters import draft_model
from tests.serving import serving

DEMO = Path(__file__).resolve().parents[1] / "offload_engine" / "data" / "demo-model"
PROMPT = "def fibonacci(n):"
CONTEXT = 96
SAMPLED = dict(max_new_tokens=12, temperature=0.8, top_p=0.95, seed=3)


@pytest.fixture(scope="module")
def engine():
    with Engine.open(DEMO, max_context=CONTEXT) as e:
        yield e


class Spy:
    """Counts the calls of a function and passes them on to it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def bad_cases(vocab: int) -> list[tuple[object, dict, str, str | None]]:
    """(prompt, arguments, the message it must match, RequestError.field or None for a sampling value)"""
    return [
        (PROMPT, {"temperature": -1}, "temperature must be a finite number >= 0", None),
        (PROMPT, {"top_p": 0}, r"top_p must be in \(0, 1\]", None),
        (PROMPT, {"top_k": -1}, "top_k must be an integer >= 0", None),
        (PROMPT, {"min_p": 1.5}, r"min_p must be in \[0, 1\]", None),
        (PROMPT, {"seed": "a"}, "seed must be an integer", None),
        (PROMPT, {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1", None),
        (PROMPT, {"stop": [""]}, "stop strings must be non-empty", None),
        (PROMPT, {"logprobs": 99}, "logprobs must be None or an integer from 0 to 20", None),
        (PROMPT, {"presence_penalty": 3}, r"presence_penalty must be in \[-2, 2\]", None),
        (PROMPT, {"logit_bias": {vocab + 5: 1.0}}, f"logit_bias: token id {vocab + 5} is outside the vocabulary",
         None),
        (PROMPT, {"grammar": "start: ("}, "grammar: the lark grammar does not compile", None),
        ([], {}, "prompt is empty", "prompt"),
        ([1, vocab], {}, rf"prompt token ids must be in \[0, {vocab}\), got \[{vocab}\]", "prompt"),
        (PROMPT, {"spec": "warp"}, "^spec must be one of", "spec"),
        (PROMPT, {"spec": "ngram", "spec_depth": 0}, "^spec_depth must be an integer from 1 to 8", "spec_depth"),
        (PROMPT, {"spec": "ngram", "spec_width": 9}, "^spec_width must be an integer", "spec_width"),
        (PROMPT, {"spec": "draft"}, "^spec 'draft': this engine was opened without a draft model", "spec"),
        (PROMPT, {"max_new_tokens": CONTEXT}, rf"exceed the context this engine reserved in its budget "
                                              rf"\({CONTEXT} tokens\)", "context"),
    ]


def test_prepare_refuses_each_bad_argument_by_name(engine):
    for prompt, arguments, message, field in bad_cases(engine.model.vocab_size):
        with pytest.raises(ConfigError, match=message) as e:
            engine.prepare(prompt, **arguments)
        if field is not None:
            assert isinstance(e.value, RequestError) and e.value.field == field, (arguments, e.value)
            assert field == "context" or "--" not in str(e.value), e.value  # the API's names, not the CLI's flags
        with pytest.raises(ConfigError, match=message):  # stream() refuses it at the call, as before
            engine.stream(prompt, **arguments)
    assert engine.generate(PROMPT, max_new_tokens=2).token_ids  # still usable


def test_a_prepared_request_runs_twice_as_generate_does(engine):
    want = engine.generate(PROMPT, **SAMPLED).token_ids
    request = engine.prepare(PROMPT, **SAMPLED)
    assert isinstance(request, PreparedRequest) and request.spec == engine.speculative.mode
    assert list(request.ids) == engine.encode(PROMPT) and request.params.seed == 3
    with pytest.raises(Exception):  # frozen: what was checked cannot change
        request.ids = (1,)
    assert engine.generate(request).token_ids == want
    events = list(engine.stream(request))
    assert events[-1].token_ids == want and [e.token_id for e in events[:-1]] == want
    spec = engine.prepare(PROMPT, spec="ngram", spec_depth=2, spec_width=1, **SAMPLED)
    assert (spec.spec, spec.spec_depth, spec.spec_width) == ("ngram", 2, 1)
    assert engine.generate(spec).token_ids == engine.generate(spec).token_ids  # seeded: the same, twice


def test_a_prepared_grammar_runs_twice(engine):
    """A grammar's state follows one sequence: each run of the request gets its own."""
    arguments = dict(max_new_tokens=20, grammar={"type": "object", "properties": {"a": {"type": "integer"}},
                                                 "required": ["a"]})
    want = engine.generate(PROMPT, **arguments)
    request = engine.prepare(PROMPT, **arguments)
    first, second = engine.generate(request), engine.generate(request)
    assert first.token_ids == second.token_ids == want.token_ids and want.text.startswith("{")


def test_stream_of_a_prepared_request_checks_nothing_again(engine, monkeypatch):
    spies = {name: Spy(getattr(api, name)) for name in ("check_prompt", "spec_problem", "check_runnable",
                                                         "check_context", "SamplingParams")}
    for name, spy in spies.items():
        monkeypatch.setattr(api, name, spy)
    request = engine.prepare(PROMPT, spec="ngram", max_new_tokens=4)
    assert {name: spy.calls for name, spy in spies.items()} == dict.fromkeys(spies, 1)
    engine.generate(request)
    list(engine.stream(request))
    assert {name: spy.calls for name, spy in spies.items()} == dict.fromkeys(spies, 1)
    engine.generate(PROMPT, spec="ngram", max_new_tokens=4)  # arguments, not a request: prepared (checked) here
    assert {name: spy.calls for name, spy in spies.items()} == dict.fromkeys(spies, 2)


def test_a_prepared_request_is_run_as_it_is_by_its_own_engine(engine):
    request = engine.prepare(PROMPT, max_new_tokens=2)
    with pytest.raises(TypeError, match="pass it alone"):
        engine.generate(request, max_new_tokens=3)
    with Engine.open(DEMO, max_context=CONTEXT) as other:
        with pytest.raises(ConfigError, match="prepared by another engine"):
            other.generate(request)
        closed = other.prepare(PROMPT, max_new_tokens=2)
    with pytest.raises(Exception, match="closed"):
        other.generate(closed)


def test_the_vocabulary_of_a_draft_model_is_checked_once_at_open(monkeypatch):
    spy = Spy(draft_model.check_same_vocabulary)
    monkeypatch.setattr(draft_model, "check_same_vocabulary", spy)
    monkeypatch.setattr("offload_engine.assemble.check_same_vocabulary", spy)
    with Engine.open(DEMO, max_context=CONTEXT, spec="draft", draft_model=DEMO, spec_depth=2, spec_width=1) as e:
        assert spy.calls == 1
        plain = e.generate(PROMPT, max_new_tokens=8, spec="off").token_ids
        for _ in range(2):
            out = e.generate(PROMPT, max_new_tokens=8)
            assert out.token_ids == plain and out.stats["spec"] == "draft"
        assert spy.calls == 1


def test_the_server_prepares_each_request_once(engine, monkeypatch):
    """The handler prepares (a refusal is a 400 before the queue); the worker runs the request unchecked."""
    spy = Spy(api.check_prompt)
    monkeypatch.setattr(api, "check_prompt", spy)
    with serving(engine, ServerSettings(model_id="demo-model")) as url:
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and spy.calls == 1, r.text
        assert r.json()["choices"][0]["text"] == engine.generate(PROMPT, max_new_tokens=6).text
        refused = [({"spec": "draft"}, "spec", None), ({"prompt": [1, 10 ** 6]}, "prompt", None),
                   ({"max_tokens": CONTEXT}, "max_tokens", "context_length_exceeded"),
                   ({"prompt": [1] * (CONTEXT + 1)}, "prompt", "context_length_exceeded")]
        for extra, param, code in refused:
            r = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert r.json()["error"]["code"] == code, r.text
            assert "--" not in r.json()["error"]["message"], r.text  # the request's field, not the CLI's flag


def test_prepare_refuses_self_drafting_on_a_dense_model(checkpoint_factory):
    """spec "self" drafts with the target's resident routed experts: a dense model is refused before the queue,
    for the reason build_drafters gives (speculative/drafters/factory.self_draft_refusal)."""
    with Engine.open(checkpoint_factory("llama"), max_context=CONTEXT) as dense:
        with pytest.raises(RequestError, match="^spec 'self': .*no routed experts") as e:
            dense.prepare([1, 2, 3], spec="self", max_new_tokens=2)
        assert e.value.field == "spec"
        with serving(dense, ServerSettings(model_id="dense")) as url:  # a 400 naming the field, before the queue
            r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "spec": "self"},
                           timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "spec", r.text
            assert "no routed experts" in r.json()["error"]["message"], r.text
        assert dense.generate([1, 2, 3], max_new_tokens=2).token_ids  # still usable
