"""The plain decode loop, driven by a fake model whose logits depend only on (last token, position)."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from offload_engine.errors import ConfigError
from offload_engine.generate.decoder import (FinishEvent, GenerationState, TokenEvent, decode_stream, drive)
from offload_engine.generate.sampling import SamplingParams
from offload_engine.tokenizer import Tokenizer

EOS_TEXT = "<|endoftext|>"


# ---------------------------------------------------------------------------------------------- fakes

def _byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: one token per UTF-8 byte, so multi-byte characters span tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS_TEXT])
    eos = backend.token_to_id(EOS_TEXT)
    return Tokenizer.from_backend(backend, eos_token=EOS_TEXT, eos_token_ids={eos})


TOK = _byte_tokenizer()
EOS = TOK.token_to_id(EOS_TEXT)
VOCAB = TOK.vocab_size


class FakeCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def trim(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n:]


class FakeLM:
    """Row for position q scores next_fn(token at q, q); `sharp` controls how peaked the distribution is."""

    vocab_size = VOCAB

    def __init__(self, next_fn, sharp: float = 20.0):
        self.next_fn = next_fn
        self.sharp = sharp
        self.calls: list[int] = []  # T of each forward
        self.rows: list[int] = []  # logits rows each forward returned
        self.caches: list[FakeCache] = []

    def new_cache(self, max_tokens: int) -> FakeCache:
        self.caches.append(FakeCache(max_tokens))
        return self.caches[-1]

    def forward(self, tokens: torch.Tensor, cache: FakeCache, last_only: bool = False) -> torch.Tensor:
        assert tokens.dtype == torch.long and tokens.dim() == 1
        self.calls.append(len(tokens))
        start = cache.length
        assert start + len(tokens) <= cache.max_tokens, "cache overflow"
        cache.tokens.extend(tokens.tolist())
        rows = []
        for offset, token in enumerate(tokens.tolist()):
            pos = start + offset
            gen = torch.Generator().manual_seed(token * 1000 + pos)  # deterministic mild noise
            row = torch.rand(VOCAB, generator=gen)
            row[self.next_fn(token, pos) % VOCAB] += self.sharp
            rows.append(row)
        rows = rows[-1:] if last_only else rows
        self.rows.append(len(rows))
        return torch.stack(rows).float()


def script_model(prompt: list[int], script: list[int], filler: int | None = None, **kw) -> FakeLM:
    """Greedy output = script (then filler); also checks the loop feeds back what it generated."""
    filler = TOK.encode("x")[0] if filler is None else filler
    expected = prompt + script

    def next_fn(token: int, pos: int) -> int:
        if pos < len(expected):
            assert token == expected[pos], f"position {pos}: fed {token}, expected {expected[pos]}"
        gen_index = pos + 1 - len(prompt)
        return script[gen_index] if gen_index < len(script) else filler

    return FakeLM(next_fn, **kw)


def run(model, prompt, params, tokenizer=TOK, cache=None) -> tuple[list[TokenEvent], FinishEvent]:
    events = list(decode_stream(model, prompt, params, tokenizer, cache))
    *tokens, finish = events
    assert all(isinstance(e, TokenEvent) for e in tokens) and isinstance(finish, FinishEvent)
    assert [e.token_id for e in tokens] == finish.token_ids
    assert "".join(e.text for e in tokens) == finish.text, "streamed text differs from the final text"
    return tokens, finish


PROMPT = TOK.encode("Q: ")


# ---------------------------------------------------------------------------------------------- stopping

def test_greedy_stops_at_eos():
    script = TOK.encode("hi there") + [EOS] + TOK.encode("never")
    model = script_model(PROMPT, script)
    events, finish = run(model, PROMPT, SamplingParams(max_new_tokens=50))
    assert finish.reason == "eos"
    assert finish.token_ids == TOK.encode("hi there") + [EOS]  # the EOS id is kept, as transformers does
    assert finish.text == "hi there" and events[-1].text == ""
    assert finish.prefill_tokens == len(PROMPT)
    assert model.calls == [len(PROMPT)] + [1] * (len(finish.token_ids) - 1)
    assert model.caches[0].max_tokens == len(PROMPT) + 50


def test_the_prompt_asks_for_its_last_row_of_logits_only():
    """The prefill's other rows would be P x vocab floats and P x vocab x hidden products nobody reads."""
    model = script_model(PROMPT, TOK.encode("ab"))
    run(model, PROMPT, SamplingParams(max_new_tokens=2))
    assert model.calls[0] == len(PROMPT) > 1 and model.rows == [1, 1]


def test_greedy_stops_at_max_tokens():
    model = script_model(PROMPT, TOK.encode("abcdefghij"))
    _, finish = run(model, PROMPT, SamplingParams(max_new_tokens=4))
    assert finish.reason == "length" and finish.text == "abcd" and len(finish.token_ids) == 4
    assert finish.prefill_s >= 0 and finish.decode_s >= 0


@pytest.mark.parametrize("stop", [("STOP",), ("OP m", "STOP"), ("ST",)], ids=repr)
def test_stop_string_truncates_and_never_leaks(stop):
    script = TOK.encode("abc STOP more text")
    model = script_model(PROMPT, script)
    events, finish = run(model, PROMPT, SamplingParams(max_new_tokens=100, stop=stop))
    assert finish.reason == "stop" and finish.text == "abc "
    streamed = ""
    for event in events:
        streamed += event.text
        assert finish.text.startswith(streamed), f"leaked {streamed!r}"
    completing = TOK.encode("abc ST" if stop == ("ST",) else "abc STOP")
    assert finish.token_ids == completing  # generation ends on the token that completed the stop string


def test_stop_string_with_multibyte_text_and_holdback():
    text = "héllo 🙂 wörld END tail"
    model = script_model(PROMPT, TOK.encode(text))
    events, finish = run(model, PROMPT, SamplingParams(max_new_tokens=200, stop=["END"]))
    assert finish.text == "héllo 🙂 wörld " and finish.reason == "stop"
    assert not any("\ufffd" in e.text for e in events)
    assert any(e.text == "" for e in events[:-1]), "split characters should be held back"


def test_streamed_text_equals_final_text_with_multibyte_characters():
    text = "héllo wörld 你好 🙂"
    model = script_model(PROMPT, TOK.encode(text) + [EOS])
    events, finish = run(model, PROMPT, SamplingParams(max_new_tokens=200))
    assert finish.text == text
    assert not any("\ufffd" in e.text for e in events)


def test_length_cut_mid_character_flushes_replacement():
    emoji = TOK.encode("🙂")
    model = script_model(PROMPT, emoji)
    _, finish = run(model, PROMPT, SamplingParams(max_new_tokens=len(emoji) - 1))
    assert finish.reason == "length" and finish.text.endswith("\ufffd")


def test_ignore_eos_continues_but_stop_token_ids_still_stop():
    stop_id = TOK.encode("!")[0]
    script = TOK.encode("ab") + [EOS] + TOK.encode("cd!ef")
    _, finish = run(script_model(PROMPT, script), PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert finish.reason == "length" and finish.text == "abcd!"
    params = SamplingParams(max_new_tokens=50, ignore_eos=True, stop_token_ids=[stop_id])
    _, finish = run(script_model(PROMPT, script), PROMPT, params)
    assert finish.reason == "eos" and finish.text == "abcd" and finish.token_ids[-1] == stop_id


def test_without_tokenizer_ids_only():
    script = [5, 6, 7, EOS]
    _, finish = run(script_model(PROMPT, script), PROMPT, SamplingParams(max_new_tokens=10), tokenizer=None)
    assert finish.reason == "length" and finish.text == "" and finish.token_ids[:4] == script  # no EOS ids known
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(EOS,))
    _, finish = run(script_model(PROMPT, script), PROMPT, params, tokenizer=None)
    assert finish.reason == "eos" and finish.token_ids == script


# ---------------------------------------------------------------------------------------------- arguments

def test_empty_prompt_fails_at_the_call():
    with pytest.raises(ConfigError, match="prompt is empty"):
        decode_stream(script_model([], []), [], SamplingParams(), TOK)


def test_out_of_range_prompt_ids():
    with pytest.raises(ConfigError, match=r"prompt token ids must be in \[0, "):
        decode_stream(script_model([], []), [VOCAB + 3], SamplingParams(), TOK)


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ConfigError, match="stop strings need a tokenizer"):
        decode_stream(script_model(PROMPT, []), PROMPT, SamplingParams(stop=["x"]), None)


def test_given_cache_is_used():
    model = script_model(PROMPT, TOK.encode("ok") + [EOS])
    cache = FakeCache(100)
    _, finish = run(model, PROMPT, SamplingParams(), cache=cache)
    assert not model.caches and cache.length == len(PROMPT) + len(finish.token_ids) - 1


def test_consumer_can_stop_early():
    model = script_model(PROMPT, TOK.encode("abcdef"))
    stream = decode_stream(model, PROMPT, SamplingParams(max_new_tokens=6), TOK)
    first = next(stream)
    assert isinstance(first, TokenEvent) and first.text == "a"
    stream.close()
    assert model.calls == [len(PROMPT)]


# ---------------------------------------------------------------------------------------------- sampling

def test_sampling_is_seeded_and_reproducible():
    model = FakeLM(lambda token, pos: (token * 7 + pos) % 64, sharp=1.0)
    params = SamplingParams(temperature=1.0, top_k=50, seed=123, max_new_tokens=30, ignore_eos=True)
    _, a = run(model, PROMPT, params)
    _, b = run(model, PROMPT, params)
    _, c = run(model, PROMPT, SamplingParams(temperature=1.0, top_k=50, seed=124, max_new_tokens=30,
                                               ignore_eos=True))
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    greedy = FakeLM(lambda token, pos: (token * 7 + pos) % 64, sharp=1.0)
    _, g = run(greedy, PROMPT, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert g.token_ids != a.token_ids  # sharp=1 leaves real randomness for sampling to show


# ---------------------------------------------------------------------------------------------- seam

class ListStepper:
    """A stand-in for a speculative stepper: returns several accepted ids per step."""

    def __init__(self, chunks: list[list[int]]):
        self.chunks = chunks
        self.last_tokens: list[int] = []
        self.unused: int | None = None

    def prefill(self, prompt_ids: list[int]) -> list[int]:
        return self.chunks.pop(0)

    def step(self, last_token: int) -> list[int]:
        self.last_tokens.append(last_token)
        return self.chunks.pop(0)

    def finish(self, unused: int) -> None:
        self.unused = unused


def test_drive_stops_mid_chunk_and_reports_unused_ids():
    a, b, c, d = TOK.encode("abcd")
    stepper = ListStepper([[a], [b, c, EOS, d, d], [d]])
    events = list(drive(stepper, PROMPT, GenerationState(SamplingParams(max_new_tokens=20), TOK)))
    finish = events[-1]
    assert finish.token_ids == [a, b, c, EOS] and finish.text == "abc" and finish.reason == "eos"
    assert stepper.last_tokens == [a] and stepper.unused == 2
    assert len(events) == 5


def test_state_rejects_tokens_after_finish():
    state = GenerationState(SamplingParams(max_new_tokens=1), TOK)
    state.add(TOK.encode("a")[0])
    assert state.finished and state.finish_reason == "length"
    with pytest.raises(RuntimeError):
        state.add(1)
