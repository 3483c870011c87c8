"""Every field of the official openai client's chat and completions requests, read from the installed package's
TypedDicts (a field added to the client shows up here unclassified and fails): each is honoured (checked against
the engine's own output) or refused with a 400 naming it. Also: logprobs against log_softmax of Engine.logits,
streamed logprobs, echo, cached_tokens from prefix reuse, errors counted by status on /metrics."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

try:
    import httpx2 as httpx  # the openai client's HTTP library where it is httpx's successor
except ImportError:
    import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from openai.types import completion_create_params as completion_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_params  # noqa: E402

from offload_engine.api import Engine  # noqa: E402
from offload_engine.server import fields as server_fields  # noqa: E402
from tests.serving import base, client  # noqa: E402,F401 (the server fixtures)

DEMO = Path(__file__).resolve().parents[1] / "offload_engine" / "data" / "demo-model"
MSGS = [{"role": "user", "content": "Write a function."}]
PROMPT = "def fib(n):"
N = 6  # tokens per answer: enough to see each field's effect


@pytest.fixture(scope="module")
def engine():
    e = Engine.open(DEMO)
    yield e
    e.close()


def client_fields(module: Any) -> set[str]:
    """The request fields the installed client can send (streaming and not: `stream` is in the subclasses)."""
    keys: set[str] = set()
    for cls in (module.CompletionCreateParamsNonStreaming, module.CompletionCreateParamsStreaming):
        keys |= set(cls.__required_keys__) | set(cls.__optional_keys__)
    return keys


# ---------------------------------------------------------------------------------------------- references

def greedy(engine, ids: list[int], n: int = N, **sampling) -> Any:
    return engine.generate(ids, max_new_tokens=n, temperature=0, **sampling)


def chat_ids(engine) -> list[int]:
    return engine.tokenizer.encode_chat(MSGS)


def text_of(r: Any, chat: bool) -> str:
    if isinstance(r, openai.Stream):
        if chat:
            return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        return "".join(c.choices[0].text for c in r if c.choices)
    return r.choices[0].message.content if chat else r.choices[0].text


def same_as_greedy(engine, chat: bool, **sampling) -> Callable[[Any], None]:
    def check(r: Any) -> None:
        ids = chat_ids(engine) if chat else engine.tokenizer.encode(PROMPT)
        assert text_of(r, chat) == greedy(engine, ids, **sampling).text
    return check


def check_logprobs(engine, chat: bool, top: int) -> Callable[[Any], None]:
    def check(r: Any) -> None:
        ids = chat_ids(engine) if chat else engine.tokenizer.encode(PROMPT)
        want = greedy(engine, ids)
        logp = torch.log_softmax(engine.logits(ids + want.token_ids), dim=-1)[len(ids) - 1:]
        lp = r.choices[0].logprobs
        if chat:
            tokens = [e.token for e in lp.content]
            got = [e.logprob for e in lp.content]
            tops = [[(t.token, t.logprob) for t in e.top_logprobs] for e in lp.content]
        else:
            tokens, got = lp.tokens, lp.token_logprobs
            tops = [list(d.items()) for d in lp.top_logprobs]
        assert tokens == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids]
        assert got == pytest.approx([float(logp[i, t]) for i, t in enumerate(want.token_ids)], abs=1e-4)
        for i, row in enumerate(tops):
            assert len(row) == top
            values = [v for _, v in row]
            assert values == sorted(values, reverse=True)
            assert values == pytest.approx(torch.topk(logp[i], top).values.tolist(), abs=1e-4)
            if top:  # greedy: the chosen token is the most likely one
                assert row[0] == (tokens[i], pytest.approx(got[i], abs=1e-6))
    return check


def differs_from_greedy_and_matches_engine(engine, chat: bool, n: int = N, **sampling) -> Callable[[Any], None]:
    """The field changes the greedy answer (a server ignoring it fails) into the engine's own with it."""
    def check(r: Any) -> None:
        ids = chat_ids(engine) if chat else engine.tokenizer.encode(PROMPT)
        plain, adjusted = greedy(engine, ids, n), greedy(engine, ids, n, **sampling)
        assert plain.token_ids != adjusted.token_ids
        assert text_of(r, chat) == adjusted.text
    return check


# ---------------------------------------------------------------------------------------------- the tables
# field -> [(value, extra arguments, check)]: check is a function of the response (honoured) or "refused"
REFUSED = "refused"
TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {},
                                                                       "additionalProperties": False}}}]
ONE_CALL = {"tools": TOOL, "parallel_tool_calls": False, "max_tokens": 40}  # tool calls: tests/test_tool_calls.py


def calls_f(r: Any) -> bool:
    return [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == [("f", "{}")]


def chat_cases(engine) -> dict[str, list[tuple[Any, dict, Any]]]:
    neutral = same_as_greedy(engine, True)
    first = greedy(engine, chat_ids(engine)).token_ids[0]
    return {
        "messages": [(MSGS, {}, neutral)],
        "model": [("demo-model", {}, lambda r: r.model == "demo-model")],
        "max_tokens": [(3, {}, lambda r: r.usage.completion_tokens <= 3)],
        "max_completion_tokens": [(3, {}, lambda r: r.usage.completion_tokens <= 3)],
        "temperature": [(0, {}, neutral)],
        "top_p": [(1e-9, {"temperature": 1.0}, neutral)],  # only the most likely token survives: greedy
        "seed": [(7, {"temperature": 1.0}, lambda r: r.choices[0].message.content == engine.generate(
            chat_ids(engine), max_new_tokens=N, temperature=1.0, seed=7).text)],
        "stop": [(["\n"], {}, lambda r: "\n" not in r.choices[0].message.content)],
        "n": [(1, {}, neutral), (2, {}, REFUSED)],
        "stream": [(True, {}, neutral)],
        "stream_options": [({"include_usage": True}, {"stream": True},
                            lambda r: [c for c in r][-1].usage.completion_tokens >= 1),
                           ({"include_usage": True}, {}, REFUSED)],
        "presence_penalty": [(2.0, {"max_tokens": 30}, differs_from_greedy_and_matches_engine(
            engine, True, 30, presence_penalty=2.0))],
        "frequency_penalty": [(2.0, {"max_tokens": 30}, differs_from_greedy_and_matches_engine(
            engine, True, 30, frequency_penalty=2.0))],
        "logit_bias": [({str(first): -100}, {}, differs_from_greedy_and_matches_engine(
            engine, True, logit_bias={first: -100}))],
        "logprobs": [(True, {}, check_logprobs(engine, True, 0)), (False, {}, neutral)],
        "top_logprobs": [(3, {"logprobs": True}, check_logprobs(engine, True, 3)), (2, {}, REFUSED)],
        "response_format": [({"type": "text"}, {}, neutral),
                            ({"type": "json_object"}, {"max_tokens": 200},
                             lambda r: isinstance(json.loads(r.choices[0].message.content), dict)),
                            ({"type": "xml"}, {}, REFUSED)],  # structured output: tests/test_structured_output.py
        "user": [("someone", {}, neutral)],
        "metadata": [({"k": "v"}, {}, neutral)],
        "safety_identifier": [("abc", {}, neutral)],
        "prompt_cache_key": [("conversation-1", {}, neutral)],
        "prompt_cache_retention": [("in_memory", {}, neutral), ("24h", {}, REFUSED)],
        "service_tier": [("auto", {}, neutral), ("flex", {}, REFUSED)],
        "store": [(False, {}, neutral), (True, {}, REFUSED)],
        "modalities": [(["text"], {}, neutral), (["text", "audio"], {}, REFUSED)],
        "audio": [({"voice": "alloy", "format": "wav"}, {}, REFUSED)],
        "function_call": [("none", {}, neutral), ("auto", {}, REFUSED)],
        "functions": [([TOOL[0]["function"]], {}, REFUSED)],
        "tools": [([], {}, neutral), (TOOL, {**ONE_CALL, "tool_choice": "required"}, calls_f),
                  ([{"type": "retrieval"}], {}, REFUSED)],
        "tool_choice": [("none", {}, neutral), ("required", ONE_CALL, calls_f), ("required", {}, REFUSED),
                        ({"type": "function", "function": {"name": "g"}}, {"tools": TOOL}, REFUSED)],
        "parallel_tool_calls": [(False, {**ONE_CALL, "tool_choice": {"type": "function", "function": {"name": "f"}}},
                                 calls_f), (True, {}, REFUSED)],
        "moderation": [({"model": "omni-moderation-latest"}, {}, REFUSED)],
        "prediction": [({"type": "content", "content": "def f"}, {}, REFUSED)],
        "prompt_cache_options": [({"ttl": "30m"}, {}, REFUSED)],
        "reasoning_effort": [("high", {}, REFUSED)],
        "verbosity": [("low", {}, REFUSED)],
        "web_search_options": [({}, {}, REFUSED)],
    }


def completion_cases(engine) -> dict[str, list[tuple[Any, dict, Any]]]:
    neutral = same_as_greedy(engine, False)
    first = greedy(engine, engine.tokenizer.encode(PROMPT)).token_ids[0]
    return {
        "prompt": [(PROMPT, {}, neutral)],
        "model": [("demo-model", {}, lambda r: r.model == "demo-model")],
        "max_tokens": [(3, {}, lambda r: r.usage.completion_tokens <= 3)],
        "temperature": [(0, {}, neutral)],
        "top_p": [(1e-9, {"temperature": 1.0}, neutral)],
        "seed": [(7, {"temperature": 1.0}, lambda r: r.choices[0].text == engine.generate(
            PROMPT, max_new_tokens=N, temperature=1.0, seed=7).text)],
        "stop": [(["\n"], {}, lambda r: "\n" not in r.choices[0].text)],
        "n": [(1, {}, neutral), (2, {}, REFUSED)],
        "stream": [(True, {}, neutral)],
        "stream_options": [({"include_usage": True}, {"stream": True},
                            lambda r: [c for c in r][-1].usage.completion_tokens >= 1)],
        "presence_penalty": [(2.0, {"max_tokens": 30}, differs_from_greedy_and_matches_engine(
            engine, False, 30, presence_penalty=2.0))],
        "frequency_penalty": [(2.0, {"max_tokens": 30}, differs_from_greedy_and_matches_engine(
            engine, False, 30, frequency_penalty=2.0))],
        "logit_bias": [({str(first): -100}, {}, differs_from_greedy_and_matches_engine(
            engine, False, logit_bias={first: -100}))],
        "logprobs": [(2, {}, check_logprobs(engine, False, 2))],
        "echo": [(True, {}, lambda r: r.choices[0].text == PROMPT + greedy(engine, engine.tokenizer.encode(PROMPT)
                                                                            ).text),
                 (True, {"logprobs": 1}, REFUSED)],
        "user": [("someone", {}, neutral)],
        "best_of": [(1, {}, neutral), (3, {}, REFUSED)],
        "suffix": [("\n    return x", {}, REFUSED)],
    }


def run_case(client, chat: bool, field: str, value: Any, extra: dict, check: Any) -> None:
    args = {"model": "demo-model", "max_tokens": N, "temperature": 0, **extra, field: value}
    if chat:
        args.setdefault("messages", MSGS)
        create = client.chat.completions.create
    else:
        args.setdefault("prompt", PROMPT)
        create = client.completions.create
    if check == REFUSED:
        with pytest.raises(openai.BadRequestError) as e:
            create(**args)
        error = e.value.body
        assert error["param"].split(".")[0] == field and error["message"].startswith(error["param"] + ":"), error
        return
    result = check(create(**args))
    assert result is None or result is True, f"{field}={value!r} was not honoured"


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_every_client_field_is_honoured_or_refused_by_name(client, engine, chat):
    fields = client_fields(chat_params if chat else completion_params)
    cases = chat_cases(engine) if chat else completion_cases(engine)
    server_table = server_fields.CHAT_FIELDS if chat else server_fields.COMPLETION_FIELDS
    unclassified = sorted(fields - set(cases))
    assert not unclassified, f"the openai client sends fields this test does not check: {unclassified}"
    assert not sorted(fields - set(server_table)), "fields.py does not classify every client field"
    for field in sorted(fields):
        for value, extra, check in cases[field]:
            run_case(client, chat, field, value, extra, check)
            if server_table[field] == server_fields.REFUSED:
                assert check == REFUSED or value in (None, "none", False, 1, [], ["text"], "in_memory", "auto")


def test_unknown_and_extension_fields(client, engine, base):
    r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    # extensions through extra_body: top_k=1 is greedy; spec names the request field, not the CLI flag
    r = client.chat.completions.create(model="demo-model", messages=MSGS, max_tokens=N, temperature=1.0,
                                       extra_body={"top_k": 1})
    assert r.choices[0].message.content == greedy(engine, chat_ids(engine)).text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo-model", messages=MSGS, max_tokens=2, extra_body={"spec": "warp"})
    assert e.value.body["param"] == "spec" and e.value.body["message"].startswith("spec: must be one of")
    assert "--spec" not in e.value.body["message"]
    # an engine opened without its MTP layers: refused before the stream starts (a 400, not an error event in a 200)
    r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "spec": "mtp",
                                                         "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "spec", r.text
    # an engine opened without a draft model: the request's field named, not the CLI's flag (--draft-model)
    r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "spec": "draft"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "spec", r.text
    assert "--" not in r.json()["error"]["message"], r.text
    # the draft shape is the engine's (Engine.open), not a request field: refused by name
    r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "spec": "ngram",
                                                         "spec_depth": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "spec_depth", r.text
    assert "--" not in r.json()["error"]["message"], r.text
    r = httpx.post(base + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x", "name": "bob"}], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.name"


def test_streamed_logprobs_equal_the_whole_answer(client):
    for chat in (True, False):
        args = dict(model="demo-model", max_tokens=12, temperature=0)
        if chat:
            whole = client.chat.completions.create(messages=MSGS, logprobs=True, top_logprobs=2, **args)
            stream = client.chat.completions.create(messages=MSGS, logprobs=True, top_logprobs=2, stream=True,
                                                    stream_options={"include_usage": True}, **args)
            chunks = list(stream)
            got = [(e.token, e.logprob, [t.logprob for t in e.top_logprobs])
                   for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
            want = [(e.token, e.logprob, [t.logprob for t in e.top_logprobs])
                    for e in whole.choices[0].logprobs.content]
        else:
            whole = client.completions.create(prompt=PROMPT, logprobs=2, **args)
            chunks = list(client.completions.create(prompt=PROMPT, logprobs=2, stream=True,
                                                    stream_options={"include_usage": True}, **args))
            parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
            got = [x for p in parts for x in zip(p.tokens, p.token_logprobs, p.text_offset)]
            lp = whole.choices[0].logprobs
            want = list(zip(lp.tokens, lp.token_logprobs, lp.text_offset))
        assert len(got) == len(want) == chunks[-1].usage.completion_tokens
        for g, w in zip(got, want):
            assert g[0] == w[0] and g[1] == pytest.approx(w[1], abs=1e-5) and g[2] == pytest.approx(w[2], abs=1e-5)


def test_echo_streamed_and_token_ids(client, engine):
    ids = engine.tokenizer.encode(PROMPT)
    want = greedy(engine, ids).text
    stream = client.completions.create(model="demo-model", prompt=PROMPT, max_tokens=N, temperature=0, echo=True,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == PROMPT + want
    r = client.completions.create(model="demo-model", prompt=ids, max_tokens=N, temperature=0, echo=True)
    assert r.choices[0].text == engine.tokenizer.decode(ids, skip_special_tokens=False) + want


def test_cached_tokens_report_the_reused_prefix(client):
    history = [{"role": "user", "content": "Count to three."}]
    first = client.chat.completions.create(model="demo-model", messages=history, max_tokens=4, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Again."}]
    second = client.chat.completions.create(model="demo-model", messages=history, max_tokens=4, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == second.model_extra["offload_engine"]["reused_prompt_tokens"]
    assert 0 < cached < second.usage.prompt_tokens
    other = client.completions.create(model="demo-model", prompt="class Tree:", max_tokens=2, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0


BAD = [  # malformed values of the new fields: a clear 400 naming the field, and the server goes on
    ("/v1/chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": [1, 2]}, "logit_bias"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": "x"}, "frequency_penalty"),
    ("/v1/chat/completions", {"response_format": "json"}, "response_format"),
    ("/v1/chat/completions", {"tools": "x"}, "tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools.0.function.parameters"),
    ("/v1/chat/completions", {"tools": TOOL, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "1"}]}, "messages.0.tool_call_id"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True, "x": 1}, "stream": True},
     "stream_options.x"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"suffix": 5}, "suffix"),
    ("/v1/completions", {"best_of": "2"}, "best_of"),
]


def test_malformed_new_fields_are_400_and_counted_by_status(base):
    def errors(status: int) -> int:
        text = httpx.get(base + "/metrics").text
        m = re.search(rf'^offload_engine_request_errors_total{{status="{status}"}} (\d+)$', text, re.M)
        return int(m.group(1)) if m else 0
    before = errors(400), errors(404)
    for path, extra, param in BAD:
        body = {"max_tokens": 2, **({"messages": MSGS} if "chat" in path else {"prompt": PROMPT}), **extra}
        r = httpx.post(base + path, json=body, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["message"].startswith(param + ":"), error
        assert "Traceback" not in error["message"]
    assert httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "model": "x"}).status_code == 404
    assert httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}).status_code == 200
    assert (errors(400), errors(404)) == (before[0] + len(BAD), before[1] + 1)
