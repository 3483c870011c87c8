"""Mixtral: every layer routed (softmax top-k, renormalized); experts under `block_sparse_moe` as w1/w3/w2."""
from ..hf_config import ModelSpec
from .base import DecoderArgs, StandardNaming, sparse_layers


def _args(spec: ModelSpec) -> DecoderArgs:
    return DecoderArgs(spec, moe_layers=sparse_layers(spec), moe_prefix="block_sparse_moe",
                       expert_names=("w1", "w3", "w2"), moe_intermediate_size=spec.intermediate_size,
                       norm_topk_prob=True)


NAMING = StandardNaming("mixtral", _args)
