"""The imports show the architecture: no cycle among fastattn's modules, and no module imports another's private
(underscore) name. Read from the source (ast), every import, at module level or inside a function."""

import ast
from pathlib import Path

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
    """Package __init__ modules that resolve names lazily (fastattn, fastattn.bench) are not edges: they import
    nothing at import time but what their module level names."""
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
