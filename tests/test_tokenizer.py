"""Tokenizer wrapper: loading, special ids, chat templates, errors, and the streaming decoder."""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from offload_engine.errors import CheckpointError, ConfigError
from offload_engine.tokenizer import StreamDecoder, Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
]
UNICODE = "héllo wörld 你好 🙂 — naïve café ∑"


def _train() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 5, trainer)
    return tok


def _write(folder: Path, backend: HFTokenizer, tok_config: dict | None = None, **extra_json: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    config.update(tok_config or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, data in extra_json.items():
        (folder / f"{name}.json").write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def backend() -> HFTokenizer:
    return _train()


@pytest.fixture()
def tok(tmp_path, backend) -> Tokenizer:
    return Tokenizer(_write(tmp_path / "ckpt", backend))


# ---------------------------------------------------------------------------------------------- encode/decode

@pytest.mark.parametrize("text", [CORPUS[1], UNICODE, "", "  leading and trailing  \n"])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids_and_skipped_on_decode(tok):
    im_start = tok.token_to_id("<|im_start|>")
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == im_start
    assert tok.decode(ids) == "user"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user"


def test_eos_ids_merge_all_config_files(tmp_path, backend):
    folder = _write(tmp_path / "c", backend, {"eos_token": {"content": "<|im_end|>", "special": True},
                                              "bos_token": {"content": "<|endoftext|>"}},
                    generation_config={"eos_token_id": [0, 2]}, config={"text_config": {"eos_token_id": 1}})
    tok = Tokenizer(folder)
    assert tok.eos_token_ids == frozenset({0, 1, 2})
    assert tok.bos_token_id == backend.token_to_id("<|endoftext|>") == 0
    assert tok.bos_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"


def test_eos_from_config_int_and_no_bos(tmp_path, backend):
    folder = _write(tmp_path / "c", backend, {"eos_token": None}, config={"eos_token_id": 0})
    tok = Tokenizer(folder)
    assert tok.eos_token_ids == frozenset({0})
    assert tok.bos_token_id is None


def test_add_bos_token_applies_when_tokenizer_json_has_no_post_processor(tmp_path, backend):
    assert backend.post_processor is None
    folder = _write(tmp_path / "c", backend, {"bos_token": "<|endoftext|>", "add_bos_token": True})
    tok = Tokenizer(folder)
    assert tok.encode("def")[0] == 0
    assert tok.encode("def", add_special_tokens=False)[0] != 0
    assert tok.decode(tok.encode("def")) == "def"


def _with_bos_post_processor(backend: HFTokenizer) -> HFTokenizer:
    copy = HFTokenizer.from_str(backend.to_str())
    copy.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                                        special_tokens=[("<|endoftext|>", 0)])
    return copy


def test_tokenizer_json_post_processor_wins_over_flags(tmp_path, backend):
    folder = _write(tmp_path / "c", _with_bos_post_processor(backend),
                    {"bos_token": "<|endoftext|>", "add_bos_token": False})
    assert Tokenizer(folder).encode("def")[0] == 0


@pytest.mark.parametrize("bos_post_processor", [False, True])
def test_matches_transformers(tmp_path, backend, bos_post_processor):
    transformers = pytest.importorskip("transformers")
    if bos_post_processor:
        backend = _with_bos_post_processor(backend)
    folder = _write(tmp_path / "c", backend, {"bos_token": "<|endoftext|>"})
    ours = Tokenizer(folder)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": UNICODE}]
    for text in (CORPUS[0], UNICODE):
        assert ours.encode(text) == ref.encode(text)
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    for gen_prompt in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen_prompt) == \
            ref.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=False)
    ref_ids = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref_ids = ref_ids["input_ids"] if not isinstance(ref_ids, list) else ref_ids
    assert ours.encode_chat(messages) == list(ref_ids)
    ids = ours.encode_chat(messages)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------- chat templates

def test_chatml_rendering(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    assert tok.apply_chat_template(messages[:1]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode_chat(messages[:1])
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(messages[:1])


def test_template_helpers_and_whitespace_control(tmp_path, backend):
    template = (
        "{{ bos_token }}\n"
        "{% for m in messages %}\n"
        "    {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}\n"
        "    {{ m['content'] | tojson }}|\n"
        "{% endfor %}\n"
        "{% if extra %}{{ extra }}{% endif %}"
    )
    folder = _write(tmp_path / "c", backend, {"bos_token": "<|endoftext|>"})
    (folder / "chat_template.jinja").write_text(template)  # takes precedence over tokenizer_config's
    tok = Tokenizer(folder)
    out = tok.apply_chat_template([{"role": "user", "content": "a<b>&\"c\""}], extra="X")
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one (not
    # before an expression); tojson does not HTML-escape
    assert out == '<|endoftext|>\n    "a<b>&\\"c\\""|\nX'
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": ""}])


def test_template_sandbox_blocks_attribute_escape(tmp_path, backend):
    folder = _write(tmp_path / "c", backend, {"chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer(folder).apply_chat_template([])


def test_missing_chat_template_is_a_config_error(tmp_path, backend):
    folder = _write(tmp_path / "c", backend, {"chat_template": None})
    with pytest.raises(ConfigError, match="no chat_template"):
        Tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------------------------- errors

def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(CheckpointError) as err:
        Tokenizer(tmp_path)
    assert err.value.path == str(tmp_path / "tokenizer.json")
    assert "tokenizer.json not found" in str(err.value) and err.value.hint


def test_invalid_config_json_names_the_file(tmp_path, backend):
    folder = _write(tmp_path / "c", backend)
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError) as err:
        Tokenizer(folder)
    assert err.value.path.endswith("generation_config.json") and "invalid JSON" in str(err.value)


def test_invalid_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{\"model\": 3")
    with pytest.raises(CheckpointError) as err:
        Tokenizer(tmp_path)
    assert err.value.path.endswith("tokenizer.json")


# ---------------------------------------------------------------------------------------------- streaming

def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = tok.stream_decoder()
    return [dec.push(i) for i in ids] + [dec.flush()]


@pytest.mark.parametrize("text", [UNICODE, CORPUS[1] + UNICODE + CORPUS[2], "🙂🙂🙂", "a"])
def test_stream_decoder_equals_full_decode(tok, text):
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_holds_back_split_characters(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1, "the tiny vocabulary should split the emoji into byte tokens"
    pieces = _stream(tok, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and pieces[len(ids) - 1] == "🙂"


def test_stream_decoder_skips_special_tokens_and_flushes_incomplete_tail(tok):
    dec = StreamDecoder(tok)
    out = "".join(dec.push(i) for i in tok.encode("<|im_start|>ok"))
    assert out == "ok"
    partial = tok.encode("你")[:-1]  # an incomplete UTF-8 sequence
    assert "".join(dec.push(i) for i in partial) == ""
    assert dec.flush().endswith("\ufffd")
    assert dec.flush() == ""
