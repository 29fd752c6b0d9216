"""The package's import graph (module level and function level): no circles, and the layering of docs/architecture.md.

Rules: no import circle anywhere; ``kernels`` imports nothing of the package outside ``kernels``; ``layers`` and
``vllm_plugin`` never import each other; ``vllm_plugin`` imports nothing from ``verify``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "megatron_consistent"
PACKAGE = PACKAGE_DIR.name

# (importer subpackage, imported subpackage) pairs that must not occur (beside the no-circle rule)
FORBIDDEN = (("vllm_plugin", "verify"), ("layers", "vllm_plugin"), ("vllm_plugin", "layers"))
GROUND = "kernels"  # imports nothing of the package outside itself


def package_sources(root: Path = PACKAGE_DIR) -> dict[str, str]:
    """Dotted module name -> source of every module of the package under ``root`` (``__init__`` = the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return out


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its body (relative imports resolved; ``from X import Y``
    is an edge to ``X.Y`` when that is a module, else to ``X``)."""
    packages = {m for m, src in sources.items() if any(o.startswith(m + ".") for o in sources)}
    graph = {}
    for module, src in sources.items():
        base = module if module in packages else module.rpartition(".")[0]  # what a level-1 relative import means
        edges = set()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base.split(".")[: len(base.split(".")) - (node.level - 1)]
                    stem = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in sources else stem for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in sources:  # ``import a.b.c`` of a package module: the deepest module named
                    t = t.rpartition(".")[0]
                if t and t != module:
                    edges.add(t)
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def subpackage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the package's top-level parts (subpackages and top-level modules)."""
    out: dict[str, set[str]] = {}
    for src, targets in graph.items():
        for dst in targets:
            if _subpackage(src) != _subpackage(dst):
                out.setdefault(_subpackage(src), set()).add(_subpackage(dst))
    return out


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            a, b = _subpackage(src), _subpackage(dst)
            if (a, b) in FORBIDDEN:
                out.append(f"{src} -> {dst} ({a} must not import {b})")
            if a == GROUND and b != GROUND:
                out.append(f"{src} -> {dst} ({GROUND} imports nothing above it)")
    return out


def test_no_import_circles():
    found = circles(import_graph(package_sources()))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_circles_between_subpackages():
    found = circles(subpackage_graph(import_graph(package_sources())))
    assert not found, "circles between parts of the package:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_layering():
    problems = layering_violations(import_graph(package_sources()))
    assert not problems, "\n".join(problems)


@pytest.fixture
def bad_package(tmp_path):
    """A synthetic package with a function-level circle, vllm_plugin -> verify, vllm_plugin -> layers, kernels -> verify
    and (through other modules) verify -> layers: a circle between subpackages only."""
    files = {
        "__init__.py": "",
        "kernels/__init__.py": "from .ops import op\n",
        "kernels/ops.py": "def op():\n    from ..verify import capture\n",
        "layers/__init__.py": "",
        "layers/model.py": "from ..kernels import op\nfrom . import hybrid\n",
        "layers/hybrid.py": "def f():\n    from .model import build\n",
        "vllm_plugin/__init__.py": "",
        "vllm_plugin/model.py": "import megatron_consistent.verify.capture\nfrom ..layers import model\n",
        "verify/__init__.py": "",
        "verify/capture.py": "from ..layers import util\n",
        "layers/util.py": "",
    }
    root = tmp_path / PACKAGE
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_checker_catches_a_bad_graph(bad_package):
    graph = import_graph(package_sources(bad_package))
    assert graph[f"{PACKAGE}.layers.model"] == {f"{PACKAGE}.kernels", f"{PACKAGE}.layers.hybrid"}
    assert graph[f"{PACKAGE}.kernels.ops"] == {f"{PACKAGE}.verify.capture"}
    assert circles(graph) == [[f"{PACKAGE}.layers.hybrid", f"{PACKAGE}.layers.model"]]  # through a function-level import
    assert circles(subpackage_graph(graph)) == [["kernels", "layers", "verify"]]  # verify -> layers.util: modules acyclic
    problems = layering_violations(graph)
    assert problems == [f"{PACKAGE}.kernels.ops -> {PACKAGE}.verify.capture (kernels imports nothing above it)",
                        f"{PACKAGE}.vllm_plugin.model -> {PACKAGE}.layers.model (vllm_plugin must not import layers)",
                        f"{PACKAGE}.vllm_plugin.model -> {PACKAGE}.verify.capture (vllm_plugin must not import verify)"]
