"""A Kimi-style tokenizer folder (tiktoken.model + tokenizer_config.json, no tokenizer.json), read with tiktoken.

The BPE is trained in the test (tiny, byte-level, merges in rank order) and written in tiktoken's file format;
the expected ids come from a `tiktoken.Encoding` built here from the format's definition (Kimi's
tokenization_kimi.py: its pat_str, specials at ids N..N+255, `<|reserved_token_<id>|>` for unnamed ones).
"""
from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

import pytest
import regex
import tiktoken

from offload_engine.errors import CheckpointError
from offload_engine.tokenizer import Tokenizer

PAT_STR = "|".join([  # tokenization_kimi.py's pat_str, spelt out here independently of the engine's copy
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's the dog's day, isn't it?\n",
    "def add(a, b):\n    return a + b\n\nprint(add(12345, 678))\n",
    "你好世界，今天天气很好。我们一起去公园吧！\n",
    "Kimi K2 is a mixture-of-experts model with 384 experts; DON'T PANIC.\r\n",
]
TEXTS = CORPUS + ["héllo wörld 你好 🙂 — naïve café ∑", "  leading and trailing  \n\n\t", "MixedCASE wordsHere 1234567",
                  "中文English混合123", "", "a\u0301e\u0308 combining marks"]
SPECIAL = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
           7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}
KIMI_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
MESSAGES = [{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "你好, what's 2+2?"}]


def _train_ranks(merges: int = 1000) -> dict[bytes, int]:
    """Byte-level BPE: the 256 bytes, then the most frequent adjacent pair of each round (ranks = merge order)."""
    ranks = {bytes([b]): b for b in range(256)}
    pieces = [p for text in CORPUS for p in regex.findall(PAT_STR, text, flags=regex.V1)]  # V1: `&&` in classes
    words = [[bytes([b]) for b in piece.encode()] for piece in pieces]
    for _ in range(merges):
        pairs = Counter((w[i], w[i + 1]) for w in words for i in range(len(w) - 1))
        if not pairs:
            break
        (a, b), _count = pairs.most_common(1)[0]
        ranks[a + b] = len(ranks)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    return ranks


RANKS = _train_ranks()
N = len(RANKS)


def _write_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    path.write_bytes(b"".join(base64.b64encode(t) + b" " + str(r).encode() + b"\n" for t, r in ranks.items()))


def _kimi_folder(folder: Path, tok_config: dict | None = None, **extra_json: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    _write_ranks(folder / "tiktoken.model", RANKS)
    config = {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
              "chat_template": KIMI_TEMPLATE, "tokenizer_class": "TikTokenTokenizer",
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
              "added_tokens_decoder": {str(N + k): {"content": v, "lstrip": False, "normalized": False,
                                                    "rstrip": False, "single_word": False, "special": True}
                                       for k, v in SPECIAL.items()}}
    config.update(tok_config or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenization_kimi.py").write_text("raise SystemExit('the checkpoint Python must never be imported')\n")
    for name, data in extra_json.items():
        (folder / f"{name}.json").write_text(json.dumps(data))
    return folder


def _reference() -> tiktoken.Encoding:
    specials = {SPECIAL.get(i - N, f"<|reserved_token_{i}|>"): i for i in range(N, N + 256)}
    return tiktoken.Encoding(name="reference", pat_str=PAT_STR, mergeable_ranks=RANKS, special_tokens=specials)


@pytest.fixture(scope="module")
def ref() -> tiktoken.Encoding:
    return _reference()


@pytest.fixture()
def tok(tmp_path) -> Tokenizer:
    return Tokenizer(_kimi_folder(tmp_path / "kimi", generation_config={"eos_token_id": N + 2}))


def test_the_trained_bpe_really_merges():
    assert N > 256 + 50 and any(len(t) >= 4 for t in RANKS)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_tiktoken_and_round_trips(tok, ref, text):
    ids = tok.encode(text)
    assert ids == ref.encode(text, allowed_special="all")
    assert tok.decode(ids) == text
    if text in CORPUS:
        assert len(ids) < len(text.encode()) // 2  # merges were used


def test_han_runs_are_one_pretokenizer_piece(tok, ref):
    """The Kimi regex keeps a Han run apart from adjacent Latin letters (o200k's would not)."""
    text = "中文English"
    pieces = [ref.decode_single_token_bytes(i) for i in tok.encode(text)]
    assert b"".join(pieces) == text.encode()
    ends = {len(b"".join(pieces[:k])) for k in range(len(pieces) + 1)}
    assert len("中文".encode()) in ends  # a token ends exactly where the Han run does


def test_special_tokens_and_layout(tok, ref):
    assert tok.vocab_size == N + 256 == ref.n_vocab
    assert tok.token_to_id("<|im_end|>") == N + 2 and tok.token_to_id("[PAD]") == N + 255
    assert tok.token_to_id(f"<|reserved_token_{N + 5}|>") == N + 5
    assert tok.token_to_id("Ġ") == RANKS[b" "]  # byte-level spelling, as a converted tokenizer.json has it
    assert tok.backend.get_vocab()["Ġthe"] == RANKS[b" the"]
    text = "<|im_user|>user<|im_middle|>hi<|im_end|>"
    ids = tok.encode(text)
    assert ids == ref.encode(text, allowed_special="all")
    assert ids[0] == N + 3 and ids[-1] == N + 2 and N + 17 in ids
    assert tok.encode(text, add_special_tokens=False) == ids  # Kimi adds no BOS/EOS either way
    assert tok.decode(ids) == "userhi"
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode([N + 5, N + 300, 10**9], skip_special_tokens=False) == f"<|reserved_token_{N + 5}|>"


def test_bos_eos_ids(tok):
    assert tok.bos_token == "[BOS]" and tok.bos_token_id == N
    assert tok.eos_token == "[EOS]"
    assert tok.eos_token_ids == {N + 1, N + 2}  # tokenizer_config's eos_token + generation_config's


def test_special_false_tokens_are_kept_when_decoding(tmp_path):
    added = {str(N + k): {"content": v, "special": k != 20} for k, v in {**SPECIAL, 20: "<think>"}.items()}
    tok = Tokenizer(_kimi_folder(tmp_path / "k", {"added_tokens_decoder": added}))
    ids = tok.encode("<think>ok<|im_end|>")
    assert ids[0] == N + 20
    assert tok.decode(ids) == "<think>ok"


def test_chat_template(tok, ref):
    text = tok.apply_chat_template(MESSAGES)
    assert text == ("<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>"
                    "你好, what's 2+2?<|im_end|><|im_assistant|>assistant<|im_middle|>")
    ids = tok.encode_chat(MESSAGES)
    assert ids == ref.encode(text, allowed_special="all")
    assert ids[0] == N + 10 and ids[-1] == N + 17 and ids.count(N + 2) == 2


def test_chat_template_jinja_file_takes_precedence(tmp_path):
    folder = _kimi_folder(tmp_path / "k")
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}<|im_end|>")
    assert Tokenizer(folder).apply_chat_template(MESSAGES) == "You are Kimi.<|im_end|>"


def test_stream_decoder_matches_full_decode(tok):
    text = "".join(TEXTS)
    ids = tok.encode(text)
    dec = tok.stream_decoder()
    out = "".join(dec.push(i) for i in ids) + dec.flush()
    assert out == text


def test_long_runs_are_encoded_in_windows(tok, ref):
    text = "x" + "he" * 15_000 + " tail"  # one 30k-char run: cut at 25k (inside a "he"), as Kimi's tokenizer cuts it
    assert RANKS[b"he"]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == ref.encode(text[:25_000]) + ref.encode(text[25_000:]) != ref.encode(text)


def test_load_optional(tmp_path):
    assert Tokenizer.load_optional(tmp_path) is None
    found = Tokenizer.load_optional(_kimi_folder(tmp_path / "k"))
    assert found is not None and found.encode("hello") == _reference().encode("hello")


def test_tokenizer_json_wins_over_tiktoken_model(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models
    folder = _kimi_folder(tmp_path / "k")
    HFTokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))
    assert Tokenizer.load_optional(folder).encode("hello") == [0]


@pytest.mark.parametrize("body, expect", [
    (b"aGVsbG8= 0 extra\n", r"line 1 is not '<base64 token> <rank>'"),
    (b"!!!! 0\n", r"line 1 is not"),
    (b"YQ== x\n", r"line 1 is not"),
    (None, r"256 single-byte tokens are missing"),
    (b"YQ== 0\nYQ== 1\n", r"line 2: token b'a' listed twice"),
])
def test_malformed_ranks_file_names_it(tmp_path, body, expect):
    folder = _kimi_folder(tmp_path / "k")
    if body is None:
        _write_ranks(folder / "tiktoken.model", {t: r - 1 for t, r in RANKS.items() if t != b"\x00"})
    else:
        (folder / "tiktoken.model").write_bytes(body)
    with pytest.raises(CheckpointError, match=expect) as e:
        Tokenizer(folder)
    assert str(folder / "tiktoken.model") in str(e.value)


def test_gapped_ranks_refused(tmp_path):
    folder = _kimi_folder(tmp_path / "k")
    _write_ranks(folder / "tiktoken.model", {**RANKS, b"zzqq": N + 7})
    with pytest.raises(CheckpointError, match=r"ranks are not the ids 0\.\."):
        Tokenizer(folder)


@pytest.mark.parametrize("added, expect", [
    ({"5": {"content": "<x>"}}, r"added token '<x>' has id 5, which is a BPE rank"),
    ({"abc": {"content": "<x>"}}, r"added_tokens_decoder\['abc'\]"),
    ({str(10**6): {"content": ""}}, r"non-empty string"),
    ({str(10**6): "<x>"}, r"expected a token id"),
    ({"N0": {"content": "[BOS]"}, "N1": {"content": "[BOS]"}}, r"special token '\[BOS\]' has two ids"),
])
def test_malformed_added_tokens_name_the_config(tmp_path, added, expect):
    added = {k.replace("N0", str(N)).replace("N1", str(N + 1)): v for k, v in added.items()}
    folder = _kimi_folder(tmp_path / "k", {"added_tokens_decoder": added})
    with pytest.raises(CheckpointError, match=expect) as e:
        Tokenizer(folder)
    assert str(folder / "tokenizer_config.json") in str(e.value)


def test_added_token_beyond_the_reserved_range(tmp_path):
    added = {str(N): {"content": "[BOS]"}, str(N + 300): {"content": "<|late|>"}}
    tok = Tokenizer(_kimi_folder(tmp_path / "k", {"added_tokens_decoder": added, "eos_token": "<|late|>"}))
    assert tok.vocab_size == N + 301 and tok.encode("<|late|>") == [N + 300] and N + 300 in tok.eos_token_ids
