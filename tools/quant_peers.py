"""GPTQ's and AWQ's own code, as the references the tests read those formats with (not the engine's, not ours).

  AutoGPTQ 0.7.1  auto_gptq/nn_modules/qlinear/qlinear_cuda.py: `QuantLinear.pack` (the writer of the GPTQ v1
                  layout: qweight packed along the inputs, qzeros along the outputs, zeros stored minus one) and
                  its torch forward without the CUDA extension (unpack, `+ 1`, `scales[g_idx] * (q - z[g_idx])`)
  AutoAWQ 0.2.9   awq/utils/packing_utils.py: `unpack_awq`, `reverse_awq_order`, `dequantize_gemm` (the GEMM
                  layout's nibble order 0,2,4,6,1,3,5,7)

Neither package imports here as a whole (auto-gptq's __init__ pulls peft and its CUDA extensions; autoawq's imports
its model zoo against transformers 4.x), and neither is needed beyond those two pure-torch files. So the releases
are fetched from the package index with `pip download --no-deps` (auto-gptq: its cp311 manylinux wheel, named by
platform so any local Python takes it; autoawq: its sdist) into ~/.cache/offload-engine/quant-peers/
(OFFLOAD_ENGINE_CACHE moves the root), the one file each reference needs is extracted, and it is loaded by path.
`load(name)` raises QuantPeerError (with pip's message) where the index cannot be reached.
"""
from __future__ import annotations

import fcntl
import functools
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType

import torch

# name -> (pip requirement, extra pip download flags, archive glob, member path inside the archive)
PEERS = {
    "auto_gptq_qlinear": ("auto-gptq==0.7.1",
                          ("--only-binary", ":all:", "--platform", "manylinux2014_x86_64", "--python-version", "3.11",
                           "--implementation", "cp", "--abi", "cp311"),
                          "auto_gptq-0.7.1-*.whl", "auto_gptq/nn_modules/qlinear/qlinear_cuda.py"),
    "awq_packing": ("autoawq==0.2.9", ("--no-binary", ":all:"), "autoawq-0.2.9.tar.gz",
                    "autoawq-0.2.9/awq/utils/packing_utils.py"),
}


class QuantPeerError(RuntimeError):
    """A reference release could not be fetched or read (the message names the package and pip's error)."""


def cache_root() -> Path:
    base = Path(os.environ.get("OFFLOAD_ENGINE_CACHE", Path.home() / ".cache" / "offload-engine"))
    return base / "quant-peers"


def source(name: str) -> Path:
    """The reference file on disk, fetched once (a lock keeps parallel test workers from fetching it twice)."""
    requirement, flags, pattern, member = PEERS[name]
    root = cache_root()
    path = root / requirement.replace("==", "-") / member
    if path.is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return path
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", *flags, requirement, "-d", tmp]
            if "--no-binary" in flags and importlib.util.find_spec("setuptools") is not None:
                cmd.insert(5, "--no-build-isolation")  # the sdist's metadata by the local setuptools: ~4x faster
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            archives = sorted(Path(tmp).glob(pattern))
            if proc.returncode or not archives:
                raise QuantPeerError(f"pip download {requirement} failed: {proc.stderr.strip()[-1500:]}")
            text = _member(archives[0], member)
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_suffix(".part")
            part.write_bytes(text)
            os.replace(part, path)
    return path


def _member(archive: Path, member: str) -> bytes:
    try:
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as z:
                return z.read(member)
        with tarfile.open(archive) as t:
            f = t.extractfile(member)
            if f is None:
                raise KeyError(member)
            return f.read()
    except KeyError as e:
        raise QuantPeerError(f"{archive.name} has no {member}") from e


_FAILED: dict[str, QuantPeerError] = {}


@functools.cache
def load(name: str) -> ModuleType:
    """The reference module `name` (a key of PEERS), imported from its release's file. A failed fetch is not
    retried in this process (the same error again: a test reads hundreds of weights)."""
    if name in _FAILED:
        raise _FAILED[name]
    try:
        path = source(name)
    except QuantPeerError as e:
        _FAILED[name] = e
        raise
    spec = importlib.util.spec_from_file_location(f"quant_peer_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the references, as the tests call them ------------------------------------------------------------------
def autogptq_dense(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                   bits: int) -> torch.Tensor:
    """A GPTQ v1 weight [out, in] in float32 by AutoGPTQ's QuantLinear (its torch path: no CUDA extension here),
    scales upcast so the products are exact. Its forward multiplies an identity: x @ W^T with x = I is W^T."""
    inp, out = qweight.shape[0] * 32 // bits, qweight.shape[1]
    ql = load("auto_gptq_qlinear").QuantLinear(bits, inp // qzeros.shape[0], inp, out, bias=False,
                                                weight_dtype=torch.float32)
    ql.qweight, ql.qzeros, ql.scales, ql.g_idx = qweight, qzeros, scales.float(), g_idx.to(torch.int32)
    with torch.no_grad():
        return ql(torch.eye(inp)).t().contiguous()


def autogptq_pack(dense: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
                  bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's writer: QuantLinear.pack of a weight [out, in] with scales and zeros [G, out] (as stored;
    it takes them [out, G]) -> (qweight, qzeros), the zeros stored minus one."""
    out, inp = dense.shape
    linear = torch.nn.Linear(inp, out, bias=False)
    linear.weight.data = dense.float().clone()
    ql = load("auto_gptq_qlinear").QuantLinear(bits, inp // scales.shape[0], inp, out, bias=False,
                                                weight_dtype=torch.float32)
    ql.pack(linear, scales.float().t().contiguous(), zeros.float().t().contiguous(), g_idx.to(torch.int32))
    return ql.qweight, ql.qzeros


def autoawq_codes(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's unpack_awq + reverse_awq_order + its overflow mask: (codes [in, out], zeros [G, out]) as int64."""
    p = load("awq_packing")
    w, z = p.reverse_awq_order(*p.unpack_awq(qweight, qzeros, 4), 4)
    return w.to(torch.int64) & 15, z.to(torch.int64) & 15


def autoawq_dense(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """An AWQ GEMM weight [out, in] in float32 by AutoAWQ's dequantize_gemm (scales upcast: exact products)."""
    return load("awq_packing").dequantize_gemm(qweight, qzeros, scales.float(), 4, group).float().t().contiguous()
