"""Request bodies (pydantic, strict: a wrong type is a 400, not a coercion) and OpenAI error objects."""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

Number = StrictInt | StrictFloat


class ApiError(Exception):
    """An error answered as {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Message(BaseModel):
    """A chat message. Fields the chat template has no place for (a participant's name) are refused by
    `fields.check_message`, not dropped; tool calls and tool results are checked by tools.py."""
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: Any = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    refusal: Any = None
    audio: Any = None

    def text(self) -> str:
        """The content as text: a list of content parts keeps its text parts (images are refused)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"only text content parts are supported, got {part.get('type')!r}",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None  # refused when true (fields.py)


class Sampling(BaseModel):
    """The fields both endpoints share. An unknown field is a 400 naming it (as OpenAI answers), and each known
    field is implemented or refused with a 400 when set to a value this server would not honour (fields.py)."""
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=1.0, ge=0, le=2)
    top_p: Number | None = Field(default=1.0, gt=0, le=1)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = 1
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Number | None = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None  # an end-user id: output-neutral
    # extensions, sent with the openai client's extra_body
    spec: StrictStr | None = None  # overrides the server's speculative mode for this request
    top_k: StrictInt | None = Field(default=None, ge=0)
    min_p: Number | None = Field(default=None, ge=0, le=1)
    grammar: StrictStr | None = None  # a Lark grammar the output must match

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    # output-neutral, checked by fields.py
    metadata: dict[StrictStr, StrictStr] | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: Any = None
    service_tier: Any = None
    store: Any = None
    modalities: Any = None
    # refused unless absent or a value that asks for nothing (fields.py)
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    moderation: Any = None
    parallel_tool_calls: Any = None
    prediction: Any = None
    prompt_cache_options: Any = None
    reasoning_effort: Any = None
    tool_choice: Any = None
    tools: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class CompletionRequest(Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    echo: StrictBool | None = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    best_of: Any = None
    suffix: Any = None


_TYPE_TAG = re.compile(r"^(int|float|str|bool|none|(list|dict|tuple|set|union|literal|nullable|function-\w+|"
                       r"constrained-\w+)\[.*\]|constrained-\w+)$")


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Bytes -> a validated request, or an ApiError(400) naming the field (never a traceback)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        # the loc names the field, then pydantic's tag of the union member that failed ('int', 'list[int]'): drop it
        param = ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and _TYPE_TAG.match(p))) or None
        msg = first["msg"]
        at = len(first["loc"]) - 1  # where the union's tag sits in each member's loc
        tags = [err["loc"][at] for err in e.errors() if len(err["loc"]) > at and err["loc"][:at] == first["loc"][:at]
                and isinstance(err["loc"][at], str) and _TYPE_TAG.match(err["loc"][at])]
        if tags:  # a union (a number: int or float): name the types it takes
            msg = f"expected {' or '.join(dict.fromkeys(tags))}, got {first['input']!r}"
        if first["type"] == "extra_forbidden":
            msg = "unknown request field: this server answers a field it does not implement with an error rather " \
                  "than ignore it (docs/SERVE.md lists the fields)"
        raise ApiError(400, f"{param}: {msg}" if param else msg, param=param) from None
