"""The package's shape (docs/ARCHITECTURE.md): modules stay small, imports follow the flow
checkpoint -> planner -> store -> runtime -> generate/speculative -> api -> cli/server, no module imports
itself through others, and no test or tool reaches into a private attribute of the package."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "offload_engine"
MAX_LINES = 450

# each top-level package or module of offload_engine and its place in the flow: a module may import its own
# package and anything at its place or before it, nothing after it
STAGES = {
    "constants": 0, "errors": 0, "units": 0, "interrupts": 0, "defaults": 0, "modes": 0, "config": 0,
    "checkpoint": 1, "formats": 1, "tokenizer": 1, "tokenizer_tiktoken": 1,
    "planner": 2, "probe": 2,
    "store": 3, "prefetch": 3,
    "runtime": 4,
    "generate": 5, "quantize": 5, "speculative": 6,
    "assemble": 7, "api": 8, "distributed": 8,
    "cli": 9, "frontend": 9, "server": 9, "__init__": 10, "__main__": 10,
}
# config.py is plain data and the checks of its options' values: it imports only these leaves (no torch), so that
# every stage may take its options from it
CONFIG_IMPORTS = {"constants", "errors", "modes", "units"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "data" not in p.relative_to(PACKAGE).parts)


def _top(path: Path) -> str:
    """The stage name of a module file: its top-level package, or the module itself at the top level."""
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def _imported(path: Path, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The offload_engine top-level names an import statement reaches (absolute or relative)."""
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1] for a in node.names if a.name.startswith("offload_engine.")]
    if node.level == 0:
        if not (node.module or "").startswith("offload_engine"):
            return []
        parts = node.module.split(".")[1:]
        return [parts[0]] if parts else [a.name for a in node.names]
    package = path.relative_to(PACKAGE).parent.parts
    if node.level - 1 > len(package):
        return []
    base = list(package[:len(package) - (node.level - 1)])
    target = base + (node.module.split(".") if node.module else [])
    return [target[0]] if target else [a.name for a in node.names]


def test_no_module_is_a_god_file():
    long = {p.relative_to(ROOT).as_posix(): n for p in _modules()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them along their seams): {long}"


def test_config_is_a_leaf_of_plain_data():
    path = PACKAGE / "config.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    reached = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
               for t in _imported(path, node)}
    outside = {node.names[0].name for node in ast.walk(tree) if isinstance(node, ast.Import)} | {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert reached <= CONFIG_IMPORTS, f"config.py imports {sorted(reached - CONFIG_IMPORTS)} of the package"
    assert not {m for m in outside if m and m.split(".")[0] == "torch"}, "config.py imports torch"
    assert all(STAGES[name] == 0 for name in CONFIG_IMPORTS | {"config"})


def test_every_module_has_a_stage():
    unknown = sorted({_top(p) for p in _modules()} - set(STAGES))
    assert not unknown, f"give these a place in the flow (STAGES): {unknown}"


# known seams against the flow, each with its reason (remove an entry when its seam is fixed)
# (none since the architectures were split into a naming half, checkpoint/arch/, and an ops half, runtime/arch/)
AGAINST_THE_FLOW: set[tuple[str, str]] = set()


def test_imports_follow_the_flow():
    backwards = []
    for path in _modules():
        here = _top(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for there in _imported(path, node):
                    where = path.relative_to(ROOT).as_posix()
                    if (there != here and STAGES.get(there, -1) > STAGES[here]
                            and (where, there) not in AGAINST_THE_FLOW):
                        backwards.append(f"{path.relative_to(ROOT)}:{node.lineno} ({here}) imports {there}")
    assert not backwards, "imports against the flow:\n" + "\n".join(backwards)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(path: Path, node: ast.ImportFrom | ast.Import, known: set[str]) -> set[str]:
    """The package modules an import statement loads (`from .a import b` loads a.b when b is a module)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if node.level == 0:
        base = node.module or ""
    else:
        here = _module_name(path).split(".")
        if path.name != "__init__.py":
            here = here[:-1]
        here = here[:len(here) - (node.level - 1)]
        base = ".".join(here + ([node.module] if node.module else []))
    found = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
    names_from_base = len(found) < len(node.names)  # `from pkg import module` alone loads no name of pkg's own
    return found | ({base} if base in known and names_from_base else set())


def test_no_import_cycle():
    """No module imports itself through others, counting imports inside functions too (a lazy import for
    start-up time is fine; one that closes a cycle is a cycle dodged, not removed)."""
    paths = {_module_name(p): p for p in _modules()}
    known = set(paths)
    graph = {name: set() for name in known}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                # a package's __init__ runs on import of any module below it, but only edges we wrote count
                graph[name] |= _targets(path, node, known) - {name}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _private_names() -> set[str]:
    """Every single-underscore name the package defines (functions, classes, attributes, module globals)."""
    names: set[str] = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


# reaches into private attributes of objects that are not the package's (the standard library's locks)
FOREIGN = {("tests/test_interrupts.py", "event._cond._lock"), ("tests/test_interrupts.py", "event._cond")}


def test_no_test_or_tool_touches_a_private_attribute():
    private = _private_names()
    found = []
    for path in sorted([*(ROOT / "tests").glob("*.py"), *(ROOT / "tools").glob("*.py")]):
        where = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in private:
                owner = ast.unparse(node.value)
                if owner not in ("self", "cls") and (where, ast.unparse(node)) not in FOREIGN:
                    found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
            elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("setattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value in private):
                found.append(f"{where}:{node.lineno} setattr(..., {node.args[1].value!r})")
    assert not found, "tests and tools use the package's public surface only:\n" + "\n".join(found)


def test_every_architecture_has_both_halves():
    """A family registered for the checkpoint (naming: args, tensors) has ops for the runtime, and back."""
    from offload_engine.checkpoint.arch import architecture_modules, get_naming
    from offload_engine.runtime.arch import OPS

    names = {get_naming(model_type).name for model_type in architecture_modules()}
    assert names == set(OPS), f"naming without ops: {names - set(OPS)}; ops without naming: {set(OPS) - names}"
