"""Tool calls on /v1/chat/completions: `tools`, `tool_choice` and `parallel_tool_calls` checked (a 400 naming the
field), the conversation's tool calls and tool results rendered through the model's own chat template (which gets
`tools=` as transformers passes it), "required" and a named function forced by a grammar (generate/tool_calls.py),
and the answer's calls parsed back into `message.tool_calls`, whole or streamed as `delta.tool_calls`.

tool_choice "none" (or no tools) offers no tools: the template renders none and nothing is parsed."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..generate.decoder import FinishEvent
from ..generate.grammar import Grammar
from ..generate import harmony
from ..generate.tool_calls import NAME, SYNTAXES, CallText, Syntax, call_grammar, detect, literal, parse
from ..generate.tool_parsed import Parsed
from .protocol import ApiError, ChatRequest

MAX_TOOLS = 128  # OpenAI's limit
MAX_SCHEMA_BYTES = 64 * 1024  # one function's parameters, as JSON
MAX_SCHEMA_DEPTH = 32
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
SUPPORTED = ", ".join(SYNTAXES)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class ToolPlan:
    """The tools offered to one request and how its answer is read."""
    syntax: Syntax
    tools: list[dict]  # as the template gets them: {"type": "function", "function": {name, description, parameters}}
    choice: str  # "auto", "required" or "function" (one named function: `forced`)
    forced: str | None
    parallel: bool
    tokenizer: Any
    stops: tuple[str, ...] = ()
    grammar: Grammar | None = field(default=None, compare=False)

    def message(self, finish: FinishEvent) -> tuple[dict, str]:
        """The whole answer's assistant message (content, tool_calls) and its finish_reason."""
        answer = ToolAnswer(self)
        for token_id in finish.token_ids:
            answer.text.push(token_id)
        answer.text.finish()
        parsed = answer.final()
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
        if parsed.calls:
            message["tool_calls"] = [{"id": answer.call_id(k, c.native_id), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for k, c in enumerate(parsed.calls)]
        elif message["content"] is None:
            message["content"] = ""
        return message, answer.reason(finish.reason, parsed)


class ToolAnswer:
    """One streamed answer: token ids in, the content and tool-call deltas not sent yet out."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = CallText(plan.tokenizer, plan.syntax, plan.stops)
        self._content = ""  # content sent so far
        self._arguments: list[str] = []  # each call's arguments sent so far
        self._ids: list[str] = []

    def call_id(self, k: int, native: str | None) -> str:
        while len(self._ids) <= k:  # Kimi K2's template renders its own ids ("functions.f:0") back into the prompt
            self._ids.append(native if native and self.plan.syntax.name == "kimi_k2" else
                             f"call_{uuid.uuid4().hex[:24]}")
        return self._ids[k]

    def token(self, token_id: int) -> list[dict]:
        self.text.push(token_id)
        return self._deltas(parse(self.plan.syntax, self.text.settled(), final=False))

    def finish(self) -> list[dict]:
        self.text.finish()
        return self._deltas(self.final())

    def final(self) -> Parsed:
        return parse(self.plan.syntax, self.text.text, final=True)

    def reason(self, engine_reason: str, parsed: Parsed) -> str:
        reason = FINISH.get(engine_reason, engine_reason)
        return "tool_calls" if parsed.calls and reason == "stop" else reason

    def _deltas(self, now: Parsed) -> list[dict]:
        out: list[dict] = []
        if len(now.content) > len(self._content):
            out.append({"content": now.content[len(self._content):]})
            self._content = now.content
        for k, call in enumerate(now.calls):
            if k == len(self._arguments):
                self._arguments.append("")
                out.append({"tool_calls": [{"index": k, "id": self.call_id(k, call.native_id), "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            piece = call.arguments[len(self._arguments[k]):]
            if piece:
                out.append({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
                self._arguments[k] = call.arguments
        return out


# ---------------------------------------------------------------------------------------------- the request

def plan(body: ChatRequest, tokenizer: Any) -> ToolPlan | None:
    """The request's tools checked; None when none are offered (no tools, or tool_choice "none")."""
    tools = _check_tools(body.tools)
    names = [t["function"]["name"] for t in tools]
    choice, forced = _check_choice(body.tool_choice, names)
    parallel = body.parallel_tool_calls
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", f"expected a boolean, got {parallel!r}")
    if parallel is not None and not tools:
        raise _bad("parallel_tool_calls", "only allowed with tools")
    if not tools or choice == "none":
        return None
    syntax = detect(tokenizer.chat_template)
    if syntax is None:
        raise _bad("tools", "this model's chat template shows no tool-call syntax this server reads (it reads "
                            f"{SUPPORTED}); the template may lack a tools section")
    if body.response_format not in (None, {"type": "text"}) or body.grammar is not None:
        param = "grammar" if body.grammar is not None else "response_format"
        raise _bad(param, "not with tools (the answer is a tool call or free text); send tool_choice 'none' to "
                          "constrain a plain answer")
    grammar = None
    if choice != "auto":
        functions = [(t["function"]["name"], _parameters(t)) for t in tools
                     if forced is None or t["function"]["name"] == forced]
        lit = lambda s: literal(tokenizer, s)  # noqa: E731
        # gpt-oss's generation_config makes <|call|> an EOS: then the EOS ends a harmony call
        call_ends = tokenizer.token_to_id(harmony.CALL) in tokenizer.eos_token_ids
        text = call_grammar(syntax, functions, parallel is not False and forced is None, lit, call_ends=call_ends)
        grammar = Grammar.lark(text, name="tool_choice")
    return ToolPlan(syntax, tools, choice, forced, parallel is not False, tokenizer, body.stops(), grammar)


def template_vars(tool_plan: ToolPlan | None) -> dict[str, Any]:
    return {"tools": tool_plan.tools} if tool_plan is not None else {}


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _check_tools(value: Any) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad("tools", "expected a list of {type: 'function', function: {name, description, parameters}}, "
                            f"got {type(value).__name__}")
    if len(value) > MAX_TOOLS:
        raise _bad("tools", f"{len(value)} tools, over the limit of {MAX_TOOLS}")
    out: list[dict] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(value):
        at = f"tools.{i}"
        if not isinstance(tool, dict):
            raise _bad(at, f"expected an object, got {type(tool).__name__}")
        if tool.get("type") != "function":
            raise _bad(f"{at}.type", f"only 'function' tools are supported, got {tool.get('type')!r}")
        for key in set(tool) - {"type", "function"}:
            raise _bad(f"{at}.{key}", "unknown field of a tool")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{at}.function", f"expected {{name, description, parameters, strict}}, got {fn!r}")
        for key in sorted(set(fn) - {"name", "description", "parameters", "strict"}):
            raise _bad(f"{at}.function.{key}", "unknown field of a function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise _bad(f"{at}.function.name", f"must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
        if name in seen:
            raise _bad(f"{at}.function.name", f"duplicate name {name!r} (also tools.{seen[name]})")
        seen[name] = i
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"{at}.function.description", f"expected a string, got {fn['description']!r}")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise _bad(f"{at}.function.strict", f"expected a boolean, got {fn['strict']!r}")
        if fn.get("parameters") is not None:
            _check_schema(fn["parameters"], f"{at}.function.parameters")
        # strict or not, the parameters are enforced token by token under "required" / a named function
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters")
                                                     if fn.get(k) is not None}})
    return out


def _check_schema(schema: Any, at: str) -> None:
    """A function's parameters: a JSON Schema of an object that llguidance compiles, bounded in size and depth."""
    if not isinstance(schema, dict):
        raise _bad(at, f"expected a JSON Schema (an object), got {type(schema).__name__}")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise _bad(at, f"the schema is nested too deeply (over {MAX_SCHEMA_DEPTH} levels)")
    size = len(json.dumps(schema).encode())
    if size > MAX_SCHEMA_BYTES:
        raise _bad(at, f"the schema is {size} bytes, over the limit of {MAX_SCHEMA_BYTES}")
    if schema.get("type", "object") != "object":
        raise _bad(at, f"the parameters must be an object schema (type: 'object'), got type {schema['type']!r}")
    loop = _recursion(schema)
    if loop is not None:
        raise _bad(at, f"recursive schemas are not supported ($ref {loop!r} refers back to itself)")
    try:
        Grammar.json_schema(schema, name=at).compiled()
    except ConfigError as e:
        raise ApiError(400, str(e), param=at) from None


def _depth(value: Any) -> int:
    """Nesting depth of JSON containers, without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:
                todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _refs(value: Any) -> list[str]:
    """Every "$ref" string inside `value`."""
    found, todo = [], [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            if isinstance(item.get("$ref"), str):
                found.append(item["$ref"])
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return found


def _resolve(schema: dict, ref: str) -> Any:
    """A local JSON pointer ("#", "#/$defs/x"), or None where it does not resolve (llguidance names that)."""
    if not ref.startswith("#"):
        return None
    node: Any = schema
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _recursion(schema: dict) -> str | None:
    """A $ref whose target contains (through further refs) a ref to itself: an instance would have to contain
    itself (a tree, or a loop with no way out; llguidance accepts some and not others)."""
    edges = {ref: set(_refs(_resolve(schema, ref))) for ref in set(_refs(schema))}
    for start in edges:
        seen, todo = set(), list(edges[start])
        while todo:
            ref = todo.pop()
            if ref == start:
                return start
            if ref not in seen:
                seen.add(ref)
                todo.extend(edges.get(ref, ()))
    return None


def _check_choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if names else "none"), None
    if value in ("none", "auto", "required") and isinstance(value, str):
        if value != "none" and not names:
            raise _bad("tool_choice", f"{value!r} needs tools")
        return value, None
    fn = value.get("function") if isinstance(value, dict) else None
    if not (isinstance(fn, dict) and value.get("type") == "function" and set(value) == {"type", "function"}
            and set(fn) == {"name"}):
        raise _bad("tool_choice", "expected 'none', 'auto', 'required' or {type: 'function', function: {name}}, "
                                  f"got {value!r}")
    if not names:
        raise _bad("tool_choice", "a named function needs tools")
    if fn["name"] not in names:
        raise _bad("tool_choice.function.name", f"no tool is named {fn['name']!r} (tools: {', '.join(names)})")
    return "function", fn["name"]


# ---------------------------------------------------------------------------------------------- the conversation

def template_messages(body: ChatRequest, tokenizer: Any) -> list[dict]:
    """The messages as the chat template gets them: assistant tool calls (arguments as the template wants them)
    and tool results (each answering a call of the assistant message before it)."""
    template = tokenizer.chat_template or ""
    syntax = detect(template)
    as_text = syntax is None or syntax.arguments_as_text
    out: list[dict] = []
    open_calls: set[str] = set()  # ids of the last assistant message's calls
    for i, m in enumerate(body.messages):
        at = f"messages.{i}"
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_call_id is not None and m.role != "tool":
            raise _bad(f"{at}.tool_call_id", "only a tool message answers a tool call")
        if m.tool_calls not in (None, []):
            if m.role != "assistant":
                raise _bad(f"{at}.tool_calls", "only an assistant message makes tool calls")
            if "tool_calls" not in template:
                raise _bad(f"{at}.tool_calls", "this model's chat template has no place for tool calls")
            message["tool_calls"] = _check_calls(m.tool_calls, f"{at}.tool_calls", as_text)
            open_calls = {c["id"] for c in message["tool_calls"]}
        elif m.role == "tool":
            if not isinstance(m.tool_call_id, str) or not m.tool_call_id:
                raise _bad(f"{at}.tool_call_id", "a tool message needs the id of the tool call it answers, got "
                                                 f"{m.tool_call_id!r}")
            if m.tool_call_id not in open_calls:
                raise _bad(f"{at}.tool_call_id", f"{m.tool_call_id!r} is not a call of the assistant message "
                                                 "before it")
            message["tool_call_id"] = m.tool_call_id
        else:
            open_calls = set()
        out.append(message)
    return out


def _check_calls(value: Any, at: str, as_text: bool) -> list[dict]:
    if not isinstance(value, list):
        raise _bad(at, f"expected a list of {{id, type: 'function', function: {{name, arguments}}}}, got {value!r}")
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(call.get("id"), str) and call.get("type") == "function"
                and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
            raise _bad(f"{at}.{j}", f"expected {{id, type: 'function', function: {{name, arguments: str}}}}, "
                                    f"got {call!r}")
        try:
            arguments = json.loads(fn["arguments"])
        except (json.JSONDecodeError, RecursionError):
            raise _bad(f"{at}.{j}.function.arguments", "not valid JSON") from None
        calls.append({"id": call["id"], "type": "function",
                      "function": {"name": fn["name"], "arguments": fn["arguments"] if as_text else arguments}})
    return calls
