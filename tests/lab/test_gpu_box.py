"""``scripts/gpu-box.sh`` installs on the Pythons a GPU image may have: a PEP 668 system Python, where pip refuses to
install outside a venv, and a Python with no pip at all. Each is a scratch copy of this machine's base interpreter
(its stdlib linked in, the ``EXTERNALLY-MANAGED`` marker planted), with a stand-in torch in its site-packages and a
wheelhouse of two small wheels."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VER = f"python{sys.version_info.major}.{sys.version_info.minor}"
pytestmark = pytest.mark.slow


def _wheel(folder: Path, name: str) -> str:
    """A minimal pure-Python wheel ``name==1.0`` that installs module ``name``."""
    info = f"{name}-1.0.dist-info"
    files = {f"{name}.py": "PLANTED = True\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{info}/RECORD", "".join(f"{p},,\n" for p in [*files, f"{info}/RECORD"]))
    return f"{name}==1.0\n"


def _system_python(root: Path, *, managed: bool, pip: bool) -> Path:
    """A non-venv interpreter at ``root`` (``scripts/scratch-python.sh``) with the image's torch standing in."""
    r = subprocess.run(["bash", str(REPO / "scripts" / "scratch-python.sh"), sys.executable, str(root),
                        *(["managed"] if managed else []), *([] if pip else ["nopip"])], capture_output=True, text=True)
    if r.returncode == 2 and "layout" in r.stderr:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, r.stderr
    torch = root / "lib" / VER / "site-packages" / "torch"
    torch.mkdir()
    (torch / "__init__.py").write_text("__version__ = '2.11.0+box'\n")
    return Path(r.stdout.strip())


@pytest.fixture()
def wheelhouse(tmp_path):
    wh = tmp_path / "wh"
    wh.mkdir()
    (wh / "requirements.txt").write_text(_wheel(wh, "planted_a"))
    (wh / "requirements-nodeps.txt").write_text(_wheel(wh, "planted_b"))
    bundled = next(Path(sysconfig.get_path("stdlib"), "ensurepip", "_bundled").glob("pip-*.whl"), None)
    if bundled is None:
        pytest.skip("no pip wheel bundled with this Python's ensurepip")
    (wh / bundled.name).write_bytes(bundled.read_bytes())
    return wh


def _box(python: Path, wh: Path, cwd: Path, **env) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))},
           "PYTHON": str(python), "WHEELHOUSE": str(wh), "PIP_CONFIG_FILE": os.devnull, **env}
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu-box.sh"), "--install-only"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("managed,pip", [(True, True), (False, False)], ids=["pep668", "no-pip"])
def test_the_kit_installs_into_a_venv_over_the_system_packages(tmp_path, wheelhouse, managed, pip):
    python = _system_python(tmp_path / "sys", managed=managed, pip=pip)
    if managed:
        refused = subprocess.run([str(python), "-m", "pip", "install", "--no-index", "x"], capture_output=True,
                                 text=True)
        assert "externally-managed-environment" in refused.stderr  # the planted marker works as on Ubuntu 24.04
    r = _box(python, wheelhouse, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    kit = tmp_path / ".venv-gpu-box" / "bin" / "python"
    assert f"the kit's Python: {kit}" in r.stdout
    probe = "import planted_a, planted_b, torch; print(torch.__version__, torch.__file__)"
    out = subprocess.run([str(kit), "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.startswith("2.11.0+box") and str(tmp_path / "sys") in out  # the box's torch, from the box's site
    assert not list((tmp_path / "sys").rglob("planted_a*"))  # nothing went into the system Python


def test_break_system_packages_installs_into_the_system_python_when_asked(tmp_path, wheelhouse):
    python = _system_python(tmp_path / "sys", managed=True, pip=True)
    r = _box(python, wheelhouse, tmp_path, BREAK_SYSTEM_PACKAGES="1")
    assert r.returncode == 0 and f"the kit's Python: {python}" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / ".venv-gpu-box").exists() and list((tmp_path / "sys").rglob("planted_a.py"))
