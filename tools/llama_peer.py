#!/usr/bin/env python3
"""llama.cpp as the bench's compute peer: built from the source vendored in the `llama-cpp-python` sdist.

The sdist (PyPI, `pip download --no-binary :all:`) carries a full llama.cpp tree (vendor/llama.cpp): its CMake
build gives `llama-bench` and `llama-quantize`, and its own `convert_hf_to_gguf.py` (with its own gguf-py) turns
a Hugging Face folder into a GGUF. Everything lives outside the repository, in
~/.cache/offload-engine/llama.cpp/<sdist version>/ (OFFLOAD_ENGINE_CACHE moves the root): the unpacked sdist,
the build folder and build.log. The build is CPU only (-DGGML_NATIVE=ON, Release), runs under `nice`, and takes
~8-15 minutes on two cores; it is done once.

    python tools/llama_peer.py build                       # download + build (prints the binaries' folder)
    python tools/llama_peer.py convert HF_DIR OUT.gguf --outtype bf16
    python tools/llama_peer.py quantize OUT.gguf Q4_K_M    # -> OUT-Q4_K_M.gguf
    python tools/llama_peer.py bench OUT.gguf --threads 2  # llama-bench tg32: tok/s

The bench checkpoint's tokenizer is a byte-level BPE trained locally, whose pre-tokenizer hash llama.cpp's
converter does not know; where it raises "BPE pre-tokenizer was not recognized" the conversion falls back to
"gpt-2" (the same byte-level regex). llama-bench feeds random token ids, so the vocabulary never affects the rate.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

SDIST_VERSION = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp is what the figures were measured with
TARGETS = ("llama-bench", "llama-quantize", "llama-completion")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF")
QUANT_TYPES = ("Q8_0", "Q4_K_M", "Q4_0", "Q6_K")
OUTTYPES = ("bf16", "f16", "f32", "q8_0")
BUILD_TOOLS = ("cmake", "c++")
class LlamaPeerError(RuntimeError):
    """The llama.cpp peer could not be built or run (the message names the step and its log)."""


def cache_root(version: str = SDIST_VERSION) -> Path:
    base = Path(os.environ.get("OFFLOAD_ENGINE_CACHE", Path.home() / ".cache" / "offload-engine"))
    return base / "llama.cpp" / version


def source_dir(version: str = SDIST_VERSION) -> Path:
    return cache_root(version) / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def bin_dir(version: str = SDIST_VERSION) -> Path:
    return cache_root(version) / "build" / "bin"


def built(version: str = SDIST_VERSION) -> Path | None:
    """The folder holding the TARGETS when all are built, else None (nothing is started)."""
    d = bin_dir(version)
    return d if all((d / t).is_file() and os.access(d / t, os.X_OK) for t in TARGETS) else None


def missing_toolchain() -> str | None:
    """The first build tool not on PATH, or None: where one is missing the llama.cpp tests skip; where both
    exist an unbuilt llama.cpp fails them (`make test` builds it first)."""
    return next((tool for tool in BUILD_TOOLS if shutil.which(tool) is None), None)


def _say(msg: str) -> None:
    print(f"llama_peer: {msg}", file=sys.stderr, flush=True)


def _fetch_source(version: str) -> Path:
    """Download the sdist with pip (no binaries, no dependencies) and unpack it into the cache."""
    root, src = cache_root(version), source_dir(version)
    if (src / "CMakeLists.txt").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        _say(f"downloading the llama-cpp-python {version} sdist (~75 MB) from the package index")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={version}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        tarballs = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if proc.returncode or not tarballs:
            raise LlamaPeerError(f"pip download of llama-cpp-python=={version} failed:\n{proc.stderr[-2000:]}")
        with tarfile.open(tarballs[0]) as tar:
            tar.extractall(root, filter="data")
    if not (src / "CMakeLists.txt").is_file():
        raise LlamaPeerError(f"the sdist has no vendor/llama.cpp/CMakeLists.txt (looked in {src})")
    return src


def ensure_built(version: str = SDIST_VERSION, jobs: int = 2, progress: bool = True) -> Path:
    """The folder with llama-bench and llama-quantize, building them first when missing (download, CMake
    configure, `nice cmake --build -jJOBS`; the compiler's output goes to build.log, its progress lines to
    stderr). Raises LlamaPeerError naming the log when a step fails."""
    if (done := built(version)) is not None:
        return done
    if (tool := missing_toolchain()) is not None:
        raise LlamaPeerError(f"building llama.cpp needs `{tool}` on PATH (e.g. apt-get install cmake "
                             f"build-essential)")
    src = _fetch_source(version)
    build, log = cache_root(version) / "build", cache_root(version) / "build.log"
    _say(f"building {', '.join(TARGETS)} from {src} (CPU, -j{jobs}, nice; ~8-15 min on 2 cores); log: {log}")
    with open(log, "a") as out:
        steps = [["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS],
                 ["nice", "cmake", "--build", str(build), "--config", "Release", f"-j{jobs}", "--target", *TARGETS]]
        for cmd in steps:
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in proc.stdout:
                out.write(line)
                if progress and line.startswith("["):  # "[ 42%] Building ..."
                    print(f"\r{line.strip()[:110]:<110}", end="", file=sys.stderr, flush=True)
            if proc.wait():
                raise LlamaPeerError(f"`{' '.join(cmd[:3])} ...` failed (exit {proc.returncode}); see {log}")
    if progress:
        print(file=sys.stderr)
    if (done := built(version)) is None:
        raise LlamaPeerError(f"the build finished but {', '.join(TARGETS)} are not in {bin_dir(version)}; see {log}")
    return done


def convert(hf_dir: str | os.PathLike, out_gguf: str | os.PathLike, outtype: str = "bf16",
            version: str = SDIST_VERSION) -> Path:
    """HF folder -> GGUF with the sdist's own convert_hf_to_gguf.py and gguf-py (in this Python: it needs
    torch, numpy, transformers, safetensors). Skipped when out_gguf exists and is newer than every file of the
    folder (tools/realistic_routing.py rewrites shards in place)."""
    if outtype not in OUTTYPES:
        raise LlamaPeerError(f"outtype {outtype!r}: choose from {', '.join(OUTTYPES)}")
    hf_dir, out = Path(hf_dir), Path(out_gguf)
    if out.is_file() and out.stat().st_mtime >= max(f.stat().st_mtime for f in hf_dir.iterdir() if f.is_file()):
        return out
    src = _fetch_source(version)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    # the sdist's converter, through the one wrapper that declares the test checkpoints' tokenizer (llamacpp_convert)
    cmd = [sys.executable, str(Path(__file__).with_name("llamacpp_convert.py")), "--llama-cpp", str(src),
           str(hf_dir), "--outfile", str(tmp), "--outtype", outtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "NO_LOCAL_GGUF": "1"})
    if proc.returncode or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise LlamaPeerError(f"convert_hf_to_gguf.py {hf_dir} --outtype {outtype} failed "
                             f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    os.replace(tmp, out)
    return out


def quantize(gguf: str | os.PathLike, qtype: str, out: str | os.PathLike | None = None, threads: int = 2,
             version: str = SDIST_VERSION) -> Path:
    """llama-quantize GGUF -> GGUF-QTYPE.gguf (next to it unless `out`); skipped when the result is newer."""
    if qtype not in QUANT_TYPES:
        raise LlamaPeerError(f"quant type {qtype!r}: choose from {', '.join(QUANT_TYPES)}")
    src = Path(gguf)
    dst = Path(out) if out else src.with_name(f"{src.stem.removesuffix('-BF16')}-{qtype}.gguf")
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    tool = ensure_built(version) / "llama-quantize"
    tmp = dst.with_name(dst.name + ".part")
    proc = subprocess.run(["nice", str(tool), str(src), str(tmp), qtype, str(threads)], capture_output=True, text=True)
    if proc.returncode or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise LlamaPeerError(f"llama-quantize {src} {qtype} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    os.replace(tmp, dst)
    return dst


@dataclass
class BenchResult:
    gguf: str
    model_type: str  # llama-bench's description, e.g. "qwen3moe 30B.A3B Q8_0"
    model_bytes: int  # the GGUF's tensor bytes (llama-bench's model_size)
    threads: int
    n_gen: int
    tok_s: float  # tg rate, mean of the repetitions
    tok_s_stddev: float
    samples_tok_s: list[float]
    build_commit: str


def complete(gguf: str | os.PathLike, prompt: str, n: int, threads: int = 2, version: str = SDIST_VERSION) -> bytes:
    """llama.cpp's greedy continuation of `prompt` (its raw bytes: a token may end inside a UTF-8 sequence).
    `-nr` (no weight repacking) keeps it off the AMX tile kernels, which die with SIGILL in VMs that do not grant
    the tile state (seen here: tinygemm_kernel_amx, `tilezero`). llama-completion prints through an asynchronous
    log thread that can lose the end of its output when the process exits: a complete run ends with the blank
    line it logs after generating, so a run without it is repeated (5 tries, then the longest output is returned;
    callers that compare N tokens ask for a few more, so that a lost tail cuts only those)."""
    tool = ensure_built(version) / "llama-completion"
    cmd = [str(tool), "-m", str(gguf), "-p", prompt, "-n", str(n), "--temp", "0", "--ignore-eos", "-no-cnv",
           "--no-warmup", "-nr", "-t", str(threads)]
    longest = b""
    for _ in range(5):
        proc = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL)
        if proc.returncode or not proc.stdout.startswith(prompt.encode()):
            raise LlamaPeerError(f"llama-completion {gguf} failed (exit {proc.returncode}):\n"
                                 f"{proc.stderr.decode(errors='replace')[-3000:]}")
        if proc.stdout.endswith(b"\n\n"):
            return proc.stdout[len(prompt.encode()):-2]
        longest = max(longest, proc.stdout[len(prompt.encode()):], key=len)
    return longest


def run_bench(gguf: str | os.PathLike, threads: int, n_gen: int = 32, repetitions: int = 3,
              version: str = SDIST_VERSION, timeout: float = 900.0) -> BenchResult:
    """llama-bench tgN (no prompt processing) on `threads` threads, CPU only, JSON output: the decode rate."""
    tool = ensure_built(version) / "llama-bench"
    cmd = [str(tool), "-m", str(gguf), "-p", "0", "-n", str(n_gen), "-t", str(threads), "-r", str(repetitions),
           "-ngl", "0", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise LlamaPeerError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return parse_bench_json(proc.stdout, str(gguf))


def parse_bench_json(text: str, gguf: str = "") -> BenchResult:
    """llama-bench -o json: a list of tests; the tg one (n_prompt 0, n_gen > 0) gives the rate."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as e:
        raise LlamaPeerError(f"llama-bench printed no JSON ({e}): {text[:500]!r}") from None
    tg = [t for t in tests if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    if not tg:
        raise LlamaPeerError(f"llama-bench's JSON has no tg test: {text[:500]!r}")
    t = tg[0]
    return BenchResult(gguf, t.get("model_type", ""), int(t.get("model_size", 0)), int(t.get("n_threads", 0)),
                       int(t["n_gen"]), float(t["avg_ts"]), float(t.get("stddev_ts", 0.0)),
                       [float(x) for x in t.get("samples_ts", [])], str(t.get("build_commit", "")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default=SDIST_VERSION, help="llama-cpp-python sdist version")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch", help="download and unpack the sdist only (the converter's sources; no build)")
    b = sub.add_parser("build")
    b.add_argument("-j", "--jobs", type=int, default=2)
    b.add_argument("--where-possible", action="store_true",
                   help="exit 0 with a note where cmake or c++ is missing or the sources cannot be downloaded "
                        "(the llama.cpp tests then skip, saying why); a build that fails still fails")
    c = sub.add_parser("convert")
    c.add_argument("hf_dir")
    c.add_argument("out")
    c.add_argument("--outtype", default="bf16", choices=OUTTYPES)
    q = sub.add_parser("quantize")
    q.add_argument("gguf")
    q.add_argument("type", choices=QUANT_TYPES)
    r = sub.add_parser("bench")
    r.add_argument("gguf")
    r.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    r.add_argument("--n-gen", type=int, default=32)
    r.add_argument("--repetitions", type=int, default=3)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "fetch":
            print(_fetch_source(a.version))
        elif a.cmd == "build":
            if a.where_possible and (tool := missing_toolchain()) is not None:
                _say(f"`{tool}` is not on PATH: llama.cpp is not built and its comparisons will skip")
                return 0
            if a.where_possible and built(a.version) is None:
                try:
                    _fetch_source(a.version)
                except LlamaPeerError as e:  # offline: nothing to build from
                    _say(f"llama.cpp's sources could not be fetched, its comparisons will skip: {e}")
                    return 0
            print(ensure_built(a.version, a.jobs))
        elif a.cmd == "convert":
            print(convert(a.hf_dir, a.out, a.outtype, a.version))
        elif a.cmd == "quantize":
            print(quantize(a.gguf, a.type, version=a.version))
        else:
            print(json.dumps(asdict(run_bench(a.gguf, a.threads, a.n_gen, a.repetitions, a.version)), indent=2))
    except LlamaPeerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
