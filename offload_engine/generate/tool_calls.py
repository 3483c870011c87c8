"""Tool calls in the model's own syntax: which syntax a chat template teaches, a parser that reads the calls back out
of the generated text, and the grammar that forces a call.

Syntaxes (their exact shapes are those of vLLM's and SGLang's parsers for these models):
  hermes        Qwen2.5 / Qwen3 / Hermes: <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, one per call
  deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
                (calls joined by \\n)<｜tool▁calls▁end｜>
  deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
  kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}
                <|tool_call_end|>...<|tool_calls_section_end|>
  llama3_json   the whole answer is {"name": "f", "parameters": {...}} (optionally after <|python_tag|>)
  harmony       gpt-oss: <|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>, one per turn
                (its parser and grammar: harmony.py, which `parse` and `call_grammar` here hand it to)

The parser is incremental: `parse(text, final=False)` on a growing text returns content and calls whose text only
ever grows (held back: a partial marker, trailing whitespace, an undecided call head), so a stream can send the
difference each time and end with exactly what `parse(text, final=True)` returns for the whole answer. Arguments
are the model's JSON text as written (json.JSONDecoder.raw_decode finds where the value ends)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

from . import harmony
from .tool_parsed import Parsed, ParsedCall, json_rule

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names (so names need no escaping)
_JSON_HEAD = r'\{\s*"name"\s*:\s*"(?P<name>[A-Za-z0-9_.-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Syntax:
    """How one model family writes tool calls. `head` is a regex matched right after `call_begin`, up to where the
    arguments start (group "name"); the arguments' JSON value is followed by `close` (the wrapper object's "}") and
    `call_end`, whitespace allowed before each."""

    name: str
    call_begin: str
    head: str
    call_end: str = ""
    close: str = ""
    section_begin: str = ""
    section_end: str = ""
    separator: str = ""  # between two calls, as the template writes them (the grammar uses it)
    parallel: bool = True  # False: the template renders one call per turn (Llama 3.1 refuses more)
    markers: tuple[str, ...] = ()  # the syntax's special tokens: kept in the text the parser reads
    arguments_as_text: bool = True  # the template concatenates the arguments (False: it applies tojson)

    @property
    def head_re(self) -> re.Pattern:
        return _compile(self.head)

    @property
    def closing_re(self) -> re.Pattern:
        return _compile(r"\s*" + re.escape(self.close) + r"\s*" + re.escape(self.call_end))


@lru_cache(maxsize=None)
def _compile(pattern: str) -> re.Pattern:
    return re.compile(pattern)


_DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
SYNTAXES = {s.name: s for s in (
    Syntax("hermes", "<tool_call>", r"\s*" + _JSON_HEAD, "</tool_call>", close="}", separator="\n",
           markers=("<tool_call>", "</tool_call>")),
    Syntax("deepseek_v3", _DS[2], r"function<｜tool▁sep｜>(?P<name>[A-Za-z0-9_.-]{1,64})\n```json\n\s*",
           "```" + _DS[3], section_begin=_DS[0], section_end=_DS[1], separator="\n", markers=_DS),
    Syntax("deepseek_v31", _DS[2], r"(?P<name>[A-Za-z0-9_.-]{1,64})<｜tool▁sep｜>\s*", _DS[3],
           section_begin=_DS[0], section_end=_DS[1], markers=_DS),
    Syntax("kimi_k2", "<|tool_call_begin|>",
           r"\s*(?P<id>(?:functions\.)?(?P<name>[A-Za-z0-9_-]{1,64}):\d+)\s*<\|tool_call_argument_begin\|>\s*",
           "<|tool_call_end|>", section_begin="<|tool_calls_section_begin|>",
           section_end="<|tool_calls_section_end|>",
           markers=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                    "<|tool_call_argument_begin|>", "<|tool_call_end|>")),
    Syntax("llama3_json", "", r"\s*(?:<\|python_tag\|>)?\s*" + _JSON_HEAD, close="}", separator="; ",
           parallel=False, markers=("<|python_tag|>",), arguments_as_text=False),
    # gpt-oss (harmony.py reads it): <|call|> ends the turn, so one call; its template applies tojson to arguments
    Syntax("harmony", "", "", parallel=False, arguments_as_text=False, markers=harmony.MARKERS),
)}
HARMONY = "harmony"


def detect(template: str | None) -> Syntax | None:
    """The tool-call syntax a chat template writes (its assistant turns render calls that way), None when the
    template shows no syntax this module knows."""
    if not template:
        return None
    if _DS[0] in template:
        return SYNTAXES["deepseek_v3" if "```json" in template else "deepseek_v31"]
    if "<|tool_calls_section_begin|>" in template:
        return SYNTAXES["kimi_k2"]
    if "<|channel|>" in template and "<|call|>" in template:
        return SYNTAXES[HARMONY]
    if "<tool_call>" in template and "<function=" not in template:  # Qwen3-Coder's XML calls: not read
        return SYNTAXES["hermes"]
    if "<|start_header_id|>" in template and '"parameters": ' in template:
        return SYNTAXES["llama3_json"]
    return None


# ---------------------------------------------------------------------------------------------- parsing

def parse(syntax: Syntax, text: str, final: bool = True) -> Parsed:
    """Content and calls of `text`. Not final: only what can no longer change (see the module docstring); final,
    an answer with no recognisable call is all content, and content before calls loses its trailing whitespace."""
    if syntax.name == HARMONY:  # a grammar of channels and headers, not a call marker + JSON: harmony.py reads it
        return harmony.parse(text, final)
    start = _trigger(syntax, text)
    if start is None:
        return Parsed(text if final else text[:len(text) - _partial_trigger(syntax, text)].rstrip())
    calls: list[ParsedCall] = []
    pos = start + len(syntax.section_begin)
    while True:
        pos = _skip(text, pos, syntax.separator.strip())
        if pos >= len(text) or (syntax.section_end and text.startswith(syntax.section_end, pos)):
            break
        if not text.startswith(syntax.call_begin, pos):
            break  # text after the calls: dropped, as vLLM does
        head = syntax.head_re.match(text, pos + len(syntax.call_begin))
        if head is None:
            break  # not final: perhaps not written yet; final: not a call
        call, pos = _arguments(syntax, text, head, final)
        calls.append(call)
        if not call.closed:
            break
    if not calls:
        return Parsed(text if final else text[:start].rstrip())
    return Parsed(text[:start].rstrip(), calls)


def _trigger(syntax: Syntax, text: str) -> int | None:
    if syntax.call_begin or syntax.section_begin:
        i = text.find(syntax.section_begin or syntax.call_begin)
        return i if i >= 0 else None
    body = text.lstrip()  # Llama 3: the answer is the call
    return len(text) - len(body) if body.startswith(("{", "<|python_tag|>")) else None


def _partial_trigger(syntax: Syntax, text: str) -> int:
    """How many trailing characters may still become the trigger."""
    if not (syntax.call_begin or syntax.section_begin):
        return len(text) if "<|python_tag|>".startswith(text.lstrip()) else 0
    marker = syntax.section_begin or syntax.call_begin
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)


def _skip(text: str, pos: int, separator: str) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if separator and text.startswith(separator, pos):
        return _skip(text, pos + len(separator), "")
    return pos


def _arguments(syntax: Syntax, text: str, head: re.Match, final: bool) -> tuple[ParsedCall, int]:
    name, native = head.group("name"), head.groupdict().get("id")
    start = head.end()
    try:
        _, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:  # not complete yet (or not JSON: cut by max_tokens, or a malformed call)
        return ParsedCall(name, text[start:].rstrip(), False, native), len(text)
    closing = syntax.closing_re.match(text, end)
    if closing is not None:
        return ParsedCall(name, text[start:end], True, native), closing.end()
    return ParsedCall(name, text[start:end], final or not _may_close(syntax, text[end:]), native), end


def _may_close(syntax: Syntax, rest: str) -> bool:
    """Whether `rest` may still grow into the call's closing (whitespace, close, whitespace, call_end)."""
    rest = rest.lstrip()
    if syntax.close:
        if not rest or syntax.close.startswith(rest):
            return True
        if not rest.startswith(syntax.close):
            return False
        rest = rest[len(syntax.close):].lstrip()
    return syntax.call_end.startswith(rest)


# ---------------------------------------------------------------------------------------------- decoding

def _special_id(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when it is one special token (dropped by skip_special_tokens), else None."""
    tid = tokenizer.token_to_id(text)
    if tid is None or tokenizer.decode([tid], skip_special_tokens=True) != "":
        return None
    return tid


class CallText:
    """The generated text as the parser reads it: the engine's text (special tokens dropped, EOS too, cut at the
    first stop string) except that the syntax's own special tokens are kept as their text."""

    def __init__(self, tokenizer: Any, syntax: Syntax, stops: Sequence[str] = ()):
        self._decoder = tokenizer.stream_decoder()
        self._markers = {tid: m for m in syntax.markers if (tid := _special_id(tokenizer, m)) is not None}
        self._end = frozenset(tokenizer.eos_token_ids)
        self._stops = tuple(stops)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> None:
        if token_id in self._end:
            self._add(self._decoder.flush())
        elif token_id in self._markers:
            self._add(self._decoder.flush() + self._markers[token_id])
        else:
            self._add(self._decoder.push(token_id))

    def finish(self) -> None:
        self._add(self._decoder.flush())

    def _add(self, piece: str) -> None:
        if not piece or self.stopped:
            return
        start = max(0, len(self.text) - self._hold)
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True

    def settled(self) -> str:
        """The text no stop string can still cut."""
        return self.text if self.stopped else self.text[:len(self.text) - self._hold]


# ---------------------------------------------------------------------------------------------- grammar

def literal(tokenizer: Any, text: str) -> str:
    """A Lark literal for `text`: the token itself (<[id]>) when it is one special token, else a string."""
    tid = _special_id(tokenizer, text)
    return f"<[{tid}]>" if tid is not None else json.dumps(text, ensure_ascii=False)


def call_grammar(syntax: Syntax, functions: Sequence[tuple[str, dict]], parallel: bool,
                 lit: Callable[[str], str], *, call_ends: bool = False) -> str:
    """A Lark grammar (llguidance) whose sentences are one call (or, with `parallel`, one or more) to one of
    `functions` ((name, parameters schema), names matching NAME) in the syntax, arguments valid for the schema.
    call_ends (harmony only): the tokenizer's EOS includes <|call|>, so the grammar's end lets it through."""
    if syntax.name == HARMONY:
        return harmony.call_grammar(functions, lit, call_ends)
    rules = []
    if syntax.name in ("hermes", "llama3_json"):  # name and arguments inside one JSON object
        key = "arguments" if syntax.name == "hermes" else "parameters"
        body = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, key: s},
                           "required": ["name", key], "additionalProperties": False} for n, s in functions]}
        rules.append(f"fn: {json_rule(body)}")
        call = f'{lit("<tool_call>")} "\\n" fn "\\n" {lit("</tool_call>")}' if syntax.name == "hermes" else "fn"
    else:
        for i, (n, s) in enumerate(functions):
            if syntax.name == "deepseek_v3":
                head = f'{lit(_DS[2])} "function" {lit(_DS[4])} "{n}\\n```json\\n"'
                tail = f'"\\n```" {lit(_DS[3])}'
            elif syntax.name == "deepseek_v31":
                head, tail = f'{lit(_DS[2])} "{n}" {lit(_DS[4])}', lit(_DS[3])
            else:  # kimi_k2
                head = f'{lit("<|tool_call_begin|>")} "functions.{n}:" /[0-9]+/ {lit("<|tool_call_argument_begin|>")}'
                tail = lit("<|tool_call_end|>")
            rules.append(f"fn{i}: {head} args{i} {tail}")
            rules.append(f"args{i}: {json_rule(s)}")
        call = " | ".join(f"fn{i}" for i in range(len(functions)))
    rules.append(f"call: {call}")
    sequence = "call"
    if parallel and syntax.parallel:
        sequence = f"call ({json.dumps(syntax.separator)} call)*" if syntax.separator else "call+"
    if syntax.section_begin:
        sequence = f"{lit(syntax.section_begin)} {sequence} {lit(syntax.section_end)}"
    return "\n".join([f"start: {sequence}"] + rules) + "\n"
