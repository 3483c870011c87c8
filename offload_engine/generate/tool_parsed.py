"""What a tool-call parser returns (content and calls) and the JSON rule the call grammars share: used by
tool_calls.py and harmony.py alike, so neither imports the other's module for them."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

# compact JSON, as the structured-output grammars write it (grammar.py's JSON_OPTIONS)
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ParsedCall:
    name: str
    arguments: str  # the JSON text as generated (so far)
    closed: bool
    native_id: str | None = None  # Kimi K2's "functions.f:0", which its template renders back


@dataclass
class Parsed:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def json_rule(schema: dict) -> str:
    """A Lark rule body: JSON valid for `schema`, written compact."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})
