"""The malformed-checkpoint table and the header fuzz over quantized folders (RELIABILITY.md F10-F12, F17, F18).

tests/test_formats_bad_input.py and tests/test_formats_fuzz.py re-save edited tensors with safetensors, so every
header they make is well formed. Here the shard bytes themselves are broken, with tests/malformed.py's mutators,
on the quantization tensors of each format (fp8 blocks, compressed-tensors int4, GPTQ with act-order, AWQ, MXFP4):
a component's header entry retyped (same size and not), reshaped (transposed, flattened), renamed away, its
offsets moved, the shard cut inside its data, and random header bytes. Each must be refused with an error of the
engine's family naming the shard (and the tensor where one is at fault) within seconds, before any weight is read,
leaving the folder as it was; never a crash, a hang or another exception.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import malformed as m
from offload_engine import Engine
from offload_engine.checkpoint.model import open_model
from offload_engine.errors import CheckpointError, OffloadEngineError
from test_formats_parity import _options

FORMATS = {"fp8-block": {}, "ct-int4": {}, "gptq": {"desc_act": True}, "awq": {}, "mxfp4": {}}
LAYER = "model.layers.1."
PART = re.compile(r"(_scale_inv|_packed|_scale|_zero_point|_shape|\.qweight|\.qzeros|\.scales|\.g_idx|_blocks|"
                  r"_scales)$")
# a dtype of the same element size and another kind (int for float, float for int: the byte range still matches,
# only the format's own check can refuse it; one float for another is a legitimate scale dtype)
SAME_SIZE = {"F32": "I32", "I32": "F32", "U8": "I8", "I8": "U8", "F8_E4M3": "U8", "BF16": "I16", "F16": "I16",
             "I64": "F64"}
DEADLINE_S = 5.0
FUZZ_EXAMPLES = int(os.environ.get("OFFLOAD_ENGINE_FORMAT_FUZZ_EXAMPLES", "150"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from tools.make_checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("malformed-quant")
    return {q: make_checkpoint("qwen3_moe", "tiny", root / q, quant=q, fused_experts=q == "mxfp4",
                               quant_options=_options(q, extra)) for q, extra in FORMATS.items()}


def weight_map(folder: Path) -> dict[str, str]:
    index = folder / m.INDEX
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    header, _ = m.read_shard(folder / "model.safetensors")
    return {n: "model.safetensors" for n in header if n != "__metadata__"}


def parts(folder: Path) -> list[str]:
    """One layer's quantization components (attention and experts): each kind of scale, packed data, zero point,
    g_idx, weight_shape and MXFP4 block."""
    names = sorted(n for n in weight_map(folder) if n.startswith(LAYER) and PART.search(n))
    seen, out = set(), []
    for n in names:  # one tensor per (module kind, component): experts.0..N repeat the same checks
        key = (re.sub(r"\.\d+\.", ".N.", n.removeprefix(LAYER)))
        if key not in seen:
            seen.add(key)
            out.append(n)
    return out


def _edit(name: str, fn) -> callable:
    def mutate(d: Path) -> None:
        shard = weight_map(d)[name]
        m.edit_header(shard, lambda h: fn(h, h[name]))(d)
    return mutate


def _retype_same_size(h: dict, e: dict) -> None:
    e["dtype"] = SAME_SIZE[e["dtype"]]


def _retype_other_size(h: dict, e: dict) -> None:
    e["dtype"] = "F64" if e["dtype"] != "F64" else "F32"


def _transpose(h: dict, e: dict) -> None:
    e["shape"] = e["shape"][::-1] if len(e["shape"]) >= 2 and e["shape"][0] != e["shape"][-1] else e["shape"] + [1]


def _flatten(h: dict, e: dict) -> None:
    n = 1
    for s in e["shape"]:
        n *= s
    e["shape"] = [n] if len(e["shape"]) != 1 else [n, 1]


def _rename(h: dict, e: dict) -> None:
    name = next(k for k, v in h.items() if v is e)
    h[name + "_renamed"] = h.pop(name)


def _offsets_past_end(h: dict, e: dict) -> None:
    begin, end = e["data_offsets"]
    e["data_offsets"] = [begin + 1, end + 1]


def _cut_inside(name: str):
    def mutate(d: Path) -> None:
        shard = weight_map(d)[name]
        header, _ = m.read_shard(d / shard)
        begin, end = header[name]["data_offsets"]
        os.truncate(d / shard, m.data_start(d / shard) + (begin + end) // 2)
    return mutate


MUTATIONS = {"retype-same-size": _retype_same_size, "retype-other-size": _retype_other_size,
             "transpose": _transpose, "flatten": _flatten, "rename": _rename, "offsets": _offsets_past_end}


def _cases() -> list[tuple[str, str]]:
    return [(q, how) for q in FORMATS for how in [*MUTATIONS, "truncate"]]


def _refused(folder: Path, shard: str, tensor: str | None) -> CheckpointError:
    before = sorted(p.name for p in folder.iterdir())
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as err:
        with Engine.open(folder, dtype="float32", max_context=16) as engine:
            engine.logits([1, 2, 3])
    assert time.monotonic() - t0 < DEADLINE_S
    assert sorted(p.name for p in folder.iterdir()) == before, "the folder changed"
    msg = str(err.value)
    assert str(folder) in msg, msg
    if tensor is not None:
        assert shard in msg and tensor in msg, msg
    return err.value


@pytest.mark.parametrize("quant, how", _cases(), ids=lambda x: x)
def test_broken_component_header_is_refused_naming_shard_and_tensor(folders, tmp_path, quant, how):
    src = folders[quant]
    for name in parts(src):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        shard = weight_map(src)[name]
        (_cut_inside(name) if how == "truncate" else _edit(name, MUTATIONS[how]))(dst)
        # a renamed component: the weight names what it lacks, in the folder; truncation names the shard only
        # when the cut falls before the tensor that the check reports first
        tensor = None if how in ("rename", "truncate") else name
        err = _refused(dst, shard, tensor)
        if how == "rename":
            assert name.rsplit(".", 1)[0] in str(err) or name in str(err), str(err)
        if how == "truncate":
            assert shard in str(err) and re.search("truncat|shorter|expected", str(err)), str(err)
        shutil.rmtree(dst)


def test_every_format_reaches_its_components(folders):
    want = {"fp8-block": ["_scale_inv"], "ct-int4": ["_packed", "_scale", "_shape"],
            "gptq": [".qweight", ".qzeros", ".scales", ".g_idx"], "awq": [".qweight", ".qzeros", ".scales"],
            "mxfp4": ["_blocks", "_scales"]}
    for quant, suffixes in want.items():
        got = parts(folders[quant])
        for s in suffixes:
            assert any(n.endswith(s) for n in got), (quant, s, got)


@pytest.mark.parametrize("value", [-1, 99])
def test_gptq_g_idx_out_of_range_is_refused_before_it_is_computed_with(folders, tmp_path, value):
    """g_idx is data: the headers cannot betray it. It is checked where the unit lands, never used."""
    import torch
    from safetensors.torch import load_file, save_file

    src = folders["gptq"]
    name = next(n for n in parts(src) if n.endswith(".g_idx") and ".experts." not in n)
    shard = weight_map(src)[name]
    dst = tmp_path / "v"
    shutil.copytree(src, dst)
    tensors = load_file(dst / shard)
    g = tensors[name].clone()
    g[len(g) // 2] = value
    tensors[name] = g.to(torch.int32)
    save_file(tensors, dst / shard, metadata={"format": "pt"})
    open_model(dst)  # the headers are fine
    _refused(dst, shard, name)


_COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


@settings(max_examples=FUZZ_EXAMPLES, **_COMMON)
@given(data=st.data())
def test_fuzz_quantized_shard_headers(folders, tmp_path_factory, data):
    """Random bytes in the header of the shard that holds a quantization component: only the engine's errors."""
    quant = data.draw(st.sampled_from(sorted(FORMATS)), label="format")
    src = folders[quant]
    name = data.draw(st.sampled_from(parts(src)), label="tensor")
    shard = weight_map(src)[name]
    dst = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    raw = bytearray((dst / shard).read_bytes())
    hlen = int.from_bytes(raw[:8], "little")
    # bias the edits toward the component's own entry
    at = raw.find(json.dumps(name).encode(), 8, 8 + hlen)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        pos = data.draw(st.integers(max(8, at), min(8 + hlen - 1, at + 160)), label="pos")
        raw[pos] = data.draw(st.integers(0, 255), label="byte")
    (dst / shard).write_bytes(bytes(raw))
    open_and_compute(dst)


def open_and_compute(dst) -> OffloadEngineError | None:
    """Open the variant and compute one forward, within DEADLINE_S: success or the engine's own error (a checkpoint
    error naming the folder's file), never another exception. The variant is removed afterwards."""
    t0, err = time.monotonic(), None
    try:
        with Engine.open(dst, dtype="float32", max_context=16) as engine:
            engine.logits([1, 2, 3])
    except CheckpointError as e:
        assert str(dst) in str(e), str(e)
        err = e
    except OffloadEngineError as e:
        err = e
    finally:
        shutil.rmtree(dst, ignore_errors=True)
    assert time.monotonic() - t0 < DEADLINE_S
    return err


INTS = [0, 1, 2, 3, 16, 31, 32, 64, 2**31, 2**63 - 1, 2**64, -1]
DTYPE_NAMES = ["BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E8M0", "I8", "U8", "I16", "I32", "I64", "U32", "F4", "Q9"]


@settings(max_examples=FUZZ_EXAMPLES, **_COMMON)
@given(data=st.data())
def test_fuzz_quantized_component_entries(folders, tmp_path_factory, data):
    """Well-formed JSON, arbitrary entries: a component's dtype, shape and offsets drawn from values that break
    the safetensors rules and the format's (sizes off by one element, swapped, huge, negative)."""
    quant = data.draw(st.sampled_from(sorted(FORMATS)), label="format")
    src = folders[quant]
    name = data.draw(st.sampled_from(parts(src)), label="tensor")
    shard = weight_map(src)[name]
    header, _ = m.read_shard(src / shard)
    entry = header[name]
    dims = st.one_of(st.sampled_from(INTS), st.sampled_from([s for s in entry["shape"]] or [1]))
    new = {"dtype": data.draw(st.one_of(st.just(entry["dtype"]), st.sampled_from(DTYPE_NAMES)), label="dtype"),
           "shape": data.draw(st.one_of(st.just(entry["shape"]), st.lists(dims, max_size=4)), label="shape"),
           "data_offsets": data.draw(st.one_of(st.just(entry["data_offsets"]),
                                               st.lists(st.sampled_from(INTS + entry["data_offsets"]),
                                                        min_size=2, max_size=2)), label="offsets")}
    dst = tmp_path_factory.mktemp("fuzz-entry")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    m.edit_header(shard, lambda h: h[name].update(new))(dst)
    err = open_and_compute(dst)
    if isinstance(err, CheckpointError):
        if new != entry:
            assert name in str(err) or err.tensor is not None, str(err)
    elif err is None:  # accepted: unchanged, or a float scale stored as another float of its size (a legitimate dtype)
        same_bytes = new["shape"] == entry["shape"] and new["data_offsets"] == entry["data_offsets"]
        assert new == entry or (same_bytes and {new["dtype"], entry["dtype"]} <= {"BF16", "F16"}), (new, entry)
