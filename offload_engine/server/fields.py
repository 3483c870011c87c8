"""What the server does with each request field: implemented, output-neutral (accepted: by definition it does not
change the answer), or refused with a 400 naming it when set to a value this server would not honour. Nothing is
dropped in silence: a field outside these tables is refused by the request models (extra="forbid")."""
from __future__ import annotations

import re
from typing import Any, Callable

from ..errors import ConfigError
from ..generate.grammar import Grammar
from .protocol import ApiError, ChatRequest, CompletionRequest, Message

IMPLEMENTED, NEUTRAL, REFUSED = "implemented", "output-neutral", "refused"

SHARED = {name: IMPLEMENTED for name in (
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
    "presence_penalty", "frequency_penalty", "logit_bias", "spec", "top_k", "min_p", "grammar")}
SHARED["user"] = NEUTRAL

CHAT_FIELDS: dict[str, str] = {
    **SHARED, "messages": IMPLEMENTED, "max_completion_tokens": IMPLEMENTED, "logprobs": IMPLEMENTED,
    "top_logprobs": IMPLEMENTED, "response_format": IMPLEMENTED, "tools": IMPLEMENTED, "tool_choice": IMPLEMENTED,
    "parallel_tool_calls": IMPLEMENTED,
    **{name: NEUTRAL for name in ("metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                                  "service_tier", "store", "modalities")},
    **{name: REFUSED for name in ("audio", "function_call", "functions", "moderation", "prediction",
                                  "prompt_cache_options", "reasoning_effort", "verbosity", "web_search_options")},
}
COMPLETION_FIELDS: dict[str, str] = {**SHARED, "prompt": IMPLEMENTED, "echo": IMPLEMENTED, "logprobs": IMPLEMENTED,
                                     "best_of": REFUSED, "suffix": REFUSED}

TOOLS = "the deprecated functions API is not supported: use tools and tool_choice"
# field -> (values accepted: they ask for nothing this server lacks, why any other value is refused)
_CHAT_RULES: dict[str, tuple[tuple[Any, ...], str]] = {
    "audio": ((None,), "audio output is not supported (text only)"),
    "function_call": ((None, "none"), TOOLS),
    "functions": ((None, []), TOOLS),
    "moderation": ((None,), "moderation is not run by this server"),
    "prediction": ((None,), "predicted outputs are not supported (speculative decoding drafts on its own: spec)"),
    "prompt_cache_options": ((None,), "prompt caching here is automatic and in memory (the last sequence's cache "
                                      "is reused; usage.prompt_tokens_details.cached_tokens reports it): it takes "
                                      "no options"),
    "prompt_cache_retention": ((None, "in_memory"), "the prompt cache is in memory only ('in_memory')"),
    "reasoning_effort": ((None,), "this server has no reasoning-effort control"),
    "verbosity": ((None,), "this server has no verbosity control"),
    "web_search_options": ((None,), "web search is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported (['text'])"),
    "service_tier": ((None, "auto", "default"), "this server has one service tier ('auto' / 'default')"),
    "store": ((None, False), "this server stores no completions (store: false)"),
}
_COMPLETION_RULES: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "only best_of=1 is supported (one sequence per request)"),
    "suffix": ((None, ""), "suffix (fill-in-the-middle) is not supported"),
}
_MESSAGE_RULES: dict[str, tuple[tuple[Any, ...], str]] = {
    "name": ((None,), "a participant's name is not supported (the chat template has no place for it)"),
    "function_call": ((None,), TOOLS + " (an assistant message's tool_calls)"),
    "refusal": ((None,), "an assistant refusal is not supported: send it as content"),
    "audio": ((None,), "audio is not supported (text only)"),
}


def refuse(param: str, reason: str) -> ApiError:
    return ApiError(400, f"{param}: {reason}", param=param, code="unsupported_parameter")


def _apply(rules: dict[str, tuple[tuple[Any, ...], str]], get: Callable[[str], Any], prefix: str = "") -> None:
    for name, (accepted, reason) in rules.items():
        value = get(name)
        if not any(value == ok and type(value) is type(ok) for ok in accepted):
            raise refuse(prefix + name, f"{reason}; got {value!r}")


def check_shared(body: ChatRequest | CompletionRequest) -> None:
    if body.n not in (None, 1):
        raise refuse("n", f"only n=1 is supported (one sequence per request), got {body.n}")
    if body.stream_options is not None:
        if not body.stream:
            raise ApiError(400, "stream_options: only allowed with stream: true", param="stream_options")
        if body.stream_options.include_obfuscation:
            raise refuse("stream_options.include_obfuscation", "stream obfuscation is not supported")


def check_chat(body: ChatRequest) -> None:
    check_shared(body)
    _apply(_CHAT_RULES, lambda name: getattr(body, name))
    for i, message in enumerate(body.messages):
        check_message(i, message)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs: true", param="top_logprobs")


def check_message(i: int, message: Message) -> None:
    _apply(_MESSAGE_RULES, lambda name: getattr(message, name), prefix=f"messages.{i}.")


def check_completion(body: CompletionRequest) -> None:
    check_shared(body)
    _apply(_COMPLETION_RULES, lambda name: getattr(body, name))
    if body.echo and body.logprobs is not None:
        raise refuse("echo", "echo with logprobs (the prompt tokens' logprobs) is not supported: ask for one of them")


def grammar(body: ChatRequest | CompletionRequest) -> Grammar | None:
    """The output constraint: response_format (json_object, json_schema) or the `grammar` extension (Lark)."""
    fmt = getattr(body, "response_format", None)
    if fmt is not None and body.grammar is not None:
        raise ApiError(400, "grammar: give response_format or grammar, not both", param="grammar")
    try:
        if body.grammar is not None:
            return Grammar.lark(body.grammar, name="grammar")
        if fmt is None:
            return None
        kind = fmt.get("type")
        if kind == "text" and set(fmt) == {"type"}:
            return None
        if kind == "json_object" and set(fmt) == {"type"}:
            return Grammar.json_object("response_format")
        if kind == "json_schema" and set(fmt) == {"type", "json_schema"} and isinstance(fmt["json_schema"], dict):
            spec = fmt["json_schema"]
            extra = set(spec) - {"name", "schema", "strict", "description"}
            if extra or not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema", {}), dict):
                raise ApiError(400, "response_format.json_schema: expected {name: str, schema: object, strict: bool, "
                                    f"description: str}}, got {spec!r}", param="response_format.json_schema")
            if spec.get("strict") not in (None, True, False):
                raise ApiError(400, f"response_format.json_schema.strict: expected a boolean, got {spec['strict']!r}",
                               param="response_format.json_schema.strict")
            # strict or not, the schema is enforced token by token (strict: false asks for less than that)
            return Grammar.json_schema(spec.get("schema", {}), name="response_format.json_schema.schema")
    except ConfigError as e:
        raise ApiError(400, str(e), param=str(e).split(":")[0]) from None
    raise ApiError(400, "response_format: expected {type: 'text'}, {type: 'json_object'} or {type: 'json_schema', "
                        f"json_schema: {{name, schema, strict}}}}, got {fmt!r}", param="response_format")


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """The request's {"token id": bias} as {id: bias}, every id in the vocabulary, each bias in [-100, 100]."""
    out = {}
    for key, value in (bias or {}).items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise ApiError(400, f"logit_bias: keys must be token ids in [0, {vocab_size}), got {key!r}",
                           param="logit_bias")
        if not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias: the bias of token {key} must be in [-100, 100], got {value}",
                           param="logit_bias")
        out[int(key)] = float(value)
    return out


def param_of(message: str) -> str | None:
    """The request field an engine error names first ("spec 'mtp': ...", "logit_bias: ..."), if it is one."""
    m = re.match(r"([a-z_]+)\b", message)
    return m.group(1) if m and (m.group(1) in CHAT_FIELDS or m.group(1) in COMPLETION_FIELDS) else None
