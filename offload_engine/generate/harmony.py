"""gpt-oss's harmony format (openai/harmony's docs/format.md): the answer's messages read back into content and a tool
call, and the grammar that forces a call.

After the prompt's `<|start|>assistant` the model writes messages, each `{header}<|message|>{body}` closed by
`<|end|>` (another `<|start|>{header}...` follows), `<|call|>` (a tool call: the turn stops) or `<|return|>`:
  <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
  to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
The header names the channel after `<|channel|>` and the recipient as `to=functions.NAME` (in the role part or the
channel part); `<|constrain|>json` says the body is JSON. Read back: a message to `functions.NAME` is a call (the
body its arguments, as written); `final` and recipient-less `commentary` (a preamble) are content; `analysis` (the
chain of thought) is dropped (the server has no reasoning field); messages to built-in tools (browser, python),
which are never offered, are dropped. One call per turn: `<|call|>` stops the turn.

The text read is CallText's: the engine's text with the harmony special tokens kept as their text (the rendering
is the chat template's, which gets `tools=` like the other syntaxes). `parse(text, final=False)` on a growing text
returns content and a call that only ever grow, as tool_calls.parse does."""
from __future__ import annotations

import re
from typing import Callable, Sequence

from .tool_parsed import Parsed, ParsedCall, json_rule

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)  # tool_calls.SYNTAXES["harmony"].markers
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_FUNCTION = re.compile(r"functions\.([A-Za-z0-9_-]{1,64})")
CONTENT_CHANNELS = ("final", "commentary")


def parse(text: str, final: bool = True) -> Parsed:
    """The answer's content and call (see the module docstring). Final, a text with no harmony message in it (a
    model that ignored the format) is all content."""
    if MESSAGE not in text:
        return Parsed(text if final else "")
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos, first = 0, True
    while pos < len(text):
        if not first:
            if not text.startswith(START, pos):
                break  # text after a message that starts none: dropped
            pos += len(START)
        first = False
        at = text.find(MESSAGE, pos)
        if at < 0:
            break  # the header is not complete yet (or, final, never was: nothing to read)
        role, channel, recipient = _header(text[pos:at])
        if role not in ("", "assistant"):
            break  # the model writing another author's message (a tool's answer): not the assistant's turn
        start = at + len(MESSAGE)
        ends = [(i, m) for m in (END, CALL, RETURN) if (i := text.find(m, start)) >= 0]
        if ends:
            end, marker = min(ends)
            body, closed, pos = text[start:end], True, end + len(marker)
        else:
            body = text[start:] if final else text[start:len(text) - _partial_marker(text)]
            closed, pos, marker = final, len(text), RETURN
        if recipient is not None:
            name = _FUNCTION.fullmatch(recipient)
            if name is not None:
                calls.append(ParsedCall(name.group(1), body, closed))
                break  # one call a turn: <|call|> ends it
        elif channel in CONTENT_CHANNELS:
            content.append(body)
        if marker != END:
            break
    return Parsed("".join(content), calls)


def _header(header: str) -> tuple[str, str | None, str | None]:
    """(role, channel, recipient) of a message header: `[role][ to=R]<|channel|>channel[ to=R][ <|constrain|>json]`
    (the first message's role is in the prompt, so its header starts at `<|channel|>`)."""
    role_part, _, channel_part = header.partition(CHANNEL)
    recipient = _RECIPIENT.search(header)
    words = _RECIPIENT.sub(" ", channel_part.replace(CONSTRAIN, " ")).split()
    return (role_part.split(" ")[0].strip(), words[0] if words else None,
            recipient.group(1) if recipient is not None else None)


def _partial_marker(text: str) -> int:
    """How many trailing characters may still become a marker (held back while streaming)."""
    i = text.rfind("<", max(0, len(text) - max(len(m) for m in MARKERS)))
    return len(text) - i if i >= 0 and any(m.startswith(text[i:]) for m in MARKERS) else 0


def call_grammar(functions: Sequence[tuple[str, dict]], lit: Callable[[str], str], call_ends: bool) -> str:
    """A Lark grammar (llguidance) whose sentences are one call to one of `functions` ((name, parameters schema)):
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{arguments}`, then `<|call|>` unless
    `call_ends` (the tokenizer's EOS includes <|call|>, as gpt-oss's generation_config lists it: the grammar's end
    lets it through)."""
    rules = []
    for i, (name, schema) in enumerate(functions):
        tail = "" if call_ends else " " + lit(CALL)
        rules.append(f'fn{i}: {lit(CHANNEL)} "commentary to=functions.{name} " {lit(CONSTRAIN)} "json" '
                     f'{lit(MESSAGE)} args{i}{tail}')
        rules.append(f"args{i}: {json_rule(schema)}")
    return "\n".join(["start: " + " | ".join(f"fn{i}" for i in range(len(functions)))] + rules) + "\n"
