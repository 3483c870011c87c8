"""GPTQ and AWQ read as their own code reads them: AutoGPTQ's QuantLinear (pack and torch dequantization) and
AutoAWQ's packing utilities (tools/quant_peers.py fetches the two files from their releases), against the test
writer (tools/quant_writers.py) and the engine's dequantization and CPU kernel forms. Zeros vary per group and
output column over their whole range; act-order g_idx permuted; GPTQ v1 (zeros stored minus one) and v2.

The end-to-end logits of these checkpoints against transformers are in tests/test_formats_parity.py, whose GPTQ /
AWQ references are these same functions.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offload_engine.checkpoint.formats import QuantSpec
from offload_engine.checkpoint.quant_config import parse_quant_config
from offload_engine.runtime import dequant
from offload_engine.runtime.kernels import cpu_int
from tools import quant_peers
from tools.quant_writers import AWQ_ORDER, QuantOptions, _pack_cols, quant_config, quantize_tensor

OUT, INP = 64, 128


@pytest.fixture(scope="module")
def references():
    """Both releases' files, fetched once (skip, with pip's reason, where the package index cannot be reached)."""
    try:
        for name in quant_peers.PEERS:
            quant_peers.load(name)
    except quant_peers.QuantPeerError as e:
        pytest.skip(f"reference release not available: {e}")


def spec(quant: str, opts: QuantOptions) -> QuantSpec:
    """The engine's spec of one [OUT, INP] weight, the zero offset from its own parse of the writer's config."""
    cfg = parse_quant_config(quant_config(quant, opts), Path("config.json"))
    group = INP if cfg.group_size == -1 else cfg.group_size
    return QuantSpec(quant, OUT, INP, bits=cfg.bits, group=group, symmetric=cfg.sym, zero_offset=cfg.zero_offset)


def kernel_dense(q: QuantSpec, parts: dict) -> torch.Tensor | None:
    """The weight the engine's CPU int kernel multiplies by (float32), or None where that weight dequantizes."""
    if q.bits == 4:
        form = cpu_int.repack_int4(q, parts, torch.float32)
        return None if form is None else cpu_int.int4_dense(*form)
    form = cpu_int.repack_int8(q, parts, torch.float32)
    return None if form is None else cpu_int.int8_dense(*form)


def weight(seed: int) -> torch.Tensor:
    """Rows of different spreads and offsets, so that zeros differ across columns and groups."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(OUT, INP, generator=g) * torch.rand(OUT, 1, generator=g) + 0.3 * torch.randn(OUT, 1, generator=g)


GPTQ_CASES = [
    {"symmetric": False}, {"symmetric": False, "desc_act": True}, {"symmetric": False, "bits": 8},
    {"symmetric": False, "bits": 8, "group_size": -1}, {"symmetric": False, "desc_act": True, "group_size": -1},
    {"symmetric": False, "gptq_format": "gptq_v2"}, {"symmetric": False, "desc_act": True, "gptq_format": "gptq_v2"},
    {}, {"desc_act": True},
]


@pytest.mark.parametrize("extra", GPTQ_CASES, ids=str)
def test_gptq_writer_and_engine_match_autogptq(extra, references):
    """The writer's words are AutoGPTQ's packing of the weight they define; AutoGPTQ reads that weight back (v1);
    the engine reads it exactly (dequantize) and within float rounding (its CPU kernel form, where it applies)."""
    opts = QuantOptions(**extra)
    parts = {k.removeprefix("m."): v for k, v in
             quantize_tensor("m.weight", weight(1), "gptq", opts, torch.Generator().manual_seed(0)).items()}
    qweight, qzeros, scales, g_idx = parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"]
    bits, group, maxq = opts.bits, INP if opts.group_size == -1 else opts.group_size, (1 << opts.bits) - 1
    v2 = opts.gptq_format == "gptq_v2"
    if opts.desc_act and group < INP:
        assert not torch.equal(g_idx.long(), torch.arange(INP) // group)
    zeros = fields(qzeros, bits, dim=1) + (0 if v2 else 1)  # [G, out]
    if opts.symmetric:
        assert (zeros == (maxq + 1) // 2).all()
    else:  # real zero points, varied per group and column, down to the least each layout stores (v1: 1, v2: 0;
        # rows whose group is all positive): v1's stored 0 and v2's 0 both occur
        lo = 0 if v2 else 1
        assert len(torch.unique(zeros)) > 3 and zeros.min() >= lo and zeros.max() <= maxq
        assert (zeros == lo).any() or group == INP
    gi = g_idx.long()
    dense = ((fields(qweight, bits, dim=0) - zeros[gi]).float() * scales.float()[gi]).t().contiguous()
    pq, pz = quant_peers.autogptq_pack(dense, scales, zeros, g_idx, bits)
    assert torch.equal(pq, qweight)
    if v2:  # AutoGPTQ stores zero - 1 (v1) only: handed zero + 1 its packer writes v2's fields
        pz = quant_peers.autogptq_pack(dense, scales, zeros + 1, g_idx, bits)[1]
    else:
        assert torch.equal(quant_peers.autogptq_dense(qweight, qzeros, scales, g_idx, bits), dense)
    assert torch.equal(pz, qzeros)

    q = spec("gptq", opts)
    assert torch.equal(dequant.gptq(qweight, qzeros, scales, g_idx, q, torch.float32), dense)
    fast = kernel_dense(q, {"data": qweight, "scale": scales, "zero": qzeros, "g_idx": g_idx})
    assert (fast is not None) == ((not opts.desc_act or group == INP) and (bits == 4 or group == INP))
    if fast is not None:
        torch.testing.assert_close(fast, dense, rtol=0, atol=1e-6 * dense.abs().max().item())


def fields(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The `bits`-wide fields of int32 words, the lowest first, laid out along `dim` (GPTQ: qweight along the
    inputs, dim 0; qzeros along the outputs, dim 1), as non-negative int64."""
    per = 32 // bits
    f = (words.to(torch.int64).unsqueeze(-1) >> (torch.arange(per) * bits)) & ((1 << bits) - 1)  # [r, c, per]
    if dim == 1:
        return f.reshape(words.shape[0], -1)
    return f.permute(0, 2, 1).reshape(-1, words.shape[1])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_autogptq_packed_zeros_over_their_whole_range(bits, act_order, references):
    """AutoGPTQ as the writer: random codes, every zero 1..maxq (v1), and as v2 every zero 0..maxq (the v2 words
    written by the same packer handed zero + 1, which it stores minus one); the engine reads back the exact weight."""
    g = torch.Generator().manual_seed(bits + act_order)
    maxq, group = (1 << bits) - 1, 32
    groups = INP // group
    g_idx = (torch.arange(INP) // group)[torch.randperm(INP, generator=g)] if act_order else torch.arange(INP) // group
    codes = torch.randint(0, maxq + 1, (OUT, INP), generator=g)
    scales = (torch.rand(groups, OUT, generator=g) * 0.01 + 1e-3).half()
    for fmt, lo in (("gptq", 1), ("gptq_v2", 0)):
        zeros = torch.randint(lo, maxq + 1, (groups, OUT), generator=g)
        zeros[0, :2], zeros[0, 2:4] = lo, maxq  # both ends, whatever the draw
        dense = ((codes - zeros[g_idx].t()).float() * scales.float()[g_idx].t()).contiguous()  # exact products
        qweight, qzeros = quant_peers.autogptq_pack(dense, scales, zeros, g_idx, bits)
        if fmt == "gptq_v2":
            qzeros = quant_peers.autogptq_pack(dense, scales, zeros + 1, g_idx, bits)[1]
        else:
            assert torch.equal(quant_peers.autogptq_dense(qweight, qzeros, scales, g_idx, bits), dense)
        q = spec("gptq", QuantOptions(bits=bits, symmetric=False, gptq_format=fmt, desc_act=act_order))
        parts = {"data": qweight, "scale": scales, "zero": qzeros, "g_idx": g_idx.to(torch.int32)}
        assert torch.equal(dequant.gptq(qweight, qzeros, parts["scale"], parts["g_idx"], q, torch.float32), dense)
        fast = kernel_dense(q, parts)
        assert (fast is None) == (act_order or bits == 8)
        if fast is not None:
            torch.testing.assert_close(fast, dense, rtol=0, atol=1e-6 * dense.abs().max().item())


def test_awq_writer_and_engine_match_autoawq(references):
    opts = QuantOptions()
    parts = {k.removeprefix("m."): v for k, v in
             quantize_tensor("m.weight", weight(2), "awq", opts, torch.Generator().manual_seed(0)).items()}
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    codes, zeros = quant_peers.autoawq_codes(qweight, qzeros)
    assert len(torch.unique(zeros)) > 3  # real zero points, varied per group and column
    ref = quant_peers.autoawq_dense(qweight, qzeros, scales, opts.group_size)
    q = spec("awq", opts)
    assert torch.equal(dequant.awq(qweight, qzeros, scales, q, torch.float32), ref)
    fast = kernel_dense(q, {"data": qweight, "scale": scales, "zero": qzeros, "g_idx": None})
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-6 * ref.abs().max().item())


def test_awq_packed_zeros_over_their_whole_range(references):
    """The writer's GEMM packing of random codes and every zero 0..15 is what AutoAWQ unpacks; the engine's weight
    is AutoAWQ's dequantize_gemm of it."""
    g = torch.Generator().manual_seed(3)
    group = 32
    codes = torch.randint(0, 16, (INP, OUT), generator=g)
    zeros = torch.randint(0, 16, (INP // group, OUT), generator=g)
    zeros[0, :16] = torch.arange(16)
    scales = (torch.rand(INP // group, OUT, generator=g) * 0.01 + 1e-3).half()
    qweight, qzeros = _pack_cols(codes, 4, AWQ_ORDER), _pack_cols(zeros, 4, AWQ_ORDER)
    got_codes, got_zeros = quant_peers.autoawq_codes(qweight, qzeros)
    assert torch.equal(got_codes, codes) and torch.equal(got_zeros, zeros)
    ref = quant_peers.autoawq_dense(qweight, qzeros, scales, group)
    q = spec("awq", QuantOptions(group_size=group))
    assert torch.equal(dequant.awq(qweight, qzeros, scales, q, torch.float32), ref)
    fast = kernel_dense(q, {"data": qweight, "scale": scales, "zero": qzeros, "g_idx": None})
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("raw", [
    {"bits": 4, "group_size": 32, "quant_method": "gptq", "format": "gptq_v2"},
    {"bits": 4, "group_size": 32, "quant_method": "gptq", "format": "gptq"},
    {"bits": 4, "group_size": 32, "quant_method": "gptq", "format": "gptq", "checkpoint_format": "gptq_v2"},
    {"bits": 4, "group_size": 32, "quant_method": "gptq", "checkpoint_format": "GPTQ_V2"},
    {"bits": 4, "group_size": 32, "quant_method": "gptq"},
])
def test_gptq_layout_field_read_as_transformers_reads_it(raw):
    """transformers 5 and gptqmodel name the layout `format` (`checkpoint_format` the legacy name, which wins):
    a v2 file that says so only in `format` must not be read as v1 (zeros off by one)."""
    from transformers import GPTQConfig

    theirs = GPTQConfig.from_dict(dict(raw)).format
    assert parse_quant_config(raw, Path("config.json")).zero_offset == (1 if theirs == "gptq" else 0)


def test_awq_layout_field_read_as_transformers_reads_it():
    from offload_engine.errors import CheckpointFormatError

    for raw in ({"quant_method": "awq", "bits": 4, "group_size": 32, "format": "gemv"},
                {"quant_method": "awq", "bits": 4, "group_size": 32, "format": "gemm", "version": "gemv"}):
        with pytest.raises(CheckpointFormatError, match="gemv"):
            parse_quant_config(raw, Path("config.json"))
    assert parse_quant_config({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "GEMM"},
                              Path("config.json")).method == "awq"
