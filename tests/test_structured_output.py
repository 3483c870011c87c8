"""Structured output on the demo model: response_format json_object / json_schema through the openai client (greedy
and sampled, streamed too, the server's engine speculating with MTP), the `grammar` extension,
Engine.generate(grammar=...) with and without speculative decoding, `run --grammar / --json-schema`. Every answer
parses and validates against its schema with jsonschema (the reference validator); the token mask is checked against
a brute-force reading of the vocabulary; bad grammars are a 400 naming the field."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

try:
    import httpx2 as httpx  # the openai client's HTTP library where it is httpx's successor
except ImportError:
    import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
jsonschema = pytest.importorskip("jsonschema")

from offload_engine.api import Engine  # noqa: E402
from offload_engine.errors import ConfigError  # noqa: E402
from offload_engine.generate.grammar import Grammar, GrammarMatcher  # noqa: E402
from offload_engine.generate.sampling import Sampler, SamplingParams  # noqa: E402
from tests.serving import base  # noqa: E402,F401 (the server fixtures)

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "offload_engine" / "data" / "demo-model"
MSGS = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 500  # room for every answer below to close (the longest seen: ~360 tokens)

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}, "kind": {"enum": ["cat", "dog"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "age", "tags", "kind", "address"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "number"}, {"type": "boolean"}, {"type": "null"}]},
        "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4}},
        "required": ["value", "items"], "additionalProperties": False},
    "list": {"type": "array", "minItems": 2, "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"], "additionalProperties": False}},
}
SAMPLING = [{"temperature": 0}] + [{"temperature": 0.7, "seed": s} for s in range(3)]


@pytest.fixture(scope="module")
def engine():
    e = Engine.open(DEMO, spec="mtp")  # speculation on: each draft-tree row is masked along its own path
    yield e
    e.close()


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def valid(text: str, schema: dict) -> object:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_answers_validate_greedy_and_sampled(client, name):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    for sampling in SAMPLING:
        r = client.chat.completions.create(model="demo-model", messages=MSGS, max_tokens=MAX_TOKENS,
                                           response_format=fmt, **sampling)
        assert r.choices[0].finish_reason == "stop", sampling
        valid(r.choices[0].message.content, schema)
        stats = r.model_extra["offload_engine"]
        assert stats["spec"] == "mtp" and stats["grammar"] == "json_schema"
        if name == "person":  # properties come out in the schema's order
            assert list(json.loads(r.choices[0].message.content)) == list(schema["properties"])


def test_json_object_streamed_and_whole(client):
    fmt = {"type": "json_object"}
    for sampling in SAMPLING:
        r = client.chat.completions.create(model="demo-model", messages=MSGS, max_tokens=MAX_TOKENS,
                                           response_format=fmt, **sampling)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(valid(r.choices[0].message.content, {"type": "object"}), dict)
    stream = client.chat.completions.create(model="demo-model", messages=MSGS, max_tokens=MAX_TOKENS,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "p", "schema": SCHEMAS["person"]}},
                                            temperature=0.7, seed=11, stream=True)
    valid("".join(c.choices[0].delta.content or "" for c in stream if c.choices), SCHEMAS["person"])


def test_grammar_extension_on_both_endpoints(client):
    lark = 'start: "yes" | "no" | "maybe"'
    r = client.chat.completions.create(model="demo-model", messages=MSGS, max_tokens=10, temperature=0.7, seed=3,
                                       extra_body={"grammar": lark})
    assert r.choices[0].message.content in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="demo-model", prompt="x =", max_tokens=20, temperature=0,
                                  extra_body={"grammar": r'start: /[0-9]{1,4}/ ";"'})
    assert re.fullmatch(r"[0-9]{1,4};", r.choices[0].text)


def deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"grammar": "start: (("}, "grammar"),
    ({"grammar": "start: \"a\"", "response_format": {"type": "json_object"}}, "grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep(300)}}},
     "response_format.json_schema.schema"),
]


def test_bad_grammars_are_400_naming_the_field(base):
    for extra, param in BAD:
        r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["message"].startswith(param + ":"), error
    # deeper than the JSON parser goes: written by hand (the client's encoder would overflow first)
    n = 2000
    body = ('{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
            '"json_schema": {"name": "deepest", "schema": ' + '{"type": "object", "properties": {"a": ' * n
            + '{"type": "string"}' + '}}' * n + '}}}')
    r = httpx.post(base + "/v1/chat/completions", content=body.encode(), timeout=60)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}).status_code == 200


def test_engine_grammar_argument(engine):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = engine.generate("Data:", max_new_tokens=40, temperature=0, grammar=schema)
    assert out.finish_reason == "eos" and valid(out.text, schema)
    out = engine.generate("Answer:", max_new_tokens=8, temperature=0.7, seed=1, grammar='start: "on" | "off"')
    assert out.text in ("on", "off")
    out = engine.generate("Year:", max_new_tokens=8, temperature=0, grammar=Grammar.regex("19[0-9]{2}"))
    assert re.fullmatch("19[0-9]{2}", out.text)
    with pytest.raises(ConfigError, match="grammar: the sampler needs its GrammarMatcher"):
        Sampler(SamplingParams(grammar=schema))
    with pytest.raises(ConfigError, match="grammar must be a Grammar"):
        SamplingParams(grammar=5)


@pytest.mark.parametrize("spec", ["ngram", "mtp"])
def test_speculation_keeps_the_grammar(engine, spec):
    """Each draft-tree row is masked after its own path: greedy answers are token for token plain decoding's, with
    drafts accepted; sampled ones validate. (Masking every row like the root's makes the verifier accept tokens the
    grammar forbids: the run then fails.)"""
    ids = engine.tokenizer.encode_chat(MSGS)
    accepted = 0
    for name in ("person", "list"):
        plain = engine.generate(ids, max_new_tokens=MAX_TOKENS, temperature=0, grammar=SCHEMAS[name], spec="off")
        fast = engine.generate(ids, max_new_tokens=MAX_TOKENS, temperature=0, grammar=SCHEMAS[name], spec=spec,
                               spec_depth=3, spec_width=2)
        assert fast.token_ids == plain.token_ids and fast.stats["spec"] == spec
        accepted += fast.stats["accepted_tokens"]
        for seed in range(2):
            out = engine.generate(ids, max_new_tokens=MAX_TOKENS, temperature=0.7, seed=seed, grammar=SCHEMAS[name],
                                  spec=spec, spec_depth=3, spec_width=2)
            assert out.finish_reason == "eos"
            valid(out.text, SCHEMAS[name])
            accepted += out.stats["accepted_tokens"]
    assert accepted > 0


@pytest.mark.parametrize("kind", ["tokenizers", "tiktoken"])
def test_mask_allows_exactly_the_tokens_a_regex_admits(engine, tmp_path, kind):
    """The first mask of /[0-9]{3}/ against the vocabulary read one token at a time: a token is allowed iff its
    text is 1 to 3 digits (the demo model's byte-level BPE, and a tiktoken tokenizer: Kimi's layout)."""
    if kind == "tokenizers":
        tokenizer, vocab = engine.tokenizer, engine.model.vocab_size
    else:
        from test_tokenizer_tiktoken import _kimi_folder  # a trained tiktoken BPE in Kimi's folder layout

        from offload_engine.tokenizer import Tokenizer
        tokenizer = Tokenizer(_kimi_folder(tmp_path))
        vocab = tokenizer.vocab_size
    matcher = GrammarMatcher(Grammar.regex("[0-9]{3}"), tokenizer, vocab)
    allowed = set(matcher.allowed().nonzero().flatten().tolist())
    texts = {i: tokenizer.decode([i], skip_special_tokens=False) for i in range(vocab)}
    want = {i for i, t in texts.items() if re.fullmatch("[0-9]{1,3}", t)}
    assert allowed == want and want
    digit = min(i for i in want if len(texts[i]) == 1)
    matcher.advance([digit])
    assert not matcher.complete
    # a draft path's row: after "d" then "dd", only EOS (the three digits are complete)
    two = min(i for i in want if len(texts[i]) == 2)
    after = matcher.masks([(), (two,)])
    assert set(after[0].nonzero().flatten().tolist()) == {i for i in want if len(texts[i]) <= 2}
    assert set(after[1].nonzero().flatten().tolist()) == set(tokenizer.eos_token_ids)
    with pytest.raises(ConfigError, match="does not continue the grammar"):
        matcher.advance([digit, two])


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "offload_engine.cli", "run", "--quiet", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_run_json_schema_and_grammar(tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    r = cli("--prompt", "Status:", "--json-schema", str(path), "--json", "--max-new-tokens", "20")
    assert r.returncode == 0, r.stderr
    assert valid(json.loads(r.stdout)["text"], schema)
    r = cli("--prompt", "x", "--grammar", str(tmp_path / "missing.lark"))
    assert r.returncode == 2 and "--grammar" in r.stderr and "no such file" in r.stderr
