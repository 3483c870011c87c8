"""Which experts the host CPU computes where they lie in RAM instead of having them copied to the GPU.

`host_compute`: "off" (default: every expert is computed on the compute device, so the logits are those of the
fully resident run bit for bit), "on" (every routed expert the host tier holds and the device tier does not), or
"auto" (those for which planner.costs.host_compute_pays says the CPU is faster than copy + GPU, from rates
measured when the engine opens and the times host-computed experts then take). A CPU computes in another order
than a GPU, so "on" and "auto" on a GPU give the same tokens as a rule but not the same bits. On a CPU machine
with --vram (both tiers in RAM) "on" computes host-resident experts in place, skipping the RAM-to-RAM copy, bit
for bit as the device pool would.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..planner.costs import Machine, expert_copied_seconds, expert_host_seconds, host_compute_pays
from ..probe import (best_time, measure_cpu_gemv_bandwidth, measure_cpu_matmul_flops, measure_gpu_matmul_flops,
                     measure_h2d_bandwidth)


# decode's expert calls: few tokens, so one observed time stands for the next (prefill's are FLOP-bound: the
# estimate, which grows with tokens, rules there)
OBSERVED_TOKENS = 4
OBSERVED_WEIGHT = 0.2  # of each new observation in the running average
# observations before the average rules: the first call is cold (kernel choice, the pinned staging buffers, the
# thread pool waking: 3 ms on the H200 machine where warm ones took 0.9), and one must not turn auto off for good
OBSERVED_MIN = 8


@dataclass
class HostCompute:
    mode: str  # "on" | "auto" (modes.HOST_COMPUTE_MODES; "off" builds none)
    machine: Machine | None  # auto: the measured rates the rule weighs
    expert_bytes: int  # one expert in the host tier
    expert_params: int
    observed_s: float | None = None  # auto: running average of what one decode expert took on the host
    observations: int = 0  # decode experts observed (the first, cold, left out of the average)

    def wants(self, tokens: int) -> bool:
        """Compute on the host an expert routed `tokens` tokens of this forward."""
        observed = self.observed_s if self.observations >= OBSERVED_MIN else None
        return self.mode == "on" or host_compute_pays(self.expert_bytes, self.expert_params, tokens, self.machine,
                                                      observed)

    def observe(self, seconds: float, tokens: int) -> None:
        """One expert computed on the host took `seconds` (its inputs' wait and its result's copy back included).
        auto stops choosing the host once these say it does not pay: on the H200 machine an expert the probes
        put at 229 us took 1.4 ms in decode, and host compute cost 10-40% of decode speed."""
        if tokens > OBSERVED_TOKENS:
            return
        self.observations += 1
        if self.observations > 1:
            self.observed_s = seconds if self.observed_s is None else (
                (1 - OBSERVED_WEIGHT) * self.observed_s + OBSERVED_WEIGHT * seconds)

    def snapshot(self) -> dict:
        """For stats: the mode, and for auto the rule's two sides for one token's expert (microseconds) from the
        rates measured at open and the times observed since, so a run shows why experts were or were not computed
        on the host."""
        if self.machine is None:
            return {"mode": self.mode}
        m, args = self.machine, (self.expert_bytes, self.expert_params, 1)
        return {"mode": self.mode, "host_expert_us": expert_host_seconds(*args, m) * 1e6,
                "observed_host_expert_us": None if self.observed_s is None else self.observed_s * 1e6,
                "copied_expert_us": expert_copied_seconds(*args, m) * 1e6,
                "cpu_gbps": m.cpu_gbps, "h2d_gbps": m.h2d_gbps, "gpu_gbps": m.weight_gbps,
                "cpu_op_us": m.cpu_op_us, "gpu_op_us": m.op_us}


@dataclass
class HostInputs:
    """A MoE layer's routing inputs (hidden states, expert indices, weights) on their way from the GPU to the
    host: non-blocking copies into pinned memory, and an event that says when they have landed."""

    tensors: tuple[torch.Tensor, ...]
    landed: "torch.cuda.Event"

    @classmethod
    def stage(cls, *tensors: torch.Tensor) -> "HostInputs":
        copies = tuple(t.to("cpu", non_blocking=True) for t in tensors)  # torch pins a non-blocking D2H target
        landed = torch.cuda.Event()
        landed.record()
        return cls(copies, landed)

    def wait(self) -> tuple[torch.Tensor, ...]:
        self.landed.synchronize()
        return self.tensors


def _best_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm-up: first calls pick kernels and touch outputs
    return best_time(fn, repeats)


def measure_machine(device: torch.device, dtype: torch.dtype) -> Machine:
    """The rates the rule needs, measured in well under a second: pinned host -> device copies, batch-1 matmuls on
    the GPU and on the CPU in the compute dtype (the CPU's rate for bf16 differs widely between processors), and
    the dispatch cost of one small op on each. Run before the store allocates, so the probes' transient buffers
    (256 MiB to 1 GiB, back to the OS before the pools allocate) never meet a full budget. nvme_* are unused by
    the rule."""
    # the working set reaches past the last-level cache: an H200 host's CPU timed on 32 MiB (its 300 MiB L3 holds
    # that) read 'faster than the copy'
    cpu_gbps = measure_cpu_gemv_bandwidth(dtype).bytes_per_s
    tw, tx = torch.randn(64, 64), torch.randn(1, 64)
    cpu_op = _best_seconds(lambda: [F.linear(tx, tw) for _ in range(200)], 3) / 200
    # 128 MiB (bf16) past an H200's 50 MiB L2, ten GEMVs a sync: one GEMV a sync timed the sync (651 GB/s)
    gw = torch.randn(16384, 4096, dtype=dtype, device=device)
    gx = torch.randn(1, 4096, dtype=dtype, device=device)

    def gpu_linear():
        for _ in range(10):
            F.linear(gx, gw)
        torch.cuda.synchronize(device)

    sw, sx = gw[:64, :64].contiguous(), gx[:, :64].contiguous()  # one op, as on the CPU (slicing in the loop
    # tripled the ops timed: 35 us an 'op' on the H200 machine)

    def gpu_small_ops():
        for _ in range(200):
            F.linear(sx, sw)
        torch.cuda.synchronize(device)

    gpu_gbps = 10 * gw.numel() * gw.element_size() / _best_seconds(gpu_linear)
    gpu_op = _best_seconds(gpu_small_ops, 3) / 200
    h2d = measure_h2d_bandwidth(32 << 20, device=device)
    gpu_flops = measure_gpu_matmul_flops(2048, dtype, device=device)
    cpu_flops = measure_cpu_matmul_flops(256, dtype)
    return Machine("gpu", gpu_gbps / 1e9, gpu_flops.flops_per_s, gpu_op * 1e6, h2d.bytes_per_s / 1e9,
                   nvme_gbps=1.0, nvme_latency_us=0.0, cpu_gbps=cpu_gbps / 1e9, cpu_flops=cpu_flops.flops_per_s,
                   cpu_op_us=cpu_op * 1e6)
