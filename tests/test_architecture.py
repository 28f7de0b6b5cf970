"""The imports show the architecture: no cycle among fastattn's modules, and no module imports another's private
(underscore) name. Read from the source (ast), every import, at module level or inside a function."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

PKG = Path(__file__).resolve().parents[1] / "fastattn"


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(current: str, is_pkg: bool, level: int, name: str) -> str:
    base = current.split(".") if is_pkg else current.split(".")[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def imports() -> dict:
    """module -> [(imported module, names, line)] for every import of a fastattn module."""
    mods = {_module(p): p for p in PKG.rglob("*.py")}
    out = {}
    for mod, path in mods.items():
        edges = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fastattn")):
                target = _resolve(mod, path.name == "__init__.py", node.level, node.module or "") if node.level \
                    else node.module
                for alias in node.names:  # `from . import x` imports the module x
                    sub = f"{target}.{alias.name}"
                    edges.append((sub, (), node.lineno) if sub in mods else (target, (alias.name,), node.lineno))
            elif isinstance(node, ast.Import):
                edges += [(a.name, (), node.lineno) for a in node.names if a.name.startswith("fastattn")]
        out[mod] = [e for e in edges if e[0] in mods and e[0] != mod]
    return out


def test_no_module_imports_another_modules_private_name():
    bad = [f"{mod}:{line} imports {name} from {target}" for mod, edges in imports().items()
           for target, names, line in edges for name in names if name.startswith("_") and name != "__version__"]
    assert not bad, "\n".join(bad)


def test_the_import_graph_has_no_cycle():
    graph = {m: {t for t, _, _ in edges} for m, edges in imports().items()}
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            visit(t)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


RUNTIME = ("core", "clock", "step", "modes", "masks", "exactness", "fast", "static", "cache", "patch", "forward")


def test_no_runtime_module_imports_the_measuring_layer_or_a_notebooks_module():
    """The runtime sits at the bottom: it times its own choices (fastattn.clock), never with fastattn.bench."""
    bad = [f"{mod}:{line} imports {target}" for mod, edges in imports().items() if mod.split(".")[-1] in RUNTIME
           and mod.count(".") == 1 for target, _, line in edges
           if target.startswith(("fastattn.bench", "fastattn.experiments"))]
    assert not bad, "\n".join(bad)


def test_no_module_is_shadowed_by_a_function():
    """``fastattn.<name>`` is the module of that name wherever one exists (the package's names never hide one):
    ``fastattn.attention`` is the structured-mask function because no module is called attention."""
    import fastattn
    modules = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"} | {p.name for p in PKG.iterdir()
                                                                            if (p / "__init__.py").exists()}
    assert not modules & set(fastattn.__all__), modules & set(fastattn.__all__)
    assert all(hasattr(fastattn, n) for n in fastattn.__all__)


def test_only_notebooks_import_the_notebooks_modules():
    """``experiments/`` holds what exactly one notebook needs: no module outside it imports it."""
    bad = [f"{mod}:{line} imports {target}" for mod, edges in imports().items()
           if not mod.startswith("fastattn.experiments") for target, _, line in edges
           if target.startswith("fastattn.experiments")]
    assert not bad, "\n".join(bad)
