"""A pipeline rank with a local copy of only the shards its layers need (issue 32: "a shared filesystem or a local
copy of the shards it needs"): the stage opens from that folder, reads the same units and computes the same
bits as from the whole folder; a shard the stage needs that is missing is named; a single process still refuses
a folder with shards missing."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from offload_engine.assemble import assemble
from offload_engine.checkpoint.model import open_model
from offload_engine.checkpoint.stage import Stage, restrict
from offload_engine.config import EngineConfig
from offload_engine.errors import CheckpointFormatError
from offload_engine.runtime.layers import causal_mask

STAGES = (Stage(0, 2, 4), Stage(2, 4, 4))
TOKENS = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])


def needed_shards(full: Path, stage: Stage) -> set[str]:
    ck = restrict(open_model(full), stage)
    return {ck.index.tensors[ts.hf_name].file.name
            for specs in ck.schema.units.values() for ts in specs.values()}


def partial_copy(full: Path, dst: Path, shards: set[str]) -> Path:
    """The folder as a node would hold it: every small file, and of the shards only `shards` (symlinked)."""
    dst.mkdir()
    for f in full.iterdir():
        if f.suffix != ".safetensors" or f.name in shards:
            os.symlink(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def full(checkpoint_factory) -> Path:
    return checkpoint_factory("qwen3_moe", "offload")


def stage_output(path: Path, stage: Stage) -> torch.Tensor:
    parts = assemble(path, EngineConfig(device="cpu", dtype="float32"), stage=stage)
    try:
        model = parts.model
        T = len(TOKENS)
        x = model.embed(TOKENS) if stage.first else torch.randn(T, model.spec.hidden_size,
                                                                 generator=torch.Generator().manual_seed(0))
        positions = torch.arange(T)
        x = model.run_layers(x, positions, model.new_cache(T), causal_mask(positions, T))
        return model.head(x) if stage.last else x
    finally:
        parts.close()


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.describe())
def test_a_stage_runs_from_only_its_shards(full, tmp_path, stage):
    shards = needed_shards(full, stage)
    assert len(shards) < len(list(full.glob("*.safetensors")))  # the copy really lacks some
    local = partial_copy(full, tmp_path / "local", shards)
    opened = open_model(local, stage=stage)
    expected = restrict(open_model(full), stage)
    assert set(restrict(opened, stage).layouts) == set(expected.layouts)
    assert all(opened.layouts[k].nbytes == v.nbytes for k, v in expected.layouts.items())
    assert torch.equal(stage_output(local, stage), stage_output(full, stage))


def test_a_missing_shard_the_stage_needs_is_named(full, tmp_path):
    stage = STAGES[1]
    shards = needed_shards(full, stage)
    dropped = sorted(shards)[-1]
    local = partial_copy(full, tmp_path / "local", shards - {dropped})
    with pytest.raises(CheckpointFormatError, match=f"needs shard '{dropped}', which is not in this folder"):
        open_model(local, stage=stage)


def test_one_process_still_refuses_missing_shards(full, tmp_path):
    local = partial_copy(full, tmp_path / "local", needed_shards(full, STAGES[0]))
    with pytest.raises(CheckpointFormatError, match="index names missing shard"):
        open_model(local)


def test_the_split_of_a_partial_folder_comes_from_split(full, tmp_path, monkeypatch):
    """Without the other ranks' shard headers a rank cannot balance the split itself: --split (which
    `plan --ranks` prints) names it, and the layer count comes from config.json alone."""
    from offload_engine.distributed.engine import engine_split, layer_count
    from offload_engine.errors import ConfigError

    local = partial_copy(full, tmp_path / "local", needed_shards(full, STAGES[0]))
    config = EngineConfig(device="cpu")
    assert layer_count(local, False) == 4
    monkeypatch.delenv("OFFLOAD_ENGINE_SPLIT", raising=False)
    with pytest.raises(ConfigError, match="only some of the checkpoint's shards.*--split"):
        engine_split(local, config, 2)
    monkeypatch.setenv("OFFLOAD_ENGINE_SPLIT", "0:2,2:4")
    assert engine_split(local, config, 2) == [(0, 2), (2, 4)]
    assert engine_split(full, config, 2) == [(0, 2), (2, 4)]
