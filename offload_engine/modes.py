"""The values each mode option accepts, one tuple per option: the code that validates an option and the argparse
`choices` of its flag both import it from here. A leaf module (it imports nothing), so every layer may use it.
config.py and store/policy.py take the eviction policies' names from here too."""
from __future__ import annotations

# --spec: speculative decoding (speculative/stepper.py check_spec)
SPEC_MODES = ("off", "auto", "ngram", "mtp", "draft", "self")
# plan --spec: the modes the planner's cost model predicts (planner/plan.py)
PLAN_SPEC_MODES = ("off", "auto", "mtp", "ngram")
# --host-compute: experts the CPU computes where they lie in RAM (config.EngineConfig)
HOST_COMPUTE_MODES = ("off", "on", "auto")
# --direct-io: O_DIRECT reads; auto: on when the weights exceed the host budget (config.EngineConfig)
DIRECT_IO_MODES = ("auto", "on", "off")
# --kernels: quantized weights' compute; auto: a fast kernel where one applies (docs/FORMATS.md), dequantize: always
# dequantize-then-matmul (the reference the fast paths are checked against)
KERNEL_MODES = ("auto", "dequantize")
# --kv-dtype: the KV cache's storage; auto: the compute dtype (bf16 on CUDA, fp32 on CPU), bf16: bf16 whatever the
# compute dtype, fp8 (e4m3) / int8: one byte per value plus one fp32 scale per position and head (runtime/kv_storage.py)
KV_DTYPES = ("auto", "bf16", "fp8", "int8")
# --policy: the expert cache's eviction (store/policy.py implements each)
POLICIES = ("lru-floor", "layer-lru", "lru", "lfu")
