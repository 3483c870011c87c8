"""SentencePiece vocabularies in GGUF metadata (`tokenizer.ggml.model` "llama": Llama 2, Mistral, Mixtral files),
built by checkpoint/gguf/spm.py: checked against transformers' own GGUF tokenizer loading and llama.cpp's own
tokenizer (where its CPU build is cached) on a vocabulary trained here, against llama.cpp's expected ids on the real
Llama 2 vocabulary its sources ship, and through `Engine` and `run --model file.gguf` on a tiny Llama whose GGUF
carries the trained vocabulary.

transformers builds "llama" with `Metaspace(prepend_scheme="first")` and Phi-3 with the `Prepend("▁")` normalizer;
the engine uses the latter for both, as llama.cpp and SentencePiece do (spm.py). So the engine equals transformers
exactly on a file that says phi3, and on a "llama" file equals transformers given the text with one space in front
(where no added token splits it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from offload_engine import Engine
from offload_engine.checkpoint.gguf.spm import merges_from_scores
from offload_engine.errors import ConfigError
from offload_engine.tokenizer import Tokenizer
from tools import llama_tokenize
from tools.gguf_from_hf import write_gguf
from tools.llama_peer import source_dir
from tests.llama_cpp_build import require_llama_cpp

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
UNKNOWN, NORMAL, CONTROL, USER_DEFINED, BYTE = 2, 1, 3, 4, 6  # gguf.TokenType
EXTRA = [("[INST]", CONTROL), ("[/INST]", CONTROL), ("<think>", USER_DEFINED)]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
            "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
PLAIN = ["Hello world", "Hello, world! How are you?", "def f(x):\n    return x + 1\n", "line one\ntwo\n\n", "\ttab",
         "multiple   spaces  inside", "trailing spaces   ", "héllo wörld ñandú", "emoji 🚀 and 中文 and ½ months", "🦙.cpp",
         "x" * 60, "<0x41> is not a byte token", "a\r\nb", "\n", "ÿ"]
LEADING = [" Hello", "  two leading spaces", "   three", " ", "  ", "\n leading newline", " 🚀"]
ADDED = ["<s>[INST] What is 2+2? [/INST] 4</s>", "[INST]no spaces[/INST]answer</s>", "a<think>b c</think>",
         "<unk> unknown", "</s></s>", "text then <s>", "[INST] héllo 🚀 [/INST]"]
STRINGS = PLAIN + LEADING + ADDED + [""]


def spm_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary of `size` pieces as llama.cpp's converter writes one: <unk> <s> </s>, the
    256 byte pieces, added tokens, then the pieces of a BPE trained here on the stdlib with Metaspace (each merge's
    piece scored minus its rank) and its alphabet last, scored lowest; emoji and CJK are left to byte fallback."""
    from tokenizers import SentencePieceBPETokenizer

    tok = SentencePieceBPETokenizer()
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib] + ["héllo wörld ñandú déjà vu " * 50]
    tok.train_from_iterator(texts, vocab_size=4 * size, limit_alphabet=120, show_progress=False)
    model = json.loads(tok.to_str())["model"]
    merged = [a + b for a, b in (m if isinstance(m, list) else m.split(" ") for m in model["merges"])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [t for t, _ in EXTRA]
    alphabet = [t for t in model["vocab"] if t not in set(merged) | set(tokens)]  # (its own <unk> left out)
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [ty for _, ty in EXTRA]
    scores = [0.0] * len(tokens)
    room = size - len(tokens) - len(alphabet)
    assert room > 50, "vocabulary too small for the alphabet"
    pieces = list(dict.fromkeys(p for p in merged if p not in tokens))[:room]
    tokens += pieces + alphabet
    scores += [-float(i) for i in range(len(pieces))] + [-float(len(pieces) + i) for i in range(len(alphabet))]
    types += [NORMAL] * (len(pieces) + len(alphabet))
    return tokens, scores, types


def tokenizer_kv(w, vocab, *, prefix: bool = True, add_bos: bool = True, template: str | None = TEMPLATE) -> None:
    tokens, scores, types = vocab
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(prefix)
    if template is not None:
        w.add_chat_template(template)


def write_vocab(path: Path, vocab, arch: str = "llama", **options) -> Path:
    """A vocabulary-only GGUF (as llama.cpp's models/ggml-vocab-*.gguf)."""
    w = gguf.GGUFWriter(path, arch)
    tokenizer_kv(w, vocab, **options)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def reference(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def vocab():
    return spm_vocab(1200)


@pytest.fixture(scope="module")
def files(vocab, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("spm")
    return {"llama": write_vocab(d / "llama.gguf", vocab), "phi3": write_vocab(d / "phi3.gguf", vocab, "phi3"),
            "no-prefix": write_vocab(d / "no-prefix.gguf", vocab, prefix=False)}


def test_vocabulary_is_sentencepiece_shaped(vocab):
    tokens, scores, types = vocab
    assert len(tokens) == len(set(tokens)) == 1200 and "\u2581" in tokens
    merges = merges_from_scores(tokens, scores)
    assert merges and all(a + b in tokens for a, b in merges)


@pytest.mark.parametrize("special", [True, False])
def test_equals_transformers_on_every_string(files, special):
    """The llama.cpp-style space prefix: transformers' own builder for it (the phi3 file) on every string."""
    ours, theirs = Tokenizer.load_optional(files["llama"]), reference(files["phi3"])
    for text in STRINGS:
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == theirs.encode(text, add_special_tokens=special), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert ours.encode("byte 🚀")[-4:] == [3 + b for b in "🚀".encode()]  # the byte pieces, as llama.cpp


def test_equals_transformers_llama_loader_given_a_leading_space(files):
    """transformers' "llama" builder adds no "▁" to text that starts with a space (and so loses that space on the
    way back); the engine, as llama.cpp, does: the two agree once that space is written out, and differ on the text
    as given exactly there. The decoders are the same."""
    ours, theirs = Tokenizer.load_optional(files["llama"]), reference(files["llama"])
    for text in PLAIN + LEADING:
        ids = ours.encode(text)
        assert ids == theirs.encode(" " + text) and (ids == theirs.encode(text)) == (not text.startswith(" ")), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == text, text


@pytest.mark.parametrize("name", ["llama", "no-prefix"])
def test_equals_llama_cpp_on_every_string(files, name):
    """llama.cpp's own llama_tokenize on the same file (tools/llama_tokenize.py), BOS as the file says and without,
    with and without `add_space_prefix` (which transformers' loader does not read: it always prefixes)."""
    require_llama_cpp()
    assert llama_tokenize.available(), "llama.cpp is built but the sdist's llama_cpp bindings or libllama.so are missing"
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "llama_tokenize.py"), str(files[name])],
                         input=json.dumps(STRINGS), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    theirs, ours = json.loads(out.stdout), Tokenizer.load_optional(files[name])
    for text, with_special, without in zip(STRINGS, theirs["with_special"], theirs["without"], strict=True):
        assert ours.encode(text) == with_special and ours.encode(text, add_special_tokens=False) == without, text


def test_fields_and_chat_template_from_the_metadata(files):
    ours, theirs = Tokenizer.load_optional(files["llama"]), reference(files["phi3"])
    assert (ours.bos_token, ours.bos_token_id, ours.eos_token, ours.eos_token_ids) == ("<s>", 1, "</s>", {2})
    assert ours.chat_template == TEMPLATE and ours.encode("hi")[0] == 1
    chat = [{"role": "user", "content": "héllo 🚀"}, {"role": "assistant", "content": "hi there"},
            {"role": "user", "content": "  and now?"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=False)
    assert ours.encode_chat(chat) == list(theirs.apply_chat_template(chat, tokenize=True, return_dict=False))


def test_real_llama2_vocabulary_matches_llama_cpp():
    """llama.cpp's own test of its SentencePiece tokenizer: models/ggml-vocab-llama-spm.gguf (Llama 2's 32000
    pieces) and the ids llama.cpp expects for each text (.inp / .out, tokenized without BOS)."""
    models = source_dir() / "models"
    if not (models / "ggml-vocab-llama-spm.gguf.out").is_file():
        pytest.skip("llama.cpp's sources not cached (python tools/llama_peer.py fetch)")
    for name in ("llama-spm", "phi-3"):
        path = models / f"ggml-vocab-{name}.gguf"
        # each text ends in the separator line, each line of ids in a newline
        texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
        expected = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")[:-1]
        assert len(texts) == len(expected) >= 40
        ours = Tokenizer.load_optional(path)
        for text, ids in zip(texts, expected):
            got = ours.encode(text, add_special_tokens=False)
            assert got == [int(i) for i in ids.split()] and ours.decode(got) == text, (name, text)


@pytest.mark.parametrize("kind", ["t5", "bert", "rwkv", None])
def test_other_tokenizer_models_refused_by_name(tmp_path, vocab, kind):
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    if kind is not None:
        w.add_tokenizer_model(kind)
    w.add_token_list(vocab[0])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ConfigError, match=rf"m\.gguf: tokenizer\.ggml\.model {kind!r} is not supported"):
        Tokenizer.load_optional(tmp_path / "m.gguf")


def test_missing_scores_refused(tmp_path, vocab):
    tokens, scores, types = vocab
    path = write_vocab(tmp_path / "m.gguf", (tokens, scores[:10], types))
    with pytest.raises(ConfigError, match=r"m\.gguf: tokenizer\.ggml\.scores has 10 entries for 1200 tokens"):
        Tokenizer.load_optional(path)


# ---- a model: Engine and `run --model file.gguf` ------------------------------------------------------------------
def with_tokenizer(src: Path, dst: Path, vocab) -> Path:
    """`src` (a GGUF) rewritten with the SentencePiece vocabulary in place of its own tokenizer metadata."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith(("GGUF.", "tokenizer.")):
            continue
        kind = field.types[0]
        w.add_key_value(field.name, field.contents(), kind,
                        sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    tokenizer_kv(w, vocab)
    for t in reader.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(t.data)
    w.close()
    return dst


def test_engine_and_cli_run_with_the_sentencepiece_vocabulary(checkpoint_factory, tmp_path):
    folder = checkpoint_factory("llama")
    n_vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    vocab = spm_vocab(n_vocab)
    (plain,) = write_gguf(folder, tmp_path / "bpe.gguf")
    path = with_tokenizer(plain, tmp_path / "spm.gguf", vocab)
    prompt = "def main():\n    print('héllo 🚀')"
    standalone = Tokenizer.load_optional(write_vocab(tmp_path / "vocab.gguf", vocab))
    with Engine.open(path, max_context=96) as engine:
        ids = engine.tokenizer.encode(prompt)
        assert ids == standalone.encode(prompt) and ids[0] == 1 and engine.tokenizer.chat_template == TEMPLATE
        done = engine.generate(prompt, max_new_tokens=8)
        assert done.token_ids == engine.generate(ids, max_new_tokens=8).token_ids
        # the text as the SentencePiece vocabulary streams it (a random model emits stray bytes, where a full decode
        # can differ: tokenizers' ByteFallback turns a whole run of bytes that is not UTF-8 into U+FFFDs)
        stream = standalone.stream_decoder()
        assert done.text == "".join(stream.push(i) for i in done.token_ids) + stream.flush()
        chat = engine.chat([{"role": "user", "content": "hi"}], max_new_tokens=4)
        assert chat.token_ids == engine.generate(standalone.encode_chat([{"role": "user", "content": "hi"}]),
                                                 max_new_tokens=4).token_ids
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-c", "import sys; from offload_engine.cli import main; sys.exit(main())"]
    out = subprocess.run(cli + ["run", "--model", str(path), "--prompt", prompt, "--max-new-tokens", "8", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (result["token_ids"], result["text"]) == (done.token_ids, done.text)
