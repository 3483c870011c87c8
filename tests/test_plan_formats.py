"""Issue 28 item 6: the planner and the CLI agree with `run` on a format's bytes.

`plan --weights fp8|int8|int4` sizes every unit as tools/make_checkpoint.py --quant fp8-block|ct-int8|ct-int4
writes it from the same bf16 checkpoint, and `plan` on the quantized folder sizes it as that folder stores it;
both against the units checkpoint.model.open_model lays out (MTP layers attached, as `run --spec mtp` reads
them). The planner sums tensor bytes; a unit's blob also pads each tensor to its element size
(checkpoint/layout.py), so planned <= real <= planned + sum over the unit's tensors of (element size - 1).
`inspect` on a quantized folder names the format and gives bits per weight and bytes per unit kind.
"""
from __future__ import annotations

import json
import shutil

import pytest

from offload_engine.checkpoint.layout import UnitLayout, dtype_align
from offload_engine.checkpoint.model import open_model
from offload_engine.cli import main
from offload_engine.planner.formats import WeightFormat
from offload_engine.planner.plan import load_model_spec, model_shape
from offload_engine.runtime.mtp import attach_mtp_units

QUANTS = {"fp8": "fp8-block", "int8": "ct-int8", "int4": "ct-int4"}
ARCHS = {"qwen3_moe": {}, "deepseek_v3": {"mtp": 1}}  # deepseek_v3 with its MTP layer, quantized like the trunk


def real_layouts(folder) -> dict:
    return attach_mtp_units(open_model(folder)).layouts


def padding(layout: UnitLayout) -> int:
    """The most alignment padding the unit's blob can hold: each tensor starts at a multiple of its element size."""
    return sum(dtype_align(s.dtype) - 1 for s in layout.slices)


def assert_units_agree(planned: dict, layouts: dict) -> None:
    assert set(planned) == set(layouts)
    for key, layout in layouts.items():
        assert planned[key] <= layout.nbytes <= planned[key] + padding(layout), (
            str(key), planned[key], layout.nbytes, padding(layout))


def kind_largest(units: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, n in units.items():
        out[key.kind] = max(out.get(key.kind, 0), n)
    return out


@pytest.fixture(scope="module")
def folders(checkpoint_factory):
    def get(arch: str, quant: str | None = None):
        return checkpoint_factory(arch, dtype="bfloat16", **ARCHS[arch], **({"quant": quant} if quant else {}))
    return get


@pytest.mark.parametrize("weights", sorted(QUANTS))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_what_if_units_are_the_quantized_checkpoints(folders, arch, weights):
    shape = model_shape(load_model_spec(str(folders(arch))))
    planned = shape.bytes_of(WeightFormat.of(shape.spec, weights), with_mtp=True)
    layouts = real_layouts(folders(arch, QUANTS[weights]))
    assert_units_agree(planned, layouts)
    bf16 = shape.bytes_of(WeightFormat.of(shape.spec, None), with_mtp=True)
    assert all(planned[k] < bf16[k] for k in planned if k.kind == "expert")  # the format shrinks the experts
    assert all(planned[k] == bf16[k] for k in planned if k.kind in ("embed", "head"))  # kept bf16


@pytest.mark.parametrize("weights", sorted(QUANTS))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_own_format_of_a_quantized_folder(folders, arch, weights):
    folder = folders(arch, QUANTS[weights])
    shape = model_shape(load_model_spec(str(folder)))
    fmt = WeightFormat.of(shape.spec, None)
    assert "(checkpoint)" in fmt.name and fmt.own
    assert_units_agree(shape.bytes_of(fmt, with_mtp=True), real_layouts(folder))


def test_what_if_from_config_alone(folders, tmp_path):
    """Without shards beside config.json (a configs/models entry) the kept tensors are in config.json's dtype:
    qwen3_moe stores every float tensor in bf16, so the sizes are the same."""
    shutil.copy(folders("qwen3_moe") / "config.json", tmp_path / "config.json")
    shape = model_shape(load_model_spec(str(tmp_path)))
    planned = shape.bytes_of(WeightFormat.of(shape.spec, "int4"), with_mtp=True)
    assert_units_agree(planned, real_layouts(folders("qwen3_moe", "ct-int4")))


@pytest.mark.parametrize("weights", ["int4", "fp8"])
def test_plan_cli_what_if_unit_bytes(folders, capsys, weights):
    folder = folders("deepseek_v3")
    assert main(["plan", "--model", str(folder), "--weights", weights, "--spec", "mtp", "--ram", "1GiB",
                 "--hardware", "rtx4070-12gb", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert weights in j["weights"] and "make_checkpoint --quant" in j["weights"]
    layouts = real_layouts(folders("deepseek_v3", QUANTS[weights]))
    real = kind_largest({k: v.nbytes for k, v in layouts.items()})
    most = max(padding(v) for v in layouts.values())
    assert set(j["unit_bytes_by_kind"]) == set(real)
    for kind, n in real.items():
        assert j["unit_bytes_by_kind"][kind]["largest"] <= n <= j["unit_bytes_by_kind"][kind]["largest"] + most


def test_plan_cli_reads_the_checkpoints_format(folders, capsys):
    assert main(["plan", "--model", str(folders("qwen3_moe", "ct-int4")), "--ram", "1GiB", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["weights"].startswith("compressed-tensors pack-quantized int4, group 32")
    assert "(checkpoint)" in j["weights"]
    assert j["bytes_total"] <= sum(v.nbytes for v in real_layouts(folders("qwen3_moe", "ct-int4")).values())


@pytest.mark.parametrize("quant, method, bits, group", [("ct-int4", "compressed-tensors", [4], [32]),
                                                        ("fp8-block", "fp8", [8], [])])
def test_inspect_shows_format_bits_and_unit_bytes(folders, capsys, quant, method, bits, group):
    folder = folders("deepseek_v3", quant)
    assert main(["inspect", str(folder), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    fmt = r["format"]
    assert fmt["quant_method"] == method and fmt["bits"] == bits and fmt["group_sizes"] == group
    assert fmt["quantized_weights"] > 0 and (fmt["blocks"] == [[128, 128]]) == (quant == "fp8-block")
    ck = attach_mtp_units(open_model(folder))
    units = r["units"]
    assert set(units) == {"embed", "dense", "expert", "head", "mtp"}
    assert sum(u["bytes"] for u in units.values()) == ck.total_bytes == r["bytes_total"]
    expert = [v.nbytes for k, v in ck.layouts.items() if k.kind == "expert" and k.layer < ck.spec.num_layers]
    assert units["expert"]["unit_bytes"] == max(expert) and units["expert"]["units"] == len(expert)
    assert units["embed"]["bits_per_weight"] == 16.0  # kept bf16
    limit = 5.2 if quant == "ct-int4" else 8.1  # 4 bits + fp32 scale per 32, or 8 bits + fp32 scale per block
    assert bits[0] < units["expert"]["bits_per_weight"] < limit
    assert 0 < r["bits_per_weight"] < 16
    assert r["params_total"] == json.loads(_inspect(folders("deepseek_v3"), capsys))["params_total"]
    assert main(["inspect", str(folder)]) == 0
    text = capsys.readouterr().out
    assert "format: " in text and "bits per weight" in text and "unit bytes" in text and " mtp " in text


def _inspect(folder, capsys) -> str:
    assert main(["inspect", str(folder), "--json"]) == 0
    return capsys.readouterr().out
