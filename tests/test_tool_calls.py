"""Tool calls through `offload-engine serve` on the demo model with the official openai client: "required" and a named
tool_choice give calls whose arguments validate (jsonschema) against the tool's parameters, greedy and sampled;
streamed delta.tool_calls reassemble into the whole answer's calls; an agent loop sends tool results back and the
conversation goes on through the chat template; "auto" parses a call the model wrote; "none" offers no tools.
The parser reads each supported syntax (Hermes/Qwen3, DeepSeek-V3 and V3.1, Kimi K2, Llama 3 JSON), its markers as
special tokens too, and each syntax's forcing grammar only admits valid calls. Bad tool requests are a 400 naming
the field, and the server keeps serving."""
from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

try:
    import httpx2 as httpx  # the openai client's HTTP library where it is httpx's successor
except ImportError:
    import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
jsonschema = pytest.importorskip("jsonschema")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from offload_engine.api import Engine  # noqa: E402
from offload_engine.generate.decoder import FinishEvent  # noqa: E402
from offload_engine.generate.grammar import Grammar, GrammarMatcher  # noqa: E402
from offload_engine.generate.tool_calls import SYNTAXES, CallText, call_grammar, detect, literal, parse  # noqa: E402
from offload_engine.generate.tool_parsed import Parsed  # noqa: E402
from offload_engine.server import tools as server_tools  # noqa: E402
from offload_engine.server.protocol import ApiError, ChatRequest  # noqa: E402
from offload_engine.tokenizer import Tokenizer  # noqa: E402
from tests.serving import base, client  # noqa: E402,F401 (the server fixtures)

DEMO = Path(__file__).resolve().parents[1] / "offload_engine" / "data" / "demo-model"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                        "b": {"type": "integer", "minimum": -999, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MSGS = [{"role": "user", "content": "What is the weather in Paris? Add 2 and 3 too."}]
SAMPLING = [{"temperature": 0}] + [{"temperature": 0.8, "seed": s} for s in range(3)]


@pytest.fixture(scope="module")
def engine():
    e = Engine.open(DEMO)
    yield e
    e.close()


def valid_call(call, names=tuple(SCHEMAS)) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


# ---------------------------------------------------------------------------------------------- through the server

@pytest.mark.parametrize("choice", ["required", "get_weather", "add"])
def test_forced_calls_validate_greedy_and_sampled(client, choice):
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    for sampling in SAMPLING:
        r = client.chat.completions.create(model="demo-model", messages=MSGS, tools=TOOLS, tool_choice=tool_choice,
                                           parallel_tool_calls=False, max_tokens=200, **sampling)
        choice0 = r.choices[0]
        assert choice0.finish_reason == "tool_calls" and choice0.message.content is None, sampling
        [call] = choice0.message.tool_calls
        valid_call(call, tuple(SCHEMAS) if choice == "required" else (choice,))
        assert r.model_extra["offload_engine"]["grammar"] == "lark"


def test_parallel_calls_each_validate(client):
    for sampling in SAMPLING[:2]:
        r = client.chat.completions.create(model="demo-model", messages=MSGS, tools=TOOLS, tool_choice="required",
                                           max_tokens=150, **sampling)
        calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert calls and reason in ("tool_calls", "length")
        for call in calls[:-1] if reason == "length" else calls:  # max_tokens may cut the last one
            valid_call(call)


def reassemble(chunks) -> tuple[list[tuple[str, str, str]], str, str]:
    """(id, name, arguments) per call index, the content and the finish_reason of a stream of chunks."""
    calls: dict[int, list[str]] = {}
    content, reason = "", None
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:  # the first delta of a call: its id, type and name
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
            else:
                assert d.function.name is None
                calls[d.index][2] += d.function.arguments
        reason = c.choices[0].finish_reason or reason
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)], content, reason


def test_streamed_deltas_reassemble_to_the_whole_answer(client):
    for extra in ({"tool_choice": "required", "temperature": 0},
                  {"tool_choice": "required", "temperature": 0.8, "seed": 4, "parallel_tool_calls": False},
                  {"tool_choice": {"type": "function", "function": {"name": "add"}}, "temperature": 0.8, "seed": 5}):
        args = dict(model="demo-model", messages=MSGS, tools=TOOLS, max_tokens=150, **extra)
        whole = client.chat.completions.create(**args)
        calls, content, reason = reassemble(client.chat.completions.create(stream=True, **args))
        want = whole.choices[0].message.tool_calls
        assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in want]
        assert all(i.startswith("call_") for i, _, _ in calls) and len({i for i, _, _ in calls}) == len(calls)
        assert reason == whole.choices[0].finish_reason and content == ""


def run_tool(name: str, arguments: dict) -> str:
    if name == "add":
        return json.dumps({"sum": arguments["a"] + arguments["b"]})
    return json.dumps({"city": arguments["city"], "forecast": ["sunny"] * arguments["days"]})


def test_agent_loop_sends_results_back_and_the_conversation_goes_on(client, engine):
    """Two rounds of call -> run the tool -> tool message, then a plain answer: each request's prompt is the
    template's rendering of the whole history (tool calls and results included), and the history's prefix is
    reused from the previous turn."""
    history = list(MSGS)
    for round_, choice in enumerate(("required", {"type": "function", "function": {"name": "add"}})):
        r = client.chat.completions.create(model="demo-model", messages=history, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=200, temperature=0.7, seed=round_)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        history.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            history.append({"role": "tool", "tool_call_id": call.id,
                            "content": run_tool(call.function.name, valid_call(call))})
        if round_:
            assert r.usage.prompt_tokens_details.cached_tokens > 0  # the previous turn's cache, reused
    r = client.chat.completions.create(model="demo-model", messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
    rendered = [{k: v for k, v in m.items() if k != "refusal"} for m in history]
    ids = engine.tokenizer.encode_chat(rendered)  # "none": no tools offered, the history rendered as it is
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == engine.generate(ids, max_new_tokens=12, temperature=0).text
    text = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.count("<tool_call>") == text.count("<tool_response>") >= 2 and "# Tools" not in text


def test_auto_answers_in_text_or_parses_the_models_call(client, engine):
    # the demo model writes Python, not calls: auto answers its text, rendered with the tools offered
    r = client.chat.completions.create(model="demo-model", messages=MSGS, tools=TOOLS, max_tokens=16, temperature=0)
    ids = engine.tokenizer.encode_chat(MSGS, tools=TOOLS)
    assert r.usage.prompt_tokens == len(ids) and "# Tools" in engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == engine.generate(ids, max_new_tokens=16, temperature=0).text
    _, content, reason = reassemble(client.chat.completions.create(
        model="demo-model", messages=MSGS, tools=TOOLS, max_tokens=16, temperature=0, stream=True))
    assert (content, reason) == (r.choices[0].message.content, r.choices[0].finish_reason)
    # a call the model wrote (under the forcing grammar), read back by auto's parser from its tokens
    body = {"model": "demo-model", "messages": MSGS, "tools": TOOLS}
    one = {**body, "tool_choice": "required", "parallel_tool_calls": False}
    forced = server_tools.plan(ChatRequest.model_validate(one), engine.tokenizer)
    auto = server_tools.plan(ChatRequest.model_validate(body), engine.tokenizer)
    assert auto.grammar is None and auto.choice == "auto"
    out = engine.generate(ids, max_new_tokens=200, temperature=0.8, seed=9, grammar=forced.grammar)
    message, reason = auto.message(FinishEvent(out.finish_reason, out.token_ids, out.text, len(ids), 0.0, 0.0))
    assert reason == "tool_calls" and message["content"] is None and message["tool_calls"]
    for call in message["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert out.text.startswith("<tool_call>\n{\"name\": ")


def test_tool_choice_none_offers_no_tools(client, engine):
    r = client.chat.completions.create(model="demo-model", messages=MSGS, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    ids = engine.tokenizer.encode_chat(MSGS)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == engine.generate(ids, max_new_tokens=8, temperature=0).text


def deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def fn(name: str = "f", parameters: object = None, **extra) -> dict:
    out: dict = {"name": name, **extra}
    if parameters is not None:
        out["parameters"] = parameters
    return {"type": "function", "function": out}


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD = [  # (extra body fields, the param named)
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [5]}, "tools.0"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [fn("bad name!")]}, "tools.0.function.name"),
    ({"tools": [fn(), fn("g"), fn("f")]}, "tools.2.function.name"),
    ({"tools": [fn(x=1)]}, "tools.0.function.x"),
    ({"tools": [{**fn(), "extra": 1}]}, "tools.0.extra"),
    ({"tools": [fn(parameters="a string")]}, "tools.0.function.parameters"),
    ({"tools": [fn(parameters={"type": "wat"})]}, "tools.0.function.parameters"),
    ({"tools": [fn(parameters={"type": "object", "properties": 5})]}, "tools.0.function.parameters"),
    ({"tools": [fn(parameters={"type": "string"})]}, "tools.0.function.parameters"),
    ({"tools": [fn(parameters={"type": "object", "required": "a"})]}, "tools.0.function.parameters"),
    ({"tools": [fn(parameters=deep(40))]}, "tools.0.function.parameters"),
    ({"tools": [fn(parameters={"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 60}
                                                                for i in range(1000)}})]},
     "tools.0.function.parameters"),
    ({"tools": [fn(parameters={"$ref": "#"})]}, "tools.0.function.parameters"),
    ({"tools": [fn(parameters={"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}})]},
     "tools.0.function.parameters"),
    ({"tools": [fn(parameters={"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}},
                               "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}})]},
     "tools.0.function.parameters"),
    ({"tools": [fn(strict="yes")]}, "tools.0.function.strict"),
    ({"tools": [fn()] * 129}, "tools"),
    ({"tools": [fn()], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"tools": [fn()], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [fn()], "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"tools": [fn()], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [fn()], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]},
                   {"role": "tool", "content": "42"}]}, "messages.2.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_2", "content": "42"}]}, "messages.2.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "messages.0.tool_calls.0"),
    ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages.0.tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


def test_bad_tool_requests_are_400_naming_the_field(base):
    for extra, param in BAD:
        body = {"messages": MSGS, "max_tokens": 2, **extra}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, (param, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["message"].startswith(param + ":"), (param, error)
        assert "Traceback" not in error["message"] and len(error["message"]) < 600
    assert httpx.get(base + "/health").status_code == 200
    ok = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "tools": TOOLS,
                                                          "tool_choice": "required"}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_templates_without_a_known_syntax_are_refused_by_name():
    body = ChatRequest.model_validate({"messages": MSGS, "tools": TOOLS})
    for template, why in (("{{ messages[0]['content'] }}", "no tool-call syntax"),
                          ("<tool_call>\n<function={{ name }}>", "no tool-call syntax")):  # Qwen3-Coder's XML
        assert detect(template) is None
        with pytest.raises(ApiError) as e:
            server_tools.plan(body, SimpleNamespace(chat_template=template))
        assert e.value.param == "tools" and why in e.value.message
    none = ChatRequest.model_validate({"messages": MSGS, "tools": TOOLS, "tool_choice": "none"})
    assert server_tools.plan(none, SimpleNamespace(chat_template="{{ x }}")) is None  # nothing offered


def test_demo_template_renders_tools_as_transformers_does(engine):
    """The demo model's template (ChatML + a Qwen3-style tools section) renders a tool conversation as transformers
    renders it, and a plain chat exactly as ChatML did."""
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(DEMO / "tokenizer.json"))
    ref.chat_template = engine.tokenizer.chat_template
    body = ChatRequest.model_validate({"messages": [
        {"role": "system", "content": "S"}, *MSGS, {"role": "assistant", "content": None, "tool_calls": [
            CALL, {**CALL, "id": "call_2", "function": {"name": "g", "arguments": '{"x": [1]}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"}, {"role": "tool", "tool_call_id": "call_2",
                                                                     "content": "2"}]})
    messages = server_tools.template_messages(body, engine.tokenizer)
    ours = engine.tokenizer.apply_chat_template(messages, tools=TOOLS)
    assert ours == ref.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '</tools>' in ours and '<tool_call>\n{"name": "g", "arguments": {"x": [1]}}\n</tool_call>' in ours
    assert "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>" \
        in ours
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}, {"role": "assistant",
                                                                                    "content": "a"}]
    chatml = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in plain)
    assert engine.tokenizer.apply_chat_template(plain) == chatml + "<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------- the syntaxes

KNOWN = {  # each syntax's calls as its models write them (vLLM's and SGLang's parsers read the same shapes)
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
              '"celsius", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
              '</tool_call>',
    "deepseek_v3": 'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                   '{"city": "Paris", "unit": "celsius", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>'
                   'function<｜tool▁sep｜>add\n```json\n{"a": 2, "b": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseek_v31": 'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", '
                    '"unit": "celsius", "days": 2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>'
                    '{"a": 2, "b": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "kimi_k2": 'Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
               '<|tool_call_argument_begin|>{"city": "Paris", "unit": "celsius", "days": 2}<|tool_call_end|>'
               '<|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>{"a": 2, "b": 3}<|tool_call_end|>'
               '<|tool_calls_section_end|>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius", "days": 2}}; '
                   '{"name": "add", "parameters": {"a": 2, "b": 3}}',
}
WANT = [("get_weather", '{"city": "Paris", "unit": "celsius", "days": 2}'), ("add", '{"a": 2, "b": 3}')]
TEMPLATES = {"hermes": "{{ '<tool_call>' }}", "deepseek_v3": "<｜tool▁calls▁begin｜>```json",
             "deepseek_v31": "<｜tool▁calls▁begin｜>", "kimi_k2": "<|tool_calls_section_begin|>",
             "llama3_json": '<|start_header_id|>{"name": "x", "parameters": '}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_parser_reads_each_syntax_whole_and_incrementally(name):
    syntax, text = SYNTAXES[name], KNOWN[name]
    assert detect(TEMPLATES[name]) is syntax
    whole = parse(syntax, text)
    assert [(c.name, c.arguments) for c in whole.calls] == WANT and all(c.closed for c in whole.calls)
    assert whole.content == ("" if name == "llama3_json" else "Let me check.")
    if name == "kimi_k2":
        assert [c.native_id for c in whole.calls] == ["functions.get_weather:0", "functions.add:1"]
    before = parse(syntax, "", final=False)
    for n in range(1, len(text) + 1):  # every prefix: what can no longer change only grows, towards the whole
        now = parse(syntax, text[:n], final=False)
        assert now.content.startswith(before.content) and whole.content.startswith(now.content), n
        assert len(before.calls) <= len(now.calls) <= len(whole.calls), n
        for old, new, end in zip(before.calls, now.calls, whole.calls):
            assert new.name == end.name and new.arguments.startswith(old.arguments), n
            assert end.arguments.startswith(new.arguments), n
        before = now
    # not calls: plain text, a marker with no call after it, JSON that names no function
    assert parse(syntax, "def f(x):\n    return x\n").calls == []
    assert parse(syntax, "no call here  ").content == "no call here  "
    broken = '{"a": 1}' if name == "llama3_json" else "Hi " + (syntax.section_begin or syntax.call_begin) + " oops"
    assert parse(syntax, broken) == Parsed(broken, [])


def special_tokenizer(markers: tuple[str, ...]) -> Tokenizer:
    """The demo tokenizer with `markers` added as special tokens (as DeepSeek's and Kimi's vocabularies have them)."""
    backend = HFTokenizer.from_file(str(DEMO / "tokenizer.json"))
    backend.add_special_tokens(list(markers))
    return Tokenizer.from_backend(backend, eos_token="<|endoftext|>", eos_token_ids=[0], chat_template="")


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_special_markers_survive_decoding_and_grammars_admit_only_valid_calls(name):
    syntax = SYNTAXES[name]
    tok = special_tokenizer(syntax.markers)
    ids = tok.encode(KNOWN[name] + "<|endoftext|>", add_special_tokens=False)
    assert ids[-1] == 0 and tok.decode(ids) != KNOWN[name] + "<|endoftext|>"  # decode drops special tokens
    text = CallText(tok, syntax)
    for token_id in ids:
        text.push(token_id)
    text.finish()
    assert text.text == KNOWN[name] and [(c.name, c.arguments) for c in parse(syntax, text.text).calls] == WANT
    small = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {
        "type": "integer", "minimum": 1, "maximum": 7}, "ok": {"type": "boolean"}},
        "required": ["unit", "days", "ok"], "additionalProperties": False}
    schemas = {"get_weather": small, "add": ADD}
    for parallel in (False, True):
        lark = call_grammar(syntax, list(schemas.items()), parallel, lambda s: literal(tok, s))
        assert ("<[" in lark) == (name != "llama3_json")  # special markers as token ids
        for seed in range(3):  # random walks through what the grammar allows
            matcher, rng, out = GrammarMatcher(Grammar.lark(lark, name="tool_choice"), tok, tok.vocab_size), \
                random.Random(seed), []
            for _ in range(400):
                allowed = matcher.allowed().nonzero().flatten().tolist()
                pick = 0 if 0 in allowed and rng.random() < 0.5 else rng.choice(allowed)
                matcher.advance([pick])
                out.append(pick)
                if pick == 0:
                    break
            assert out[-1] == 0, "the walk did not end"
            text = CallText(tok, syntax)
            for token_id in out:
                text.push(token_id)
            text.finish()
            calls = parse(syntax, text.text).calls
            assert calls and parse(syntax, text.text).content == "" and all(c.closed for c in calls), text.text
            assert len(calls) == 1 or (parallel and syntax.parallel)
            for c in calls:
                jsonschema.validate(json.loads(c.arguments), schemas[c.name])
