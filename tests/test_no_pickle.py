"""P4: a static guard (AST) that no engine code unpickles checkpoint data or imports remote code.

Scans every .py under offload_engine/ and tools/ and fails on:
  * torch.load (or torch.serialization.load) without a literal `weights_only=True`; torch.hub.load;
  * any use of pickle / _pickle / cPickle / dill / joblib / marshal loaders, pickle.Unpickler, shelve.open,
    numpy.load unless `allow_pickle` is absent or literally False;
  * `trust_remote_code` set to anything but a literal False;
  * dynamic code: exec, eval, compile, __import__, importlib.import_module / __import__, importlib.util
    spec_from_file_location / module_from_spec, importlib.machinery.SourceFileLoader, runpy.*, and
    transformers' get_class_from_dynamic_module (the auto_map loader).
Uses are caught through aliases (`import pickle as p`, `from pickle import loads as l`) and without a call
(`f = pickle.loads`, `class U(pickle.Unpickler)`). Reviewed exceptions go in ALLOWED, one function at a time,
with the reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("offload_engine", "tools")

# (path relative to the repo root, rule, enclosing function) -> why it is safe. Only reviewed entries.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("offload_engine/checkpoint/arch/__init__.py", "dynamic-code", "get_naming"):
        "imports offload_engine.checkpoint.arch.<m> where <m> comes from the fixed _MODULES table, never from "
        "config text (an unknown model_type is refused before the import; see test_arch_registry_is_a_fixed_table)",
    ("offload_engine/__init__.py", "dynamic-code", "__getattr__"):
        "the package's public names load on first use (a Ctrl-C in the first second must not land inside torch's "
        "import): the module comes from the fixed _LAZY table of the package's own submodules",
    ("offload_engine/cli.py", "dynamic-code", "main"):
        "imports each command's modules from the fixed COMMAND_IMPORTS table (the package's own and uvicorn/tqdm) "
        "once the exit-at-once SIGINT handler is installed; nothing comes from user input",
    ("tools/quant_peers.py", "dynamic-code", "load"):
        "test tooling: AutoGPTQ's and AutoAWQ's own pure-torch files (the GPTQ/AWQ references), by path from their "
        "PyPI releases fetched with pip; never a checkpoint's code, never at run time",
}

UNPICKLERS = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "pickle._load", "pickle._loads", "pickle._Unpickler",
    "_pickle.load", "_pickle.loads", "_pickle.Unpickler", "cPickle.load", "cPickle.loads", "cPickle.Unpickler",
    "dill.load", "dill.loads", "dill.Unpickler", "cloudpickle.load", "cloudpickle.loads", "joblib.load",
    "marshal.load", "marshal.loads", "shelve.open", "torch.hub.load", "torch.hub.load_state_dict_from_url",
    "pandas.read_pickle",
}
DYNAMIC_CODE = {
    "exec", "eval", "compile", "__import__", "builtins.exec", "builtins.eval", "builtins.compile",
    "builtins.__import__", "importlib.import_module", "importlib.__import__", "importlib.util.spec_from_file_location",
    "importlib.util.module_from_spec", "importlib.machinery.SourceFileLoader", "runpy.run_path", "runpy.run_module",
    "transformers.dynamic_module_utils.get_class_from_dynamic_module",
    "transformers.dynamic_module_utils.get_class_in_module",
}
TORCH_LOADS = {"torch.load", "torch.serialization.load"}
BUILTIN_NAMES = {"exec", "eval", "compile", "__import__"}


def _is_const(node: ast.AST | None, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


class _Guard(ast.NodeVisitor):
    """Resolves names through the module's imports and records (line, rule, detail) violations."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}
        self.found: list[tuple[int, str, str, str]] = []
        self._checked_calls: set[int] = set()
        self._functions: list[str] = []

    def visit_FunctionDef(self, node) -> None:
        self._functions.append(node.name)
        self.generic_visit(node)
        self._functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    # imports define what a name means
    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.asname:
                self.aliases[a.asname] = a.name
            else:
                self.aliases[a.name.split(".")[0]] = a.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and not node.level:
            for a in node.names:
                self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(self, node: ast.AST) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        root = self.aliases.get(node.id, node.id)
        return ".".join([root, *reversed(parts)])

    def flag(self, node: ast.AST, rule: str, detail: str) -> None:
        self.found.append((node.lineno, rule, detail, ".".join(self._functions) or "<module>"))

    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func)
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        if name in TORCH_LOADS:
            self._checked_calls.add(id(node.func))
            if not _is_const(kw.get("weights_only"), True):
                self.flag(node, "torch.load", f"{name}(...) without weights_only=True")
        if name == "numpy.load":
            if "allow_pickle" in kw and not _is_const(kw["allow_pickle"], False):
                self.flag(node, "pickle", "numpy.load(..., allow_pickle=...) may unpickle")
        if "trust_remote_code" in kw and not _is_const(kw["trust_remote_code"], False):
            self.flag(node, "remote-code", f"{name}(trust_remote_code=...)")
        if any(k.arg is None for k in node.keywords) and name and name.endswith("from_pretrained"):
            self.flag(node, "remote-code", f"{name}(**kwargs) may carry trust_remote_code")
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for k, v in zip(node.keys, node.values):
            if isinstance(k, ast.Constant) and k.value == "trust_remote_code" and not _is_const(v, False):
                self.flag(node, "remote-code", "{'trust_remote_code': ...}")
        self.generic_visit(node)

    def _reference(self, node: ast.AST) -> None:
        name = self.dotted(node)
        if name is None:
            return
        if name in UNPICKLERS:
            self.flag(node, "pickle", name)
        elif name in DYNAMIC_CODE:
            self.flag(node, "dynamic-code", name)
        elif name in TORCH_LOADS and id(node) not in self._checked_calls:
            self.flag(node, "torch.load", f"{name} used without a call we can check")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._reference(node)
        # the inner chain (e.g. `pickle` of `pickle.loads`) is not itself a violation; don't descend into names
        if not isinstance(node.value, (ast.Name, ast.Attribute)):
            self.visit(node.value)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.aliases or node.id in BUILTIN_NAMES:
            self._reference(node)


def scan_source(source: str, filename: str = "<string>") -> list[tuple[int, str, str, str]]:
    """(line, rule, detail, enclosing function) of every violation in `source`."""
    tree = ast.parse(source, filename=filename)
    guard = _Guard()
    # imports first (a module may use a name above a function-level import), then everything
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            guard.visit(node)
    guard.visit(tree)
    return sorted(set(guard.found))


def _files() -> list[Path]:
    return sorted(p for d in SCANNED if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py")
                  if ".venv" not in p.parts and "__pycache__" not in p.parts)


def test_engine_and_tools_never_unpickle_or_import_remote_code():
    files = _files()
    assert any(p.parts[-2:] == ("checkpoint", "index.py") for p in files), "scan found no engine sources"
    problems = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for line, rule, detail, func in scan_source(path.read_text(encoding="utf-8"), rel):
            if (rel, rule, func) not in ALLOWED:
                problems.append(f"{rel}:{line}: [{rule}] {detail} (in {func})")
    assert not problems, "unsafe loading or dynamic code (RELIABILITY P4):\n" + "\n".join(problems)


def test_allowed_exceptions_are_still_needed():
    live = {(p.relative_to(ROOT).as_posix(), rule, func) for p in _files()
            for _, rule, _, func in scan_source(p.read_text(encoding="utf-8"))}
    stale = set(ALLOWED) - live
    assert not stale, f"ALLOWED entries no longer needed, remove them: {sorted(stale)}"


def test_arch_registry_is_a_fixed_table():
    """The one allowed import_module: model_type only selects from a fixed table of sibling modules."""
    arch = pytest.importorskip("offload_engine.checkpoint.arch")
    from offload_engine.errors import CheckpointError

    table = arch.architecture_modules()  # the registry is this table; a change of design must change this test too
    folder = Path(arch.__file__).parent
    for model_type, module in table.items():
        assert module.isidentifier() and (folder / f"{module}.py").is_file(), (model_type, module)
    for hostile in ("modeling_evil", "../../evil", "os", "llama.__init__", "__init__"):
        with pytest.raises(CheckpointError):
            arch.get_naming(hostile)


# ---- the guard catches what it should (and nothing it should not) ------------------------------------------
BAD = {
    "torch_load_plain": "import torch\ntorch.load(p)",
    "torch_load_false": "import torch\ntorch.load(p, weights_only=False)",
    "torch_load_variable": "import torch\ntorch.load(p, weights_only=flag)",
    "torch_load_alias": "import torch as t\nt.load(p)",
    "torch_load_from": "from torch import load\nload(p)",
    "torch_load_from_alias": "from torch import load as ld\nld(p, weights_only=True)\nf = ld",
    "torch_serialization": "import torch.serialization\ntorch.serialization.load(p)",
    "torch_load_reference": "import torch\nloader = torch.load",
    "torch_hub": "import torch\ntorch.hub.load('x', 'y')",
    "pickle_load": "import pickle\npickle.load(f)",
    "pickle_loads": "import pickle\npickle.loads(b)",
    "pickle_alias": "import pickle as pk\npk.loads(b)",
    "pickle_from": "from pickle import loads\nloads(b)",
    "pickle_unpickler_subclass": "import pickle\nclass U(pickle.Unpickler):\n    pass",
    "pickle_reference": "import pickle\nf = pickle.loads",
    "cpickle": "import _pickle\n_pickle.loads(b)",
    "dill": "import dill\ndill.load(f)",
    "joblib": "import joblib\njoblib.load(p)",
    "marshal": "import marshal\nmarshal.loads(b)",
    "numpy_allow_pickle": "import numpy as np\nnp.load(p, allow_pickle=True)",
    "trust_remote_code_kw": "from transformers import AutoConfig\nAutoConfig.from_pretrained(p, trust_remote_code=True)",
    "trust_remote_code_var": "def f(m, t):\n    return m.from_pretrained('x', trust_remote_code=t)",
    "trust_remote_code_dict": "kw = {'trust_remote_code': True}",
    "from_pretrained_kwargs": "def f(m, kw):\n    return m.from_pretrained('x', **kw)",
    "exec": "exec(code)",
    "eval": "eval(expr)",
    "compile": "compile(src, 'f', 'exec')",
    "dunder_import": "__import__(name)",
    "import_module": "import importlib\nimportlib.import_module(cfg['auto_map'])",
    "import_module_from": "from importlib import import_module\nimport_module(n)",
    "spec_from_file": "import importlib.util\nimportlib.util.spec_from_file_location('m', p)",
    "source_loader": "from importlib.machinery import SourceFileLoader\nSourceFileLoader('m', p).load_module()",
    "runpy": "import runpy\nrunpy.run_path(p)",
    "dynamic_module": "from transformers.dynamic_module_utils import get_class_from_dynamic_module\n"
                      "get_class_from_dynamic_module('a.B', p)",
    "function_level_import": "def f(b):\n    import pickle\n    return pickle.loads(b)",
}
GOOD = {
    "torch_load_safe": "import torch\ntorch.load(p, weights_only=True, map_location='cpu')",
    "pickle_dumps": "import pickle\npickle.dumps(x)",
    "numpy_load_plain": "import numpy as np\nnp.load(p)\nnp.load(p, allow_pickle=False)",
    "remote_code_false": "from transformers import AutoConfig\nAutoConfig.from_pretrained(p, trust_remote_code=False)",
    "re_compile": "import re\nre.compile('x')",
    "torch_compile": "import torch\ntorch.compile(m)",
    "importlib_metadata": "import importlib.metadata\nimportlib.metadata.version('torch')",
    "reading_auto_map_key": "def f(cfg):\n    return 'auto_map' in cfg",
    "method_named_load": "def f(store):\n    return store.load(p)",
    "safetensors": "from safetensors import safe_open\nsafe_open(p, 'pt')",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_guard_flags(name):
    assert scan_source(BAD[name]), f"guard missed: {BAD[name]!r}"


@pytest.mark.parametrize("name", sorted(GOOD))
def test_guard_allows(name):
    assert not scan_source(GOOD[name]), scan_source(GOOD[name])
