"""`offload-engine plan --ranks`: its flags and report, the model split over pipeline ranks (planner/split.py), from config.json and hardware profiles.

Each rank is one device of a profile: its VRAM (less the CUDA reserve) read at the GPU's memory bandwidth, its
RAM (less the host reserve; with several ranks per box, the box's RAM is shared: --rank-ram sets each rank's
share) copied over PCIe, its NVMe; a profile without a GPU is one RAM tier read by the CPU. The hop between ranks
carries one token's hidden state (bf16) over the link (--link-gbps, --link-us).
"""
from __future__ import annotations

import argparse
import json

from ..config import size_bytes
from ..constants import DEFAULT_CONTEXT
from ..errors import ConfigError
from ..planner.formats import WeightFormat
from ..planner.hardware import HardwareProfile, load_profile
from ..planner.plan import DEVICE_RESERVE, HOST_RESERVE, load_model_spec, model_shape
from ..planner.split import RankSpec, Split, Tier, layer_costs, split_layers

ITEMSIZE = 2  # bf16 activations and KV


def add_split_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", metavar="N|P1,P2,..",
                   help="split the layers over pipeline ranks: N devices of --hardware, or one profile per rank")
    p.add_argument("--rank-ram", metavar="BYTES", help="RAM budget of each rank (default: its profile's RAM less "
                                                       "2 GiB; ranks sharing a box share its RAM)")
    p.add_argument("--rank-vram", metavar="BYTES", help="VRAM budget of each rank (default: the profile's less "
                                                        "0.75 GiB)")
    p.add_argument("--link-gbps", type=float, default=1.25,
                   help="GB/s between ranks (default 1.25: 10 GbE; PCIe between cards of one box: ~25)")
    p.add_argument("--link-us", type=float, default=50.0, help="latency of one hop, microseconds (default 50)")


def rank_spec(name: str, profile: HardwareProfile, vram: int | None, ram: int | None) -> RankSpec:
    ram = ram if ram is not None else max(0, profile.ram_bytes - HOST_RESERVE)
    if profile.has_gpu:
        vram = vram if vram is not None else max(0, profile.vram_bytes - DEVICE_RESERVE)
        tiers = (Tier(vram, profile.gpu_mem_gbps * 1e9), Tier(ram, profile.pcie_gbps * 1e9))
    else:
        tiers = (Tier(ram, profile.cpu_gemv_gbps * 1e9),)
    return RankSpec(name, tiers, profile.nvme_gbps * 1e9)


def build_split(model: str, ranks: str, default_hardware: str | HardwareProfile, weights: str | None = None,
                context: int = DEFAULT_CONTEXT, rank_vram: str | None = None, rank_ram: str | None = None,
                link_gbps: float = 1.25, link_us: float = 50.0) -> Split:
    shape = model_shape(load_model_spec(model))
    fmt = WeightFormat.of(shape.spec, weights)
    names = [default_hardware] * int(ranks) if ranks.isdigit() else [n.strip() for n in ranks.split(",")]
    if not names or not all(names):
        raise ConfigError(f"--ranks {ranks!r}: a number of ranks, or profile names separated by commas")

    vram, ram = size_bytes(rank_vram, "--rank-vram"), size_bytes(rank_ram, "--rank-ram")
    profiles = [load_profile(n) if isinstance(n, str) else n for n in names]  # a profile: this machine's
    specs = [rank_spec(prof.name, prof, vram, ram) for prof in profiles]
    layers, extras = layer_costs(shape.bytes_of(fmt, False), shape.spec, context, ITEMSIZE)
    if link_gbps <= 0 or link_us < 0:
        raise ConfigError("--link-gbps must be > 0 and --link-us >= 0")
    return split_layers(layers, specs, extras, hop_bytes=shape.spec.hidden_size * ITEMSIZE,
                        link_bps=link_gbps * 1e9, link_latency_s=link_us * 1e-6)


def cmd_split(args: argparse.Namespace, default_hardware: str | HardwareProfile) -> int:
    split = build_split(args.model, args.ranks, args.hardware or default_hardware, args.weights,
                        args.context or DEFAULT_CONTEXT,
                        args.rank_vram, args.rank_ram, args.link_gbps, args.link_us)
    if args.json:
        print(json.dumps({"ranges": split.ranges, "tok_s": split.tok_s, "hop_s": split.hop_s,
                          "stages": [vars(s) for s in split.stages]}, indent=2))
    else:
        print(split.describe())
    return 0
