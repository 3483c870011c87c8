"""gpt-oss's harmony format (openai/harmony docs/format.md): known answers read back into content and a call (every
prefix, streamed deltas joining to the whole), the harmony markers kept as special tokens, the forcing grammar
admitting only valid calls, and the server's plan for a harmony template. openai-harmony (the reference) needs the
o200k vocabulary, which it downloads: its parser is compared where that vocabulary loads, and skipped otherwise."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

jsonschema = pytest.importorskip("jsonschema")

from offload_engine.generate import harmony  # noqa: E402
from offload_engine.generate.decoder import FinishEvent  # noqa: E402
from offload_engine.generate.grammar import Grammar, GrammarMatcher  # noqa: E402
from offload_engine.generate.tool_calls import SYNTAXES, CallText, detect, literal  # noqa: E402
from offload_engine.server import tools as server_tools  # noqa: E402
from offload_engine.server.protocol import ChatRequest  # noqa: E402
from tests.test_tool_calls import ADD, MSGS, TOOLS, special_tokenizer  # noqa: E402

SYNTAX = SYNTAXES["harmony"]
KNOWN = {  # (answer after the prompt's "<|start|>assistant", content, calls) as docs/format.md shows them
    "call": ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>'
             'commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}<|call|>',
             "", [("get_weather", '{"location":"San Francisco"}')]),
    "final": ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic.<|end|><|start|>assistant'
              '<|channel|>final<|message|>2 + 2 = 4.<|return|>', "2 + 2 = 4.", []),
    "preamble": ('<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>commentary<|message|>Will '
                 'start.<|end|><|start|>assistant<|channel|>commentary to=functions.generate_file<|constrain|>json'
                 '<|message|>{"path": "index.html"}<|call|>', "Will start.",
                 [("generate_file", '{"path": "index.html"}')]),
    "role_recipient": ('<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.add<|channel|>commentary '
                       'json<|message|>{"a": 2, "b": 3}', "", [("add", '{"a": 2, "b": 3}')]),  # <|call|> was the EOS
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_known_answers_whole_and_every_prefix(name):
    text, content, calls = KNOWN[name]
    whole = harmony.parse(text)
    assert whole.content == content and [(c.name, c.arguments) for c in whole.calls] == calls
    assert all(c.closed for c in whole.calls)
    before = harmony.parse("", final=False)
    for n in range(1, len(text) + 1):
        now = harmony.parse(text[:n], final=False)
        assert now.content.startswith(before.content) and content.startswith(now.content), n
        assert len(before.calls) <= len(now.calls) <= len(calls), n
        for old, new, end in zip(before.calls, now.calls, whole.calls):
            assert new.name == end.name and new.arguments.startswith(old.arguments), n
            assert end.arguments.startswith(new.arguments), n
        before = now
    assert harmony.parse("plain text, no harmony").content == "plain text, no harmony"


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_streamed_deltas_join_to_the_whole_answer(name):
    text, content, calls = KNOWN[name]
    tok = special_tokenizer(SYNTAX.markers)
    ids = tok.encode(text, add_special_tokens=False) + [0]
    plan = server_tools.ToolPlan(SYNTAX, TOOLS, "auto", None, True, tok)
    answer = server_tools.ToolAnswer(plan)
    deltas = [d for t in ids for d in answer.token(t)] + answer.finish()
    got_content = "".join(d.get("content", "") for d in deltas)
    got_calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            got_calls.setdefault(c["index"], [c["function"].get("name"), ""])[1] += c["function"]["arguments"]
    assert got_content == content and [tuple(v) for v in got_calls.values()] == calls
    message, reason = plan.message(FinishEvent("eos", ids, "", 0, 0.0, 0.0))
    assert reason == ("tool_calls" if calls else "stop") and (message["content"] or "") == content


def test_forcing_grammar_admits_only_valid_calls():
    tok = special_tokenizer(SYNTAX.markers)
    small = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"}},
             "required": ["unit", "ok"], "additionalProperties": False}
    schemas = {"get_weather": small, "add": ADD}
    for call_ends in (False, True):
        lark = harmony.call_grammar(list(schemas.items()), lambda s: literal(tok, s), call_ends)
        assert "<[" in lark  # the harmony markers as token ids
        end = tok.token_to_id(harmony.CALL)
        eos = [0, end] if call_ends else [0]
        tok2 = special_tokenizer(SYNTAX.markers)
        tok2.eos_token_ids = frozenset(eos)
        for seed in range(3):
            matcher, rng, out = GrammarMatcher(Grammar.lark(lark, name="tool_choice"), tok2, tok2.vocab_size), \
                random.Random(seed), []
            for _ in range(300):
                allowed = matcher.allowed().nonzero().flatten().tolist()
                stop = [t for t in eos if t in allowed]
                pick = stop[0] if stop and rng.random() < 0.5 else rng.choice(allowed)
                matcher.advance([pick])
                out.append(pick)
                if pick in eos:
                    break
            assert out[-1] in eos
            text = CallText(tok2, SYNTAX)
            for t in out:
                text.push(t)
            text.finish()
            [call] = harmony.parse(text.text).calls
            assert call.closed and harmony.parse(text.text).content == ""
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_server_plans_tools_for_a_harmony_template():
    template = "<|start|>{{ x }}<|channel|>commentary<|message|>{{ y }}<|call|>"
    assert detect(template) is SYNTAX
    tok = special_tokenizer(SYNTAX.markers)
    tok.chat_template = template
    body = ChatRequest.model_validate({"messages": MSGS, "tools": TOOLS, "tool_choice": "required"})
    plan = server_tools.plan(body, tok)
    assert plan.syntax is SYNTAX and plan.grammar is not None and "functions.add" in plan.grammar.source
    auto = server_tools.plan(ChatRequest.model_validate({"messages": MSGS, "tools": TOOLS}), tok)
    assert auto.grammar is None
    history = ChatRequest.model_validate({"messages": [*MSGS, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]})
    tok.chat_template = template + "tool_calls"
    messages = server_tools.template_messages(history, tok)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}  # the template applies tojson


def _reference_encoding():
    oh = pytest.importorskip("openai_harmony")
    try:
        return oh, oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:  # noqa: BLE001 - offline: the o200k vocabulary is downloaded on first use
        pytest.skip(f"openai-harmony cannot load its vocabulary here: {e}")


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_parser_agrees_with_openai_harmony(name):
    oh, enc = _reference_encoding()
    text, content, calls = KNOWN[name]
    ids = enc.encode(text, allowed_special="all")
    stream = oh.StreamableParser(enc, role=oh.Role.ASSISTANT)
    for t in ids:
        stream.process(t)
    messages = stream.messages + ([] if stream.state == oh.StreamState.EXPECT_START else [])
    ref_calls = [(m.recipient.split(".", 1)[1], m.content[0].text) for m in messages
                 if m.recipient and m.recipient.startswith("functions.")]
    ref_content = "".join(m.content[0].text for m in messages if not m.recipient and m.channel in ("final",
                                                                                                  "commentary"))
    ours = harmony.parse(text)
    assert [(c.name, c.arguments) for c in ours.calls] == ref_calls[:len(ours.calls)]
    assert ours.content == ref_content


def test_reference_rendering_of_tools(tmp_path):
    oh, enc = _reference_encoding()
    dev = oh.DeveloperContent.new().with_function_tools([oh.ToolDescription.new(
        t["function"]["name"], t["function"]["description"], parameters=t["function"]["parameters"]) for t in TOOLS])
    convo = oh.Conversation.from_messages([oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev),
                                           oh.Message.from_role_and_content(oh.Role.USER, MSGS[0]["content"])])
    text = enc.decode(enc.render_conversation_for_completion(convo, oh.Role.ASSISTANT))
    assert "namespace functions {" in text and text.endswith("<|start|>assistant")
