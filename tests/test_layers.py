"""The layering of the product (`murmur/`, `node/`, `protocol/`) and the lab beside it: what each layer may
import, and that it really does without the rest.

Behavioural part: in a fresh interpreter with torch (and numpy) blocked, every module of
`murmur.node.net` imports; with libp2p and multiaddr blocked, every module of `murmur.node.learn`
(with `murmur.node.net` blocked too) and of `murmur.node.averaging` imports.

Structural part, from an AST import graph (there is no behavioural way to see a cycle
that happens to resolve, or a dependency that is only imported lazily):

- cycles: only module-level imports count (`if TYPE_CHECKING:` blocks excluded), as those
  are what Python runs at import time; an import inside a function runs when called, after
  every module has loaded, so it cannot take part in an import-order cycle;
- layer direction: every import counts, lazy ones inside functions and TYPE_CHECKING ones
  too (a lazy import is still a dependency: a torch-free process calling that function
  would fail). The `murmur` command (`murmur.node.cli`) sits on top: it may import `ops` and,
  lazily, the lab's entry points, and nothing imports it;
- nothing else in the product imports `lab` (it is not installed: a product module that did
  would work only from a checkout).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("murmur", "node", "protocol")
EVERYTHING = (*PRODUCT, "lab")
LAB_LAUNCHER = "murmur.node.cli"  # `murmur bench` and `murmur demo` start the lab from a checkout

# Layer -> the packages it must not import (prefix match on dotted module names).
FORBIDDEN = {
    "murmur.node.net": ("murmur.node.learn", "murmur.node.averaging", "murmur.node.ops", "lab", "murmur.node.cli", "murmur.protocol.codec"),
    "murmur.node.learn": ("murmur.node.net", "murmur.node.averaging", "murmur.node.ops", "lab", "murmur.node.cli"),
    "murmur.node.averaging": ("murmur.node.ops", "lab", "murmur.node.cli"),
    "murmur.node.ops": ("lab", "murmur.node.cli"),
    "murmur": ("lab",),  # but see LAB_LAUNCHER
    "lab": ("murmur.node.cli",),
    "murmur.protocol": ("murmur.node",),
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    lazy: bool  # inside a function body
    type_only: bool  # under `if TYPE_CHECKING:`
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] not in ("murmur", "lab"):
        parts.insert(0, "murmur")  # node/ and protocol/ install as murmur.node, murmur.protocol
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, name: str, is_package: bool, modules: set[str]) -> list[Import]:
    found: list[Import] = []

    def resolve(node: ast.ImportFrom) -> list[str]:
        if node.level:  # relative: from the importer's package
            package = name if is_package else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
        subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
        return subs if len(subs) == len(node.names) else [base, *subs]

    def visit(node: ast.AST, lazy: bool, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(name, alias.name, lazy, type_only, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.extend(Import(name, target, lazy, type_only, node.lineno) for target in resolve(node))
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, lazy, True)
            for child in node.orelse:
                visit(child, lazy, type_only)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)), type_only)

    visit(tree, False, False)
    return found


def import_graph(root: Path, packages: tuple[str, ...] = EVERYTHING) -> tuple[set[str], list[Import]]:
    """Every module under `root`/`packages` and every import statement in them."""
    paths = {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    modules = set(paths)
    imports = [
        imp
        for name, path in paths.items()
        for imp in _imports(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", modules)
    ]
    return modules, imports


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def cycles(modules: set[str], imports: list[Import]) -> list[list[str]]:
    """Import cycles among `modules` through module-level, runtime imports (each cycle once)."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        if not imp.lazy and not imp.type_only and imp.imported in modules and imp.imported != imp.importer:
            edges[imp.importer].add(imp.imported)
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        path.append(m)
        for nxt in sorted(edges[m]):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt)
        path.pop()
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            walk(m)
    return found


def layer_violations(imports: list[Import]) -> list[str]:
    """One line per import that a layer holding its importer bans (the first such layer in `FORBIDDEN`)."""
    out = []
    for imp in imports:
        if imp.importer == LAB_LAUNCHER and imp.lazy and _under(imp.imported, "lab"):
            continue
        banned = [(layer, prefix) for layer, prefixes in FORBIDDEN.items() if _under(imp.importer, layer)
                  for prefix in prefixes if _under(imp.imported, prefix)]  # fmt: skip
        if banned:
            layer, prefix = banned[0]
            how = "lazily " if imp.lazy else ""
            out.append(f"{imp.importer}:{imp.line} {how}imports {imp.imported} ({layer} must not import {prefix})")
    return out


# --- the product's graph ----------------------------------------------------------------------


def test_no_import_cycles_among_product_and_lab_modules() -> None:
    modules, imports = import_graph(ROOT)
    assert {"murmur.peer", "murmur.node.net.transport", "murmur.protocol.codec", "lab.bench"} <= modules  # the walk found the tree
    assert cycles(modules, imports) == []


def test_each_layer_imports_only_the_layers_below_it() -> None:
    _, imports = import_graph(ROOT)
    assert layer_violations(imports) == []


# --- the checks themselves catch what they are for ----------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_checks_catch_a_cycle_and_wrong_way_imports(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "node/__init__.py": "",
        "node/net/__init__.py": "",
        "node/net/a.py": "from murmur.node.net import b\n",
        "node/net/b.py": "from . import a\n",  # a relative import closes the cycle
        "node/learn/__init__.py": "",
        "node/learn/t.py": "def f():\n    from murmur.node.net.a import x\n",  # lazy, still a violation
        "node/ops/__init__.py": "",
        "node/ops/run.py": "def g():\n    from lab.bench import main\n",  # ops drives no lab tooling
        "lab/swarm.py": "import murmur.node.cli\n",  # nothing imports the command
        "lab/__init__.py": "",
        "lab/demo.py": "",
        "node/cli.py": "def h():\n    from lab import demo\n",  # the launcher, lazily: allowed
        "murmur/peer.py": "from lab.demo import x\n",  # the rest of the product: not
        "murmur/__init__.py": "",
        "protocol/__init__.py": "",
        "protocol/m.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from murmur.node.net.a import y\n",
    })  # fmt: skip
    modules, imports = import_graph(root)
    assert cycles(modules, imports) == [["murmur.node.net.a", "murmur.node.net.b", "murmur.node.net.a"]]
    assert sorted(v.split(" (")[0] for v in layer_violations(imports)) == [
        "lab.swarm:1 imports murmur.node.cli",
        "murmur.node.learn.t:2 lazily imports murmur.node.net.a",
        "murmur.node.ops.run:2 lazily imports lab.bench",
        "murmur.peer:1 imports lab.demo",
        "murmur.protocol.m:3 imports murmur.node.net.a",
    ]


# --- blocked imports, in fresh interpreters ----------------------------------------------------

_IMPORT_ALL = """
import importlib, json, pkgutil, sys
for name in {blocked!r}:
    sys.modules[name] = None  # `import name` now raises ImportError
for name in {blocked!r}:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"blocking {{name}} did not work")
imported = []
for package in {packages!r}:
    pkg = importlib.import_module(package)
    imported.append(package)
    for info in pkgutil.walk_packages(pkg.__path__, package + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
print(json.dumps(imported))
"""


def _import_with_blocked(packages: list[str], blocked: list[str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL.format(packages=packages, blocked=blocked)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _modules_under(*packages: str) -> list[str]:
    modules, _ = import_graph(ROOT)
    return sorted(m for m in modules if any(_under(m, p) for p in packages))


def test_the_networking_layer_imports_without_torch_or_numpy() -> None:
    imported = _import_with_blocked(["murmur.node.net"], ["torch", "numpy"])
    assert sorted(imported) == _modules_under("murmur.node.net")  # every module, none skipped


@pytest.mark.parametrize(
    ("packages", "blocked"),
    [
        (["murmur.node.learn"], ["libp2p", "multiaddr", "murmur.node.net"]),
        (["murmur.node.averaging"], ["libp2p", "multiaddr"]),
    ],
)
def test_learning_and_averaging_import_without_libp2p(packages: list[str], blocked: list[str]) -> None:
    imported = _import_with_blocked(packages, blocked)
    assert sorted(imported) == _modules_under(*packages)
