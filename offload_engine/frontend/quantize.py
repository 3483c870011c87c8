"""`offload-engine quantize`: its parser, the options from the flags, quantize_checkpoint, and what was kept."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from ..config import size_bytes
from ..errors import ConfigError
from ..quantize.plan import CALIBRATION_TOKENS, CALIBRATION_WINDOW, DEFAULT_GROUP, WEIGHTS, QuantizeOptions
from .common import add_common, add_model_arguments, subcommand

QUANTIZE_EXAMPLES = """examples:
  offload-engine quantize --model ~/models/Qwen3-30B-A3B --out ~/models/Qwen3-30B-A3B-int4 --weights int4
  offload-engine quantize --model DIR --out DIR-int8 --weights int8 --ram 8GiB
  offload-engine quantize --model DIR --out DIR-fp8 --weights fp8 --group 128 --no-keep-mtp
  offload-engine quantize --model DIR --out DIR-int4 --weights int4 --calibrate sample.txt   # GPTQ

writes compressed-tensors weights (transformers with `compressed-tensors`, vLLM and this engine read them):
int4/int8 pack-quantized, symmetric, round to nearest (int4 in groups of 32, int8 per output channel unless
--group); fp8 e4m3 per output channel, or in --group x --group blocks. Embeddings and norms are kept as stored;
routers, MTP layers and the head too unless --no-keep-router / --no-keep-mtp / --no-keep-head.
"""


def add_quantize_parser(sub: Any) -> argparse.ArgumentParser:
    p = subcommand(sub, "quantize", "write an int8/int4/fp8 (compressed-tensors) copy of a checkpoint",
                   QUANTIZE_EXAMPLES)
    add_model_arguments(p, "Hugging Face folder in bf16, fp16 or fp32")
    p.add_argument("--out", required=True, help="folder to create (never overwritten)")
    p.add_argument("--weights", required=True, choices=WEIGHTS, help="stored weight format")
    p.add_argument("--group", type=int, metavar="N",
                   help="int: input features per scale (0: per output channel; default int4 "
                        f"{DEFAULT_GROUP['int4']}, int8 per channel); fp8: N x N blocks (default per channel)")
    p.add_argument("--ram", default="4GiB", help="host memory for the tensors in flight (default 4GiB; the "
                                                  "process's own few hundred MB apart): rows are quantized and "
                                                  "tensors copied in chunks that fit")
    opt = argparse.BooleanOptionalAction
    p.add_argument("--keep-mtp", action=opt, default=True, help="keep the MTP layers unquantized (default)")
    p.add_argument("--keep-router", action=opt, default=True, help="keep the MoE routers unquantized (default)")
    p.add_argument("--keep-head", action=opt, default=True, help="keep lm_head unquantized (default)")
    p.add_argument("--keep-embeddings", action=opt, default=True,
                   help="keep the embeddings unquantized (always: quantized embeddings are not supported)")
    p.add_argument("--keep", action="append", default=[], metavar="REGEX",
                   help="also keep the linear modules whose name matches (repeatable)")
    p.add_argument("--calibrate", metavar="FILE",
                   help="int4/int8: round with GPTQ (error feedback on the activations this UTF-8 text file gives, "
                        "run through the model layer by layer) instead of to nearest; same output format")
    p.add_argument("--calibration-tokens", type=int, default=CALIBRATION_TOKENS, metavar="N",
                   help=f"tokens of the --calibrate text used (default {CALIBRATION_TOKENS})")
    p.add_argument("--calibration-window", type=int, default=CALIBRATION_WINDOW, metavar="N",
                   help=f"tokens per sequence the text is cut into (default {CALIBRATION_WINDOW}; at most the "
                        "model's max_position_embeddings)")
    add_common(p, "no progress bar")
    p.set_defaults(func=cmd_quantize)
    return p


def options_from_args(args: argparse.Namespace) -> tuple[QuantizeOptions, int]:
    ram = size_bytes(args.ram, "--ram")
    if ram <= 0:
        raise ConfigError(f"--ram must be a positive size, got {args.ram!r}")
    options = QuantizeOptions(weights=args.weights, group=args.group, keep_mtp=args.keep_mtp,
                              keep_router=args.keep_router, keep_head=args.keep_head,
                              keep_embeddings=args.keep_embeddings, keep=tuple(args.keep),
                              calibrate=args.calibrate, calibration_tokens=args.calibration_tokens,
                              calibration_window=args.calibration_window)
    return options, ram


def cmd_quantize(args: argparse.Namespace) -> int:
    from ..quantize.convert import quantize_checkpoint

    options, ram = options_from_args(args)
    report = quantize_checkpoint(args.model, args.out, options, ram=ram,
                                 progress=not args.quiet and sys.stderr.isatty())
    print(report.summary(), file=sys.stderr)
    return 0
