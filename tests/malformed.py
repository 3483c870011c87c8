"""Malformed-checkpoint generator (RELIABILITY.md section 1, F1-F16, and section 3, P1/P5). Not a test module.

`build_valid_checkpoint(dir)` writes a tiny Llama-shaped checkpoint (2 safetensors shards written with
`safetensors.torch.save_file`, `model.safetensors.index.json`, `config.json`). `VARIANTS` is a table of named
mutations; `materialize(variant, valid_dir, dest)` copies the valid fixture to `dest` and applies one mutation.

Expectations are static: the fixture is deterministic, and safetensors lays out same-dtype tensors sorted by
name, so `layout(shard)` can tell which tensor a mutation hits (tests check `layout` against the real files).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors.torch import save_file

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
DIR = "<model dir>"          # expect_file value: the message must name the model folder itself
SENTINEL = "PWNED"           # created by the pickle / auto_map payloads if anything ever runs them
HEADER_CAP_ENV = "OFFLOAD_ENGINE_HEADER_CAP"

BASE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


# ---- the valid fixture ------------------------------------------------------------------------------------
def tensor_shapes(cfg: Mapping[str, Any] = BASE_CONFIG) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint and its shape, as the config implies."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_heads * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_heads * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * hd)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (vocab, h)
    return shapes


def shard_of(name: str) -> str:
    return SHARD1 if name.startswith(("model.embed_tokens.", "model.layers.0.")) else SHARD2


def build_valid_checkpoint(out: Path, *, config_overrides: Mapping[str, Any] | None = None,
                           dtype: torch.dtype = torch.float32,
                           shape_overrides: Mapping[str, tuple[int, ...]] | None = None,
                           drop: tuple[str, ...] = (), seed: int = 0) -> Path:
    """Write the toy checkpoint into `out`. Overrides let config tests build checkpoints that disagree with
    their config (a key set to None in `config_overrides` is removed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = {**tensor_shapes(), **(shape_overrides or {})}
    gen = torch.Generator().manual_seed(seed)
    shards: dict[str, dict[str, torch.Tensor]] = {SHARD1: {}, SHARD2: {}}
    for name, shape in shapes.items():
        if name not in drop:
            shards[shard_of(name)][name] = torch.randn(shape, generator=gen).to(dtype)
    weight_map, total = {}, 0
    for shard, tensors in shards.items():
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = shard
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2))
    cfg = {**BASE_CONFIG, **(config_overrides or {})}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (out / CONFIG).write_text(json.dumps(cfg, indent=2))
    return out


def layout(shard: str) -> list[tuple[str, int, int]]:
    """(name, begin, end) of each tensor in the valid fixture's `shard`, in data order (float32, sorted by name)."""
    spans, pos = [], 0
    for name, shape in sorted(tensor_shapes().items()):
        if shard_of(name) == shard:
            n = 4
            for d in shape:
                n *= d
            spans.append((name, pos, pos + n))
            pos += n
    return spans


def data_len(shard: str) -> int:
    return layout(shard)[-1][2]


def first_tensor_past(shard: str, cut: int) -> str:
    """The first tensor (in data order) that a data section cut to `cut` bytes no longer holds entirely."""
    return next(name for name, _, end in layout(shard) if end > cut)


def next_tensor(shard: str, name: str) -> str:
    names = [n for n, _, _ in layout(shard)]
    return names[names.index(name) + 1]


# ---- byte-level helpers -------------------------------------------------------------------------------------
def read_shard(path: Path) -> tuple[dict, bytes]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_shard(path: Path, header: Any = None, data: bytes = b"", *, raw_header: bytes | None = None,
                declared: int | None = None) -> None:
    hb = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode()
    Path(path).write_bytes(struct.pack("<Q", len(hb) if declared is None else declared) + hb + data)


def header_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:  # not read_bytes(): the data section may be a huge sparse hole
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def edit_header(shard: str, fn: Callable[[dict], Any]) -> Callable[[Path], None]:
    """Mutation: apply `fn` to the parsed header of `shard` (in place, or return a replacement) and rewrite it."""
    def mutate(d: Path) -> None:
        header, data = read_shard(d / shard)
        new = fn(header)
        write_shard(d / shard, header if new is None else new, data)
    return mutate


def set_field(tensor: str, key: str, value: Any) -> Callable[[Path], None]:
    def fn(h: dict) -> None:
        if value is _DELETE:
            del h[tensor][key]
        else:
            h[tensor][key] = value
    return edit_header(shard_of(tensor), fn)


_DELETE = object()


def raw_header(shard: str, make: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    """Mutation: replace the header bytes of `shard` by `make(old_header_bytes)`, keeping the data section."""
    def mutate(d: Path) -> None:
        old = header_bytes(d / shard)
        data = (d / shard).read_bytes()[8 + len(old):]
        write_shard(d / shard, raw_header=make(old), data=data)
    return mutate


def same_length(new: bytes) -> Callable[[bytes], bytes]:
    """Header replacement padded with spaces to the old length (so only the JSON content is at fault)."""
    return lambda old: new + b" " * max(0, len(old) - len(new))


def edit_index(fn: Callable[[dict], Any]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        index = json.loads((d / INDEX).read_text())
        new = fn(index)
        (d / INDEX).write_text(json.dumps(index if new is None else new))
    return mutate


def edit_config(fn: Callable[[dict], Any]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        cfg = json.loads((d / CONFIG).read_text())
        new = fn(cfg)
        (d / CONFIG).write_text(json.dumps(cfg if new is None else new))
    return mutate


def write_file(name: str, content: bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(content)


def remove(*names: str) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        for n in names:
            (d / n).unlink()
    return mutate


def chain(*fns: Callable[[Path], None]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        for fn in fns:
            fn(d)
    return mutate


def truncate_data(shard: str, cut: int) -> Callable[[Path], None]:
    """Mutation: keep only the first `cut` bytes of `shard`'s data section."""
    return lambda d: os.truncate(d / shard, data_start(d / shard) + cut)


def truncate_file(shard: str, size_of: Callable[[Path], int]) -> Callable[[Path], None]:
    return lambda d: os.truncate(d / shard, size_of(d / shard))


def shift_data(shard: str, before: str, gap: int) -> Callable[[Path], None]:
    """Mutation: insert `gap` zero bytes before tensor `before` and move it and every later tensor accordingly."""
    def mutate(d: Path) -> None:
        header, data = read_shard(d / shard)
        at = header[before]["data_offsets"][0]
        for name, e in header.items():
            if name != "__metadata__" and e["data_offsets"][0] >= at:
                e["data_offsets"] = [e["data_offsets"][0] + gap, e["data_offsets"][1] + gap]
        write_shard(d / shard, header, data[:at] + b"\0" * gap + data[at:])
    return mutate


def add_tensor(shard: str, name: str, nbytes: int = 256) -> Callable[[Path], None]:
    """Mutation: append a well-formed F32 tensor `name` to `shard` (header and data stay self-consistent)."""
    def mutate(d: Path) -> None:
        header, data = read_shard(d / shard)
        header[name] = {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [len(data), len(data) + nbytes]}
        write_shard(d / shard, header, data + b"\0" * nbytes)
    return mutate


def sparse_aliasing_shard(shard: str, count: int, elems: int) -> Callable[[Path], None]:
    """safetensors_abuse_attempt_2 scaled up: `count` tensors all declared over the same `elems`*4 bytes of a
    sparse data section. A loader allocating per declared tensor would need count * elems * 4 bytes."""
    def mutate(d: Path) -> None:
        nbytes = elems * 4
        header = {f"evil.{i:05d}": {"dtype": "F32", "shape": [elems], "data_offsets": [0, nbytes]}
                  for i in range(count)}
        write_shard(d / shard, header, b"")
        os.truncate(d / shard, (d / shard).stat().st_size + nbytes)  # a hole: no disk, no data written
    return mutate


def sparse_declared_header(shard: str, declared: int) -> Callable[[Path], None]:
    """Mutation: an 8-byte prefix declaring a `declared`-byte header, and a sparse file really that long."""
    def mutate(d: Path) -> None:
        (d / shard).write_bytes(struct.pack("<Q", declared))
        os.truncate(d / shard, 8 + declared)
    return mutate


def symlink(name: str, target: Callable[[Path], Path]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        dest = target(d)  # before the unlink: the target may be a copy of the file it replaces
        (d / name).unlink(missing_ok=True)
        os.symlink(dest, d / name)
    return mutate


def outside_copy(shard: str) -> Callable[[Path], Path]:
    """A valid copy of `shard` placed next to (outside) the model folder; returns its path."""
    def make(d: Path) -> Path:
        out = d.parent / f"outside-{d.name}"
        out.mkdir(exist_ok=True)
        shutil.copy(d / shard, out / shard)
        return out / shard
    return make


def outside_special(make: Callable[[Path], None]) -> Callable[[Path], Path]:
    """A FIFO / folder (made by `make(path)`) next to (outside) the model folder; returns its path."""
    def mk(d: Path) -> Path:
        out = d.parent / f"outside-{d.name}"
        out.mkdir(exist_ok=True)
        make(out / "special")
        return out / "special"
    return mk


def evil_pickle_bytes(sentinel: Path) -> bytes:
    """A torch.save file whose unpickling (torch.load(weights_only=False) / pickle) creates `sentinel`."""
    import io

    class Payload:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    buf = io.BytesIO()
    torch.save({"model.embed_tokens.weight": Payload()}, buf)
    return buf.getvalue()


def evil_pickle(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(evil_pickle_bytes(d / SENTINEL))


EVIL_MODULE = "from pathlib import Path\nPath(__file__).with_name('PWNED').write_text('imported')\nclass EvilModel: pass\n"


def add_auto_map(d: Path) -> None:
    """Remote code the engine must never import: a module creating the sentinel, and an auto_map naming it."""
    (d / "modeling_evil.py").write_text(EVIL_MODULE)
    (d / "configuration_evil.py").write_text(EVIL_MODULE)
    edit_config(lambda c: c.update(auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                             "AutoModelForCausalLM": "modeling_evil.EvilModel"}))(d)


def mkfifo(name: str) -> Callable[[Path], None]:
    return lambda d: os.mkfifo(d / name)


# ---- the table ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    name: str
    section: str                                  # F1..F16, P1, P5 (RELIABILITY.md)
    mutate: Callable[[Path], None]
    expect_tensor: str | None                     # tensor the error must name (None: none applies)
    expect_file: str | None = SHARD1              # file name the error must contain; DIR: the model folder
    expect_text: tuple[str, ...] = ()             # further regexes the message must match
    env: Mapping[str, str] = field(default_factory=dict)
    ok: bool = False                              # a tolerated variation: must open, listing every tensor

    def __str__(self) -> str:
        return self.name


S1, S2 = layout(SHARD1), layout(SHARD2)
T1 = "model.layers.0.self_attn.q_proj.weight"     # a shard-1 tensor used by per-entry mutations
GATE, UP = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"   # same shape, adjacent
O_PROJ = "model.layers.0.self_attn.o_proj.weight"
D2 = data_len(SHARD2)
LAST2 = S2[-1][0]
FIRST_IN_S2 = sorted(n for n in tensor_shapes() if shard_of(n) == SHARD2)[0]   # first index entry on shard 2
SPARSE_BIG = 200 * 1024 * 1024


def _variants() -> list[Variant]:
    V = Variant
    v: list[V] = []
    # F1: empty / shorter than the 8-byte length prefix
    v.append(V("f1_empty_file", "F1", write_file(SHARD1, b""), None, expect_text=(r"8-byte",)))
    for n in range(1, 8):
        v.append(V(f"f1_{n}_bytes", "F1", write_file(SHARD1, b"\x01" * n), None, expect_text=(r"8-byte",)))
    # F2: header length beyond the file (no allocation of the declared size)
    v.append(V("f2_header_len_50MB_in_small_file", "F2",
               lambda d: write_shard(d / SHARD1, raw_header=b"", declared=50 * 2**20,
                                     data=(d / SHARD1).read_bytes()[8:]), None,
               expect_text=(r"declared=52428800", r"file_size=\d+")))
    v.append(V("f2_header_len_one_past_eof", "F2",
               lambda d: write_shard(d / SHARD1, raw_header=b"", declared=(d / SHARD1).stat().st_size - 7,
                                     data=(d / SHARD1).read_bytes()[8:]), None, expect_text=(r"declared=",)))
    v.append(V("f2_header_len_only_prefix", "F2", truncate_file(SHARD1, lambda p: 8), None,
               expect_text=(r"file_size=8",)))
    # F3: header length beyond the cap
    v.append(V("f3_header_len_all_ff", "F3", lambda d: (d / SHARD1).write_bytes(b"\xff" * 8 + b"{}"), None,
               expect_text=(r"cap", HEADER_CAP_ENV)))
    v.append(V("f3_header_200MB_sparse_file", "F3", sparse_declared_header(SHARD1, SPARSE_BIG), None,
               expect_text=(r"cap", HEADER_CAP_ENV)))
    v.append(V("f3_small_cap_via_env", "F3", lambda d: None, None, expect_text=(r"cap of 256", HEADER_CAP_ENV),
               env={HEADER_CAP_ENV: "256"}))
    # F4: not UTF-8 / not JSON / not an object / duplicate keys / pathological JSON
    v.append(V("f4_not_utf8", "F4", raw_header(SHARD1, lambda o: o[:20] + b"\xff\xfe" + o[22:]), None,
               expect_text=(r"UTF-8",)))
    v.append(V("f4_not_json_truncated_text", "F4", raw_header(SHARD1, lambda o: o[: len(o) // 2]), None,
               expect_text=(r"JSON", r"line \d+ column \d+")))
    v.append(V("f4_not_json_garbage", "F4", raw_header(SHARD1, same_length(b"{not json at all")), None,
               expect_text=(r"JSON",)))
    v.append(V("f4_leading_space", "F4", raw_header(SHARD1, lambda o: b" " + o), None, expect_text=(r"'\{'",)))
    v.append(V("f4_zero_length_header", "F4", raw_header(SHARD1, lambda o: b""), None))
    v.append(V("f4_json_array", "F4", raw_header(SHARD1, same_length(b"[]")), None))
    v.append(V("f4_array_after_brace_check", "F4", raw_header(SHARD1, same_length(b"{}[]")), None,
               expect_text=(r"JSON",)))
    v.append(V("f4_duplicate_tensor_key", "F4", raw_header(SHARD1, lambda o: o.rstrip()[:-1] + b',"%s":%s}' % (
        T1.encode(), json.dumps(json.loads(o)[T1]).encode())), T1, expect_text=(r"duplicate",)))
    v.append(V("f4_duplicate_inner_key", "F4",
               raw_header(SHARD1, lambda o: o.replace(b'"dtype":"F32"', b'"dtype":"F32","dtype":"F16"', 1)),
               None, expect_text=(r"duplicate key 'dtype'",)))
    v.append(V("f4_nested_100k_deep", "F4",
               raw_header(SHARD1, lambda o: b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), None))
    v.append(V("f4_integer_of_5000_digits", "F4", raw_header(SHARD1, lambda o: b'{"x":' + b"9" * 5000 + b"}"),
               None))
    v.append(V("f4_trailing_nul_bytes", "F4", raw_header(SHARD1, lambda o: o + b"\0\0\0\0"), None,
               expect_text=(r"JSON",)))
    v.append(V("f4_entry_not_object", "F4", edit_header(SHARD1, lambda h: h.update({T1: [1, 2]})), T1))
    # F5: __metadata__ values that are not strings
    for tag, meta in [("int", {"k": 1}), ("null", {"k": None}), ("nested", {"k": {"a": "b"}}),
                      ("list", ["a"]), ("string", "format"), ("empty_list", []), ("false", False)]:
        v.append(V(f"f5_metadata_{tag}", "F5", edit_header(SHARD1, lambda h, m=meta: h.update(__metadata__=m)),
                   None, expect_text=(r"__metadata__",)))
    # F6: data_offsets not two non-negative integers
    for tag, offs in [("len0", []), ("len1", [0]), ("len3", [0, 16384, 16384]), ("negative", [-16384, 0]),
                      ("float", [0.0, 16384.0]), ("string", ["0", "16384"]), ("bool", [False, True]),
                      ("null", None), ("object", {"a": 0})]:
        v.append(V(f"f6_offsets_{tag}", "F6", set_field(T1, "data_offsets", offs), T1,
                   expect_text=(r"data_offsets",)))
    v.append(V("f6_offsets_missing", "F6", set_field(T1, "data_offsets", _DELETE), T1))
    v.append(V("f6_offsets_huge_int", "F6", set_field(T1, "data_offsets", [2**70, 2**70 + 16384]), T1))
    v.append(V("f6_zero_size_tensor_beyond_file", "F6",
               edit_header(SHARD1, lambda h: h.update({"far.away": {"dtype": "F32", "shape": [0],
                                                                    "data_offsets": [2**62, 2**62]}})),
               "far.away"))
    # F7: end < begin (no underflow)
    v.append(V("f7_end_before_begin", "F7", edit_header(SHARD1, lambda h: h[T1].update(
        data_offsets=h[T1]["data_offsets"][::-1])), T1, expect_text=(r"end",)))
    # F8: overlapping byte ranges
    v.append(V("f8_two_tensors_same_bytes", "F8", edit_header(SHARD1, lambda h: h[UP].update(
        data_offsets=list(h[GATE]["data_offsets"]))), UP, expect_text=(r"overlap", re.escape(GATE))))
    v.append(V("f8_partial_overlap_4_bytes", "F8", edit_header(SHARD1, lambda h: h[T1].update(
        data_offsets=[h[T1]["data_offsets"][0] - 4, h[T1]["data_offsets"][1] - 4])), T1,
               expect_text=(r"overlap", re.escape(O_PROJ))))
    v.append(V("f8_10k_tensors_aliasing_64MB_sparse", "F8", sparse_aliasing_shard(SHARD1, 10_000, 2**24),
               "evil.00001", expect_text=(r"overlap", r"evil\.00000")))
    # F9: holes and trailing bytes
    v.append(V("f9_hole_between_tensors", "F9", shift_data(SHARD1, S1[3][0], 8), S1[3][0],
               expect_text=(r"not fully covered",)))
    v.append(V("f9_hole_at_start", "F9", shift_data(SHARD1, S1[0][0], 4), S1[0][0],
               expect_text=(r"not fully covered",)))
    v.append(V("f9_trailing_bytes", "F9", lambda d: open(d / SHARD1, "ab").write(b"extra"), None,
               expect_text=(r"trailing",)))
    v.append(V("f9_polyglot_zip_appended", "F9",
               lambda d: open(d / SHARD1, "ab").write(b"PK\x05\x06" + b"\0" * 18), None,
               expect_text=(r"trailing",)))
    # F10: truncated shard (inside the data section, and inside the header)
    for tag, cut in [("50pct", D2 // 2), ("99.9pct", D2 * 999 // 1000), ("minus_1_byte", D2 - 1),
                     ("no_data", 0)]:
        v.append(V(f"f10_truncated_{tag}", "F10", truncate_data(SHARD2, cut), first_tensor_past(SHARD2, cut),
                   expect_file=SHARD2, expect_text=(r"truncated", r"re-download")))
    v.append(V("f10_truncated_inside_header", "F10",
               truncate_file(SHARD2, lambda p: 8 + len(header_bytes(p)) // 2), None, expect_file=SHARD2))
    # F11: shape x dtype disagrees with the byte range; checked arithmetic
    for tag, shape in [("smaller", [64, 63]), ("larger", [64, 65]), ("overflow_2x(2^63-1)", [2, 2**63 - 1]),
                       ("wraps_to_0_mod_2^64", [2**32, 2**32]), ("wraps_to_real_size_mod_2^64", [2**62 + 4096]),
                       ("zero_dim_times_huge", [0, 2**70]), ("negative_dim", [-64, -64]),
                       ("float_dim", [64.0, 64]), ("bool_dim", [True, 64]), ("not_a_list", 4096),
                       ("null", None), ("string_dim", ["64", 64])]:
        v.append(V(f"f11_shape_{tag}", "F11", set_field(T1, "shape", shape), T1))
    v.append(V("f11_dtype_f16_same_range", "F11", set_field(T1, "dtype", "F16"), T1))
    v.append(V("f11_shape_missing", "F11", set_field(T1, "shape", _DELETE), T1))
    # F12: unknown dtypes fail closed; sub-byte dtypes must be byte-aligned
    for tag, dt in [("Q9", "Q9"), ("lowercase", "f32"), ("int", 5), ("empty", ""), ("null", None)]:
        v.append(V(f"f12_dtype_{tag}", "F12", set_field(T1, "dtype", dt), T1, expect_text=(r"dtype",)))
    v.append(V("f12_f4_odd_count", "F12", edit_header(SHARD1, lambda h: h[T1].update(
        dtype="F4", shape=[3], data_offsets=[h[T1]["data_offsets"][0], h[T1]["data_offsets"][0] + 2])), T1))
    # F14: index disagreeing with the shards (all shards are checked before any load)
    v.append(V("f14_index_names_missing_shard", "F14", remove(SHARD2), FIRST_IN_S2, expect_file=INDEX,
               expect_text=(re.escape(SHARD2),)))
    v.append(V("f14_index_maps_tensor_to_wrong_shard", "F14",
               edit_index(lambda i: i["weight_map"].update({"model.norm.weight": SHARD1})), "model.norm.weight",
               expect_file=INDEX, expect_text=(re.escape(SHARD2),)))
    v.append(V("f14_index_lists_absent_tensor", "F14",
               edit_index(lambda i: i["weight_map"].update({"model.ghost.weight": SHARD1})), "model.ghost.weight",
               expect_file=INDEX))
    v.append(V("f14_tensor_in_two_shards", "F14", add_tensor(SHARD1, "model.norm.weight"), "model.norm.weight",
               expect_text=(re.escape(SHARD2),)))
    v.append(V("f14_unindexed_tensor_in_shard", "F14", add_tensor(SHARD2, "model.extra.bias"), "model.extra.bias",
               expect_file=INDEX))
    v.append(V("f14_index_invalid_json", "F14", lambda d: (d / INDEX).write_text('{"weight_map": {'), None,
               expect_file=INDEX, expect_text=(r"JSON",)))
    v.append(V("f14_index_weight_map_missing", "F14", edit_index(lambda i: i.pop("weight_map")), None,
               expect_file=INDEX, expect_text=(r"weight_map",)))
    v.append(V("f14_index_weight_map_list", "F14", edit_index(lambda i: i.update(weight_map=[SHARD1])), None,
               expect_file=INDEX, expect_text=(r"weight_map",)))
    v.append(V("f14_index_weight_map_empty", "F14", edit_index(lambda i: i.update(weight_map={})), None,
               expect_file=INDEX, expect_text=(r"weight_map",)))
    v.append(V("f14_index_is_json_array", "F14", edit_index(lambda i: [i]), None, expect_file=INDEX))
    v.append(V("f14_index_shard_not_string", "F14",
               edit_index(lambda i: i["weight_map"].update({T1: 1})), T1, expect_file=INDEX))
    v.append(V("f14_index_shard_null", "F14", edit_index(lambda i: i["weight_map"].update({T1: None})), T1,
               expect_file=INDEX))
    v.append(V("f14_index_shard_is_directory", "F14",
               chain(lambda d: (d / "subdir").mkdir(), edit_index(lambda i: i["weight_map"].update({T1: "subdir"}))),
               T1, expect_file=INDEX))
    v.append(V("f14_index_shard_is_fifo", "F14",
               chain(mkfifo("pipe.safetensors"), edit_index(lambda i: i["weight_map"].update({T1: "pipe.safetensors"}))),
               T1, expect_file=INDEX))
    v.append(V("f14_index_duplicate_tensor_key", "F14",
               lambda d: (d / INDEX).write_text('{"weight_map": {"%s": "%s", "%s": "%s"}}' % (T1, SHARD1, T1, SHARD1)),
               None, expect_file=INDEX, expect_text=(r"duplicate", re.escape(T1))))
    v.append(V("f14_index_not_utf8", "F14", lambda d: (d / INDEX).write_bytes(b'{"weight_map": {"\xff": 1}}'), None,
               expect_file=INDEX))
    # F15: shard paths escaping the model folder
    escapes, invalid = (r"escapes model directory",), (r"not a valid relative file name",)
    for tag, rel, text in [("dotdot_etc_passwd", "../../etc/passwd", escapes), ("absolute", "/etc/passwd", escapes),
                           ("dotdot_to_outside_copy", None, escapes), ("nul_byte", "model\x00.safetensors", invalid),
                           ("lone_surrogate", "model-\ud800.safetensors", invalid), ("empty", "", invalid)]:
        def mutate(d: Path, rel=rel) -> None:
            if rel is None:  # a real, valid shard just outside the folder
                outside_copy(SHARD2)(d)
                rel = f"../outside-{d.name}/{SHARD2}"
            edit_index(lambda i: i["weight_map"].update({"lm_head.weight": rel}))(d)
        v.append(V(f"f15_weight_map_{tag}", "F15", mutate, "lm_head.weight", expect_file=INDEX, expect_text=text))
    # F15: a shard that is a symlink is followed wherever it points, to a regular file only
    v.append(V("ok_f15_shard_symlink_to_outside", "F15", symlink(SHARD2, outside_copy(SHARD2)), None, ok=True))
    v.append(V("ok_f15_single_file_symlink_to_outside", "F15",
               chain(outside_copy(SHARD1), remove(SHARD1, SHARD2, INDEX),
                     symlink("model.safetensors", lambda d: d.parent / f"outside-{d.name}" / SHARD1)),
               None, ok=True))
    v.append(V("f15_symlink_to_etc_passwd", "F15", symlink(SHARD2, lambda d: Path("/etc/passwd")), None,
               expect_file=SHARD2))  # followed: a regular file, refused as not safetensors
    v.append(V("f15_symlink_to_dev_zero", "F15", symlink(SHARD2, lambda d: Path("/dev/zero")), FIRST_IN_S2,
               expect_file=INDEX, expect_text=(re.escape(SHARD2), r"/dev/zero", r"character device",
                                               r"not a regular file")))
    v.append(V("f15_symlink_to_outside_fifo", "F15", symlink(SHARD2, outside_special(os.mkfifo)), FIRST_IN_S2,
               expect_file=INDEX, expect_text=(re.escape(SHARD2), r"FIFO", r"not a regular file")))
    v.append(V("f15_symlink_to_outside_directory", "F15", symlink(SHARD2, outside_special(os.mkdir)), FIRST_IN_S2,
               expect_file=INDEX, expect_text=(re.escape(SHARD2), r"directory", r"not a regular file")))
    v.append(V("f15_dangling_symlink", "F15", symlink(SHARD2, lambda d: d.parent / f"gone-{d.name}"), FIRST_IN_S2,
               expect_file=INDEX, expect_text=(r"missing shard", re.escape(SHARD2))))
    v.append(V("f15_single_file_symlink_to_dev_zero", "F15",
               chain(remove(SHARD1, SHARD2, INDEX), symlink("model.safetensors", lambda d: Path("/dev/zero"))),
               None, expect_file="model.safetensors", expect_text=(r"not a regular file",)))
    v.append(V("f15_weight_map_dotdot_staying_inside", "F15",
               chain(lambda d: (d / "sub").mkdir(),
                     edit_index(lambda i: i["weight_map"].update({"lm_head.weight": f"sub/../{SHARD2}"}))),
               "lm_head.weight", expect_file=INDEX, expect_text=(r"escapes model directory", r"'\.\.'")))
    # F16 (folder level; architecture-level checks are in test_config_validation.py)
    v.append(V("f16_config_missing", "F16", remove(CONFIG), None, expect_file=CONFIG, expect_text=(r"not found",)))
    v.append(V("f16_config_invalid_json", "F16", lambda d: (d / CONFIG).write_text('{"model_type": "llama",'),
               None, expect_file=CONFIG, expect_text=(r"JSON",)))
    v.append(V("f16_config_json_list", "F16", edit_config(lambda c: [c]), None, expect_file=CONFIG,
               expect_text=(r"object",)))
    v.append(V("f16_config_not_utf8", "F16", lambda d: (d / CONFIG).write_bytes(b'{"model_type": "\xff"}'), None,
               expect_file=CONFIG))
    v.append(V("f16_config_is_directory", "F16", chain(remove(CONFIG), lambda d: (d / CONFIG).mkdir()), None,
               expect_file=CONFIG))
    v.append(V("f16_config_is_fifo", "F16", chain(remove(CONFIG), mkfifo(CONFIG)), None, expect_file=CONFIG))
    v.append(V("f16_config_huge_integer", "F16", lambda d: (d / CONFIG).write_text('{"hidden_size": %s}' % ("9" * 5000)),
               None, expect_file=CONFIG))
    v.append(V("f16_config_duplicate_key", "F16",
               lambda d: (d / CONFIG).write_text('{"hidden_size": 64, "hidden_size": 128}'), None, expect_file=CONFIG,
               expect_text=(r"duplicate key 'hidden_size'",)))
    v.append(V("f16_auto_map_present_never_imported", "F16", add_auto_map, None, ok=True))
    # folder-level: pickle refused, mixed folder uses safetensors, ambiguous shard sets
    for name in ("pytorch_model.bin", "model.pt", "model.ckpt"):
        v.append(V(f"p1_pickle_only_{name.replace('.', '_')}", "P1",
                   chain(remove(SHARD1, SHARD2, INDEX), evil_pickle(name)), None, expect_file=DIR,
                   expect_text=(r"pickle", re.escape(name))))
    v.append(V("p1_pickle_sharded_with_bin_index", "P1",
               chain(remove(SHARD1, SHARD2, INDEX), evil_pickle("pytorch_model-00001-of-00001.bin"),
                     write_file("pytorch_model.bin.index.json",
                                b'{"weight_map": {"lm_head.weight": "pytorch_model-00001-of-00001.bin"}}')),
               None, expect_file=DIR, expect_text=(r"pickle",)))
    v.append(V("p5_mixed_folder_uses_safetensors", "P5", evil_pickle("pytorch_model.bin"), None, ok=True))
    v.append(V("p5_mixed_folder_no_index_single_file", "P5",
               chain(lambda d: os.replace(d / SHARD1, d / "model.safetensors"), remove(SHARD2, INDEX),
                     evil_pickle("pytorch_model.bin")), None, ok=True))
    v.append(V("f14_several_safetensors_no_index", "F14", remove(INDEX), None, expect_file=DIR,
               expect_text=(r"index",)))
    v.append(V("f14_no_weights_at_all", "F14", remove(SHARD1, SHARD2, INDEX), None, expect_file=DIR))
    v.append(V("f14_single_fifo_safetensors", "F14", chain(remove(SHARD1, SHARD2, INDEX), mkfifo("model.safetensors")),
               None, expect_file="model.safetensors"))
    v.append(V("f14_directory_named_safetensors", "F14",
               chain(remove(SHARD1, SHARD2, INDEX), lambda d: (d / "weights.safetensors").mkdir()), None,
               expect_file="weights.safetensors", expect_text=(r"not a regular file",)))
    # tolerated variations (must still open)
    v.append(V("ok_header_space_padding", "F4", raw_header(SHARD1, lambda o: o + b"        "), None, ok=True))
    v.append(V("ok_unindexed_extra_files", "F14",
               chain(write_file("README.md", b"# hi"), lambda d: shutil.copy(d / SHARD1, d / "consolidated.safetensors")),
               None, ok=True))
    v.append(V("ok_metadata_null", "F5", edit_header(SHARD1, lambda h: h.update(__metadata__=None)), None, ok=True))
    v.append(V("ok_weight_map_dot_slash_paths", "F15",
               edit_index(lambda i: i["weight_map"].update({k: "./" + s for k, s in i["weight_map"].items()})), None,
               ok=True))
    return v


VARIANTS: list[Variant] = _variants()
assert len({x.name for x in VARIANTS}) == len(VARIANTS), "variant names must be unique"


def materialize(variant: Variant, valid_dir: Path, dest: Path) -> Path:
    """Copy the valid fixture to `dest` and apply `variant`'s mutation; returns `dest`."""
    shutil.copytree(valid_dir, dest, symlinks=True)
    variant.mutate(dest)
    return dest
