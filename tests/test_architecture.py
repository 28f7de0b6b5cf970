"""The imports show the architecture: the runtime (fastattn's top level) imports no lab module and no notebook library
and fits its line budget; no cycle among fastattn's modules or among tools/; no module imports another's private
(underscore) name. Read from the source (ast), every import, at module level or inside a function."""

import ast
import subprocess
import sys
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


def runtime_files() -> list:
    """The runtime: every module of fastattn outside ``fastattn.lab``."""
    return sorted(p for p in PKG.rglob("*.py") if "lab" not in p.relative_to(PKG).parts)


#: what a notebook, a report or a plot needs: the runtime imports none of them (it depends on torch and voxcpm)
NOTEBOOK_LIBRARIES = ("papermill", "nbconvert", "nbformat", "nbclient", "ipykernel", "ipywidgets", "IPython",
                      "jupyter_client", "matplotlib", "yaml", "pandas")
RUNTIME_LINES = 3350  # 3,300 until issue 54's exact default for the VAE stream (fastattn.vae, its two targets)


def _third_party(path: Path) -> set:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level and n.module}
    return {n.split(".")[0] for n in names}


def test_the_runtime_imports_no_lab_module():
    """Not at module level, not inside a function: the lab sits above the runtime, never below it."""
    runtime = {_module(p) for p in runtime_files()}
    bad = [f"{mod}:{line} imports {target}" for mod, edges in imports().items() if mod in runtime
           for target, _, line in edges if target.startswith("fastattn.lab")]
    assert not bad, "\n".join(bad)


def test_the_runtime_imports_no_notebook_library():
    bad = {_module(p): sorted(_third_party(p) & set(NOTEBOOK_LIBRARIES)) for p in runtime_files()}
    assert not {m: libs for m, libs in bad.items() if libs}


def test_the_runtime_fits_its_line_budget():
    """A module a user or a maintainer reads in an hour."""
    lines = sum(len(p.read_text().splitlines()) for p in runtime_files())
    assert lines <= RUNTIME_LINES, lines


def test_importing_fastattn_loads_no_lab_module():
    code = "import sys, fastattn; print(sorted(m for m in sys.modules if m.startswith('fastattn.lab')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize("name", __import__("fastattn").MOVED)
def test_each_moved_name_is_the_lab_module_itself_with_a_warning(name):
    """The old names (``fastattn.bench``, ``import fastattn.bench.records``) work for one release, and warn."""
    import importlib

    import fastattn
    lab = importlib.import_module(f"fastattn.lab.{name}")
    with pytest.warns(DeprecationWarning, match=f"fastattn.lab.{name}"):
        assert getattr(fastattn, name) is lab
    sub = next((f"{name}.{p.stem}" for p in sorted((PKG / "lab" / name).glob("[a-z]*.py"))), None)
    if sub:  # a moved folder: its modules import by the old dotted name, as the same objects
        with pytest.warns(DeprecationWarning):
            old = importlib.import_module(f"fastattn.{sub}")
        assert old is importlib.import_module(f"fastattn.lab.{sub}") and old.__spec__.name == f"fastattn.lab.{sub}"


def test_upstream_diff_is_re_exported_with_a_warning():
    import fastattn
    from fastattn.lab.upstream import upstream_diff
    with pytest.warns(DeprecationWarning, match="fastattn.lab.upstream"):
        assert fastattn.upstream_diff is upstream_diff


def test_tools_import_each_other_without_a_cycle():
    tools = PKG.parent / "tools"
    graph = {p.stem: {n.module.split(".")[1] for n in ast.walk(ast.parse(p.read_text()))
                      if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("tools.")}
             | {a.name for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom)
                and n.module == "tools" for a in n.names} for p in tools.glob("*.py")}

    def reaches(a, b, seen=()):
        return any(n == b or (n not in seen and reaches(n, b, (*seen, n))) for n in graph.get(a, ()))
    assert not [m for m in graph if reaches(m, m)]


def test_no_module_is_shadowed_by_a_function():
    """``fastattn.<name>`` is the module of that name wherever one exists (the package's names never hide one):
    ``fastattn.attention`` is the structured-mask function because no module is called attention."""
    import fastattn
    modules = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"} | {p.name for p in PKG.iterdir()
                                                                            if (p / "__init__.py").exists()}
    modules |= set(fastattn.MOVED)  # the old names of lab modules are theirs too
    assert not modules & set(fastattn.__all__), modules & set(fastattn.__all__)
    assert all(hasattr(fastattn, n) for n in fastattn.__all__)


def test_only_notebooks_import_the_notebooks_modules():
    """``experiments/`` holds what exactly one notebook needs: no module outside it imports it."""
    bad = [f"{mod}:{line} imports {target}" for mod, edges in imports().items()
           if not mod.startswith("fastattn.lab.experiments") for target, _, line in edges
           if target.startswith("fastattn.lab.experiments")]
    assert not bad, "\n".join(bad)
