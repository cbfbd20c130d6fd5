"""The import structure of r2lm/ (issue 31): no import cycle, and the layers keep their direction.

The graph is read from the source (ast), every import counted, a function's own included: a cycle kept alive by a
function-local import is still a cycle. Importing `r2lm.a.b` also runs the package `r2lm.a` (its __init__), so that
is an arrow too, unless the importer is inside `r2lm.a` itself.

Directions: the model reaches the generator only through its mixin (r2lm.generation.mixin), which the model class
inherits as transformers' models inherit GenerationMixin; the generator uses the model only through its methods,
importing nothing above it; the checkpoint formats, which the model loads through, import neither the model nor the
generator (the ZeRO export, which builds a model, is the one module of r2lm.checkpoints above it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import REPO

ROOT = REPO / "r2lm"


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of `root`'s package it imports (anywhere in its source)."""
    package = root.name
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:  # the deepest module of the package that `name` lies in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*here.split(".")[: len(here.split(".")) - node.level + 1], *filter(None, [base])])
                targets |= {f"{base}.{alias.name}" for alias in node.names}
        arrows = set()
        for target in targets:
            module = resolve(target) if target.split(".")[0] == package else None
            if module is None or module == name:
                continue
            arrows.add(module)
            parent = module.rpartition(".")[0]
            while parent and not (name == parent or name.startswith(parent + ".")):  # packages the import runs
                arrows.add(parent)
                parent = parent.rpartition(".")[0]
        graph[name] = arrows
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_no_import_cycle(graph):
    assert cycles(graph) == []


def test_the_checkpoint_formats_reach_neither_the_model_nor_the_generator(graph):
    """(But the ZeRO export, which builds a model: the package's __init__ does not import it.)"""
    for module in (m for m in graph if _inside(m, "r2lm.checkpoints") and m != "r2lm.checkpoints.export"):
        above = {m for m in reach(graph, module) if _inside(m, "r2lm.generation") or
                 m in ("r2lm.modeling_r2lm", "r2lm.drafter", "r2lm") or _inside(m, "r2lm.convert")}
        assert not above, (module, above)


def test_the_model_reaches_the_generator_through_its_mixin_only(graph):
    assert {m for m in graph["r2lm.modeling_r2lm"] if _inside(m, "r2lm.generation")} == {
        "r2lm.generation.mixin", "r2lm.generation"}  # (the package: importing the mixin runs its __init__)


def test_the_generator_imports_nothing_above_it(graph):
    above = ("r2lm.modeling_r2lm", "r2lm.drafter", "r2lm.scoring", "r2lm.diffusion", "r2lm.convert", "r2lm.cli",
             "r2lm.checkpoints")
    for module in (m for m in graph if _inside(m, "r2lm.generation") and m != "r2lm.generation.mixin"):
        assert not {m for m in reach(graph, module) if any(_inside(m, a) for a in above) or m == "r2lm"}, module


def test_no_function_local_import_of_r2lm():
    """Imports of r2lm's own modules sit at the top of the module (a function-local one is how a cycle hides);
    function-local imports of optional third-party packages (deepspeed, peft, gguf, ...) are fine."""
    local = []
    for path in ROOT.rglob("*.py"):
        for function in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(function):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        [node.module or "."] if isinstance(node, ast.ImportFrom) else []
                    if any(n.split(".")[0] in ("r2lm", ".") or (isinstance(node, ast.ImportFrom) and node.level)
                           for n in names):
                        local.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert local == []


def test_the_reader_finds_a_cycle_hidden_in_a_function(tmp_path):
    """The graph counts function-local imports and the packages an import runs (a check that cannot fail is none)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import g\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub.b import g\n    return g\n")
    (pkg / "sub" / "b.py").write_text("def g():\n    return 1\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert cycles(import_graph(pkg)) == []
    (pkg / "sub" / "__init__.py").write_text("from pkg.a import f\n")  # sub's package runs when a imports sub.b
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.sub"]]
