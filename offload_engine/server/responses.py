"""OpenAI response bodies: a whole completion, stream chunks, usage (with the prompt tokens served from the reused
cache as cached_tokens) and logprobs in the chat shape ({"content": [...]}) or the completions shape (parallel
lists). Logprobs are the model's own: log_softmax of its raw logits (sampling.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from ..generate.decoder import FinishEvent
from ..generate.sampling import TokenLogprob

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # the engine's reasons in OpenAI's words


@dataclass(frozen=True)
class Shape:
    """What one response looks like: its endpoint, the logprobs asked for and the echoed prompt text."""
    chat: bool
    tokenizer: Any
    logprobs: bool = False
    echo: str = ""  # completions: the prompt text returned before the answer (echo: true)
    tools: Any = None  # chat: the ToolPlan (tools.py) when tools are offered: the answer may be tool calls


def token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _entry(tokenizer: Any, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(records: Sequence[TokenLogprob], tokenizer: Any) -> dict:
    content = [{**_entry(tokenizer, r.token_id, r.logprob),
                "top_logprobs": [_entry(tokenizer, t, lp) for t, lp in r.top]} for r in records]
    return {"content": content, "refusal": None}


def completion_logprobs(records: Sequence[TokenLogprob], tokenizer: Any, offset: int) -> dict:
    """offset: where the first token's text starts in the returned text (after an echoed prompt)."""
    tokens = [token_text(tokenizer, r.token_id) for r in records]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top = [{token_text(tokenizer, t): lp for t, lp in r.top} for r in records]
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records], "top_logprobs": top,
            "text_offset": offsets}


def logprobs_body(shape: Shape, records: Sequence[TokenLogprob] | None, offset: int = 0) -> dict | None:
    if not shape.logprobs or records is None:
        return None
    if shape.chat:
        return chat_logprobs(records, shape.tokenizer)
    return completion_logprobs(records, shape.tokenizer, offset)


def usage(prompt_tokens: int, finish: FinishEvent) -> dict:
    n = len(finish.token_ids)
    cached = int(finish.stats.get("reused_prompt_tokens", 0))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": cached}}


def complete(meta: dict, shape: Shape, finish: FinishEvent, prompt_tokens: int) -> dict:
    reason = FINISH.get(finish.reason, finish.reason)
    logprobs = logprobs_body(shape, finish.logprobs, len(shape.echo))
    if shape.chat:
        message = {"role": "assistant", "content": finish.text}
        if shape.tools is not None:
            message, reason = shape.tools.message(finish)
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": shape.echo + finish.text, "logprobs": logprobs, "finish_reason": reason}
    return {**meta, "object": "chat.completion" if shape.chat else "text_completion", "choices": [choice],
            "usage": usage(prompt_tokens, finish), "offload_engine": jsonable(finish.stats)}


def chunk(meta: dict, shape: Shape, text: str | None, reason: str | None, first: bool = False,
          logprobs: dict | None = None, delta: dict | None = None) -> dict:
    """`delta` (chat): the delta as it is, e.g. {"tool_calls": [...]}, in place of the text's."""
    if shape.chat:
        if delta is None:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {**meta, "object": "chat.completion.chunk", "choices": [choice]}
    return {**meta, "object": "text_completion", "choices": [{"index": 0, "text": text or "", "logprobs": logprobs,
                                                               "finish_reason": reason}]}


def sse_line(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def jsonable(stats: dict) -> dict:
    return json.loads(json.dumps(stats, default=str))
