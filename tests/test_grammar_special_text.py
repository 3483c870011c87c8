"""A grammar whose text equals a special token's ("<|im_end|>", "<tool_call>", the EOS "<|endoftext|>"): llguidance's
mask offers the special token where the grammar forces that text, then refuses it. The matcher writes the text as
plain tokens instead, so such a request completes with valid JSON (the demo model, greedy and sampled, through the
engine and the server) and never fails mid-stream."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")

from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from offload_engine.api import Engine  # noqa: E402
from offload_engine.generate.grammar import Grammar, GrammarMatcher  # noqa: E402
from offload_engine.server.app import ServerSettings  # noqa: E402
from offload_engine.tokenizer import Tokenizer  # noqa: E402
from tests.serving import serving  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "offload_engine" / "data" / "demo-model"
SCHEMA = {"type": "object", "properties": {
    "end": {"const": "<|im_end|>"}, "tag": {"enum": ["<|im_start|>x", "<|endoftext|>"]},
    "<|im_end|>": {"type": "boolean"}},
    "required": ["end", "tag", "<|im_end|>"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine():
    e = Engine.open(DEMO)
    yield e
    e.close()


def test_special_token_text_in_a_schema_completes_valid(engine):
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "JSON please"}])
    for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 1}, {"temperature": 0.9, "seed": 2}):
        out = engine.generate(ids, max_new_tokens=80, grammar=Grammar.json_schema(SCHEMA), **sampling)
        assert out.finish_reason == "eos", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert not set(out.token_ids[:-1]) & {0, 1, 2}  # the text as plain tokens, never the special ones


def test_named_special_tokens_still_pass_and_added_markers_are_text():
    """A grammar that names a special token by id (<[id]>, as the tool-call grammars do) still gets it; an added
    special token's text inside a JSON string ("<tool_call>") is written as plain tokens."""
    backend = HFTokenizer.from_file(str(DEMO / "tokenizer.json"))
    backend.add_special_tokens(["<tool_call>"])
    tok = Tokenizer.from_backend(backend, eos_token="<|endoftext|>", eos_token_ids=[0], chat_template="")
    marker = tok.token_to_id("<tool_call>")
    named = GrammarMatcher(Grammar.lark(f'start: <[{marker}]> "<tool_call>"'), tok, tok.vocab_size)
    assert named.allowed().nonzero().flatten().tolist() == [marker]
    named.advance([marker])
    schema = {"type": "object", "properties": {"t": {"const": "<tool_call>"}}, "required": ["t"],
              "additionalProperties": False}
    matcher = GrammarMatcher(Grammar.json_schema(schema), tok, tok.vocab_size)
    out: list[int] = []
    for _ in range(40):
        if matcher.complete:
            break
        allowed = matcher.allowed()
        assert not allowed[marker]
        pick = int(allowed.nonzero()[0])
        matcher.advance([pick])
        out.append(pick)
    assert json.loads(tok.decode(out)) == {"t": "<tool_call>"}


def test_server_streams_such_a_schema_to_the_end(engine):
    openai = pytest.importorskip("openai")
    with serving(engine, ServerSettings(model_id="demo-model")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
        chunks = list(client.chat.completions.create(
            model="demo-model", messages=[{"role": "user", "content": "JSON"}], response_format=fmt,
            max_tokens=80, temperature=0, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
