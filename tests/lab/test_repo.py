"""The repository: layout, pins, README, CI entry, source notebooks without outputs."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

ROOT = Path(__file__).resolve().parents[2]


def _pins(path: Path) -> dict:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, ver = line.partition("==")
            assert ver, f"{path.name}: {line!r} is not pinned with =="
            pins[name.strip().lower()] = ver.strip()
    return pins


CONDA_NAMES = {"pytorch": "torch"}  # conda's name -> pip's


def test_layout():
    for p in ["notebooks", "fastattn", "data", "environment.yml", "README.md", "pyproject.toml",
              "tests", "Makefile", ".ci/run", ".gitignore", "requirements.txt", "requirements-voxcpm.txt"]:
        assert (ROOT / p).exists(), p


def test_environment_yml_agrees_with_pip_pins():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["name"] == "fastattn"
    conda = {}
    for dep in env["dependencies"]:
        if isinstance(dep, str) and "=" in dep:
            name, ver = re.split(r"=+", dep, maxsplit=1)
            conda[CONDA_NAMES.get(name, name).lower()] = ver
    assert conda.pop("python") == "3.11"
    text = (ROOT / "environment.yml").read_text()
    post = dict(m.groups() for m in re.finditer(r"fastattn:post-install (\S+)==(\S+)", text))
    pip = _pins(ROOT / "requirements.txt")
    voxcpm = _pins(ROOT / "requirements-voxcpm.txt")
    assert conda == pip, "environment.yml and requirements.txt disagree"
    assert post == voxcpm, "environment.yml's voxcpm post-install line and requirements-voxcpm.txt disagree"
    for card in ["jupyterlab", "torch", "numpy", "matplotlib", "ipywidgets", "papermill"]:
        assert card in conda
    assert "voxcpm" in post


def test_pins_are_what_is_installed():
    from importlib.metadata import version
    pins = {**_pins(ROOT / "requirements.txt"), **_pins(ROOT / "requirements-voxcpm.txt")}
    matrix = os.environ.get("FASTATTN_TORCH_MATRIX")  # make torch-matrix: another torch on purpose, no JupyterLab
    if matrix:
        pins["torch"] = matrix
        pins.pop("jupyterlab")
    for name, ver in pins.items():
        assert version(name).split("+")[0] == ver, f"{name}: installed {version(name)}, pinned {ver}"


def test_package_declares_ranges_not_pins():
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if "==" in d]
    assert any(d.startswith("torch>=") for d in deps)
    assert not [d for d in deps if d.startswith("voxcpm")], "voxcpm must be installed with --no-deps"


def test_readme_opens_with_the_two_commands():
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    cmds = [ln.split("#")[0].strip() for ln in blocks[0].splitlines() if ln.split("#")[0].strip()]
    assert cmds == ["make workbook", "make test"]


#: every command README shows -> the test that runs it (or "CI": .ci/run)
README_COMMANDS = {
    "make workbook": "test_readme_make_targets_resolve (make -n) and tests/test_workbook.py (the runner)",
    "make test": "CI",
    "make lab": "test_readme_make_targets_resolve (make -n)",
    "python -m fastattn gpu-check --quick": "tests/lab/test_gpucheck.py (--device cpu --quick)",
    "python -m fastattn workbook -p device cuda": "tests/lab/test_workbook.py (refused without CUDA, naming it)",
    "python -m fastattn gpu-check --only forms_check":
        "tests/lab/test_gpucheck.py::test_only_skip_and_resume_name_steps",
    "python -m fastattn workbook --profile reference": "tests/lab/test_workbook.py::test_the_reference_profile_*",
    "make torch-matrix TORCH=2.11.0 PY=3.12": "test_readme_make_targets_resolve (make -n)",
    'python -m fastattn run -- voxcpm design --text "Hello." --model-path CKPT --output out.wav':
        "tests/runtime/test_run.py::test_upstreams_cli_writes_the_same_wav_under_the_wrapper",
    "python -m fastattn run -- uvicorn app:app":
        "tests/runtime/test_run.py::test_every_process_is_patched_and_the_users_sitecustomize_still_runs",
}


def _readme_commands() -> list:
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [ln.split("#")[0].strip() for b in blocks for ln in b.splitlines() if ln.split("#")[0].strip()]


def test_every_readme_command_is_run_somewhere():
    assert set(_readme_commands()) == set(README_COMMANDS), "a README command without a test that runs it"


def test_readme_make_targets_resolve():
    for cmd in _readme_commands():
        if cmd.startswith("make "):
            r = subprocess.run(["make", "-n", *cmd.split()[1:]], cwd=ROOT, capture_output=True, text=True)
            assert r.returncode == 0 and r.stdout.strip(), (cmd, r.stderr)


def test_readme_links_resolve_and_it_reads_in_two_minutes():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 120
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        assert (ROOT / target).exists(), target


def test_ci_runs_make_test():
    text = (ROOT / ".ci/run").read_text()
    assert "make test" in text and "set -e" in text
    assert os.access(ROOT / ".ci/run", os.X_OK)


def test_no_registry_hosts_named():
    # Spelled in parts so that this file does not name them either.
    hosts = tuple(".".join(parts) for parts in (("pypi", "org"), ("files", "pythonhosted"), ("anaconda", "org"),
                                                 ("download", "pytorch", "org")))
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\n")  # what a commit can hold
    for p in (ROOT / name for name in listed if name):
        if p.is_file() and p.suffix in {".py", ".txt", ".yml", ".toml", ".md", ".ipynb", "", ".cfg"}:
            text = p.read_text(errors="ignore")
            assert not [h for h in hosts if h in text], p


def test_source_notebooks_carry_no_outputs():
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        for c in cells:
            if c["cell_type"] == "code":
                assert not c.get("outputs") and c.get("execution_count") is None, f"{nb.name} has outputs"
