"""Follow `run`'s arguments through the package (issue 46 item 7): run `offload-engine run` in-process on a model
under sys.settrace, record every call into a package module whose parameters carry run's arguments, and count the
modules they visit, how often they go back up the import order and how often they return to a module they had
left.

A call carries the arguments when a parameter is the argparse Namespace that `cmd_run` received, an options object
built from it (EngineConfig, SpeculativeConfig, Budget, PrefetchConfig), or the prompt or model path (by identity),
directly or inside a tuple, list or dict. The path is the callee modules of those calls in order, repeats in a row
collapsed. A module's import level: 0 for a module importing no package module, else 1 + the highest level among
the package modules it imports (every import statement, also inside functions, as tests/test_structure.py reads
them). "Up": a step of the path to a module of a higher level than the one before (the arguments travel against
the import order: a callback, or an object handed down calling back). "Returns": a step to a module the path had
visited before.

    python tools/arg_trace.py                                  # this tree, the demo model
    git worktree add /tmp/wt HEAD && python tools/arg_trace.py --root /tmp/wt --model offload_engine/data/demo-model
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
CARRIERS = ("EngineConfig", "SpeculativeConfig", "Budget", "PrefetchConfig")


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_levels(package: Path) -> dict[str, int]:
    """Each package module's import level (see the module docstring)."""
    paths = {module_name(p, package): p for p in package.rglob("*.py") if "data" not in p.relative_to(package).parts}
    known = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in known}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or "" if node.level == 0 else ".".join(
                    here[:len(here) - (node.level - 1)] + ([node.module] if node.module else []))
                found = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
                out |= found | ({base} if base in known and len(found) < len(node.names) else set())
        graph[name] = out - {name}
    levels: dict[str, int] = {}

    def level(name: str, seen: tuple[str, ...] = ()) -> int:
        if name not in levels:
            deps = [d for d in graph[name] if d not in seen]
            levels[name] = 1 + max((level(d, seen + (name,)) for d in deps), default=-1)
        return levels[name]

    for name in graph:
        level(name)
    return levels


def trace_run(root: Path, argv: list[str]) -> list[str]:
    """The callee modules of the calls carrying run's arguments, in call order."""
    sys.path.insert(0, str(root))
    from offload_engine.cli import main  # noqa: E402 (from `root`)

    package = str(root / "offload_engine") + "/"
    names: dict[str, str] = {}
    tainted: set[int] = set()
    calls: list[str] = []

    def module_of(filename: str) -> str | None:
        if not filename.startswith(package):
            return None
        if filename not in names:
            names[filename] = module_name(Path(filename), root / "offload_engine")
        return names[filename]

    def carries(value: Any, depth: int = 0) -> bool:
        if id(value) in tainted or type(value).__name__ in CARRIERS:
            return True
        if depth < 2 and isinstance(value, (tuple, list)):
            return any(carries(v, depth + 1) for v in value)
        if depth < 2 and isinstance(value, dict):
            return any(carries(v, depth + 1) for v in value.values())
        return False

    def tracer(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return None
        module = module_of(frame.f_code.co_filename)
        if module is None:
            return None
        if not tainted and frame.f_code.co_name == "cmd_run":
            args = frame.f_locals["args"]
            tainted.update({id(args), id(args.prompt), id(args.model)})
        if not tainted:
            return None
        code = frame.f_code
        n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
        local = frame.f_locals
        if any(carries(local.get(v)) for v in code.co_varnames[:n]):
            calls.append(module)
        return None

    sys.settrace(tracer)
    try:
        rc = main(argv)
    finally:
        sys.settrace(None)
    if rc != 0:
        raise SystemExit(f"run exited with {rc}")
    return calls


def counts(calls: list[str], levels: dict[str, int]) -> dict[str, Any]:
    path = [m for i, m in enumerate(calls) if i == 0 or calls[i - 1] != m]
    up = sum(1 for a, b in zip(path, path[1:]) if levels.get(b, 0) > levels.get(a, 0))
    seen: set[str] = set()
    returns = 0
    for m in path:
        returns += m in seen
        seen.add(m)
    return {"modules": len(seen), "up": up, "returns": returns, "steps": len(path),
            "levels": 1 + max(levels.values()), "path": path}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=HERE, help="the tree to measure (default: this one)")
    ap.add_argument("--model", default=None, help="the model `run` opens (default: the demo model of --root)")
    ap.add_argument("--tokens", type=int, default=4, help="tokens to generate (default 4)")
    ap.add_argument("--json", action="store_true", help="print the counts and the path as JSON")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    model = args.model or str(root / "offload_engine" / "data" / "demo-model")
    levels = import_levels(root / "offload_engine")
    calls = trace_run(root, ["run", "--model", model, "--prompt", "def fibonacci(n):", "--max-new-tokens",
                             str(args.tokens), "--quiet"])
    result = counts(calls, levels)
    config_level = levels.get("offload_engine.config")
    if args.json:
        print(json.dumps(result | {"config_level": config_level}, indent=2))
    else:
        print(f"\n{root}: run's arguments visit {result['modules']} modules, go back up the import order "
              f"{result['up']} times and return {result['returns']} times to a module they had left "
              f"({result['steps']} steps; {result['levels']} import levels, config.py on level {config_level})",
              file=sys.stderr)
        print(" -> ".join(m.removeprefix("offload_engine.") for m in result["path"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
