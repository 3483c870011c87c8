"""One WeightFormat per weight format (offload_engine/formats/): every kind the checkpoint readers make is
registered and answers every question the engine asks, its kernel forms are its dequantization's algebra, and no
module outside formats/ tests QuantSpec.kind against a format's name."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from offload_engine.checkpoint.quant_config import SUPPORTED
from offload_engine.formats.registry import FORMATS, METHODS, format_of
from offload_engine.formats.spec import QuantSpec

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "offload_engine"
PATHS = {"cpu_int4", "cpu_int8", "cpu_dense", "cpu_gguf", None}

# a weight of each kind and variant, as the readers make them ([out, in] = [32, 256]: every kernel form applies)
SAMPLES = [
    QuantSpec("fp8_block", 32, 256, strategy="block", block=(16, 128)),
    QuantSpec("ct_pack", 32, 256, bits=4, strategy="group", group=32),
    QuantSpec("ct_pack", 32, 256, bits=4, strategy="group", group=64, symmetric=False),
    QuantSpec("ct_pack", 32, 256, bits=8, strategy="channel"),
    QuantSpec("ct_pack", 32, 256, bits=8, strategy="channel", symmetric=False),
    QuantSpec("ct_naive", 32, 256, bits=8, strategy="channel", symmetric=False),
    QuantSpec("ct_naive", 32, 256, bits=8, strategy="channel", float_values=True),
    QuantSpec("ct_naive", 32, 256, bits=8, strategy="block", block=(16, 16), float_values=True),
    QuantSpec("gptq", 32, 256, bits=4, group=32, zero_offset=1),
    QuantSpec("gptq", 32, 256, bits=8, group=256),
    QuantSpec("gptq", 32, 256, bits=8, group=32),
    QuantSpec("awq", 32, 256, bits=4, group=64),
    QuantSpec("mxfp4", 32, 256, bits=4, group=32),
    QuantSpec("gguf", 32, 256, gtype="Q4_0"),
    QuantSpec("gguf", 32, 256, gtype="Q4_K", heads=2),
    QuantSpec("gguf", 32, 256, gtype="Q8_0"),
    QuantSpec("gguf_kvb", 2 * (16 + 16), 256, group=32, heads=2, gtype="Q8_0", gtype2="Q8_0"),
]
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64, "I32": torch.int32,
          "I8": torch.int8, "U8": torch.uint8}


def _gguf_bytes(gtype: str, rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Blocks of `gtype` for a [rows, cols] matrix as tools/gguf_from_hf.py writes them (the gguf package's
    quantizer, or random blocks with usable scales for the K-quants)."""
    from tools.gguf_from_hf import encode_tensor

    values = torch.randn(rows, cols, generator=g).numpy().astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(encode_tensor(values, gtype, np.random.default_rng(0))[0]))


def _tensors(q: QuantSpec) -> dict[str, torch.Tensor]:
    """Component tensors of the shapes and dtypes the format's `parts` names, with values the format allows."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for part, (shape, dtype) in format_of(q).parts(q).items():
        if q.kind == "gguf":
            t = _gguf_bytes(q.gtype, q.out, q.inp, g)
        elif q.kind == "gguf_kvb":
            rows, cols = (q.heads * q.inp, q.group) if part == "q" else (shape[0], q.inp)
            t = _gguf_bytes(q.gtype if part == "q" else q.gtype2, rows, cols, g)
        elif dtype == "F8_E4M3":
            t = (torch.randn(shape, generator=g) * 4).to(torch.float8_e4m3fn)
        elif dtype in ("F32", "BF16", "F16"):
            t = (torch.rand(shape, generator=g) + 0.5).to(DTYPES[dtype]) / 64
        elif part == "shape":
            t = torch.tensor([q.out, q.inp], dtype=torch.int64)
        elif part == "g_idx":
            t = (torch.arange(q.inp) // q.group).to(torch.int32)
        elif q.kind == "mxfp4" and part == "scale":
            t = torch.randint(120, 130, shape, generator=g, dtype=torch.uint8)
        elif dtype == "I32":
            t = torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)
        else:
            t = torch.randint(-128 if dtype == "I8" else 0, 128 if dtype == "I8" else 256, shape, generator=g,
                              dtype=torch.int16).to(DTYPES[dtype])
        out["data" if part == "q" else part] = t
    return out


def test_every_kind_the_readers_make_is_registered():
    made = set()
    for path in PACKAGE.rglob("*.py"):  # QuantSpec("<kind>", ...) wherever a reader builds one by name
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("QuantSpec") and node.args
                    and isinstance(node.args[0], ast.Constant)):
                made.add(node.args[0].value)
    assert made and made <= set(FORMATS), f"kinds made without a registered format: {made - set(FORMATS)}"
    assert set(SUPPORTED) <= set(METHODS), f"quant_methods without a format: {set(SUPPORTED) - set(METHODS)}"
    assert {q.kind for q in SAMPLES} == set(FORMATS), "a registered format without a sample here: add one"
    for kind, fmt in FORMATS.items():
        assert fmt.kind == kind and isinstance(fmt.methods, tuple)
        assert not fmt.methods or fmt.scale_dtype, f"{kind}: a format read from safetensors names its scale dtype"


@pytest.mark.parametrize("q", SAMPLES, ids=lambda q: f"{q.kind}-{q.bits}-{q.strategy}-{q.gtype}-{q.symmetric}")
def test_every_format_answers_every_method(q):
    fmt = format_of(q)
    parts = fmt.parts(q)
    assert "q" in parts and fmt.nbytes(q) > 0 and isinstance(fmt.label(q), str)
    assert all(isinstance(n, str) for n in fmt.scale_names("model.layers.0.mlp.up_proj.weight"))
    tensors = _tensors(q)
    dense = fmt.dequantize(q, tensors, torch.float32)
    assert dense.shape == (q.out, q.inp) and dense.dtype == torch.float32 and torch.isfinite(dense).all()
    default = fmt.dequantize(q, tensors, None)  # no dtype asked: the scales' float dtype (GGUF: float32)
    assert default.shape == (q.out, q.inp) and default.is_floating_point()
    assert fmt.triton_int(q) in (True, False) and fmt.fp8_scaling(q) in (None, "block", "channel")
    rows = fmt.rows(q, tensors, torch.tensor([3, 0, 3]), torch.float32)
    if rows is not None and not q.heads:  # (tables are never rope-permuted: rows reads them as stored)
        assert torch.equal(rows, dense[[3, 0, 3]])
    for native in (False, True):
        path = fmt.cpu_path(q, native)
        assert path in PATHS
        # a kernel form is the format's own algebra: it gives back the dequantized weight
        if path == "cpu_int4":
            got = fmt.int4_parts(q, tensors)
            if got is not None:
                packed, scale, term, group = got
                assert fmt.int4_group(q) is not None and packed.shape == (q.out, q.inp // 2)
                u = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(q.out, q.inp).float()
                w = (u - 8) * scale.repeat_interleave(group, 1) + (
                    0 if term is None else term.float().repeat_interleave(group, 1))
                torch.testing.assert_close(w, dense, rtol=1e-5, atol=1e-6)
            else:
                assert q.kind == "gguf_kvb"  # room planned, form never built (formats/gguf.py)
        elif path == "cpu_int8":
            w8, zero = fmt.int8_parts(q, tensors)
            s = tensors["scale"].float().reshape(q.out, 1)
            w = (w8.float() - (0 if zero is None else zero.float().reshape(q.out, 1))) * s
            torch.testing.assert_close(w, dense, rtol=1e-6, atol=0)
        elif not q.kind.startswith("gguf"):  # (int4_parts is asked only where int4_group says a size)
            assert fmt.int8_parts(q, tensors) is None or q.bits != 8 or q.float_values
            assert fmt.int4_group(q) is None or fmt.int4_parts(q, tensors) is None


def _format_kind_test(node: ast.AST, kinds: set[str]) -> bool:
    """`x.kind == "ct_pack"`, `x.kind in ("gptq", ...)`, `x.kind.startswith("gguf")` and the like."""
    def names_kind(n: ast.AST) -> bool:
        return isinstance(n, ast.Attribute) and n.attr == "kind"

    def literal_kinds(n: ast.AST) -> bool:
        values = [n] if isinstance(n, ast.Constant) else list(getattr(n, "elts", []))
        return any(isinstance(v, ast.Constant) and isinstance(v.value, str)
                   and (v.value in kinds or v.value.startswith("gguf")) for v in values)

    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        return any(names_kind(s) for s in sides) and any(literal_kinds(s) for s in sides)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and names_kind(node.func.value):
        return any(literal_kinds(a) for a in node.args)
    return False


def test_no_module_outside_formats_tests_a_format_kind():
    """A new format is one module in formats/: the rest of the engine asks format_of(q), never q.kind == "..."
    (unit kinds, `key.kind == "expert"`, are another vocabulary and stay)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "formats" in path.relative_to(PACKAGE).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if _format_kind_test(node, set(FORMATS)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, "ask the weight's format (formats/registry.format_of) instead:\n" + "\n".join(found)


def test_the_scan_sees_kind_tests():
    kinds = set(FORMATS)
    for source in ('q.kind == "ct_pack"', 'q.kind in ("gptq", "awq")', 'q.kind.startswith("gguf")',
                   '"fp8_block" != p.q.kind'):
        assert _format_kind_test(ast.parse(source, mode="eval").body, kinds), source
    for source in ('key.kind == "expert"', 'q.kind == kind', 'q.gtype == "Q4_0"'):
        assert not _format_kind_test(ast.parse(source, mode="eval").body, kinds), source
