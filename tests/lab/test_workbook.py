"""Every notebook executes headless through papermill with smoke parameters; the runner's folder has what
it promises; bad parameters fail early and clearly; source notebooks carry no outputs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import papermill as pm
import pytest

from fastattn.lab import workbook as wb
from fastattn.lab.bench.records import load_run
from fastattn.lab.paths import repo_root

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

SMOKE = {
    "01_root_cause": {"positions": [0, 100, 500], "capacity": 1024, "repeats": 2, "preset": "tiny", "chunks": 30,
                      "consumer_at": [1, 25, 50], "contention_chunks": 6, "prompt_calls": 6,
                      "audio_chunks": 6},
    "02_backend_selection": {"capacity": 1024, "position": 100},
    "03_causality_checks": {"capacity": 512, "positions": list(range(0, 512, 16)), "interactive": True,
                            "ladder_capacity": 1024},
    "04_patch_application": {"dtype": "float32", "steps": 40},
    "05_profiling": {"positions": [0, 256], "capacity": 1024, "repeats": 2, "preset": "tiny", "steps": 4,
                     "interactive": True, "rss_runs": 1, "growth_steps": [400], "step_preset": "tiny"},
}


def test_five_notebooks_in_order():
    assert [p.stem for p in NOTEBOOKS] == list(SMOKE)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_structure(nb):
    cells = nbformat.read(str(nb), as_version=4).cells
    code = [c for c in cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", [])
    assert cells[0].cell_type == "markdown"
    assert "findings(" in code[-1].source, "each notebook ends with a Findings cell"
    params = pm.inspect_notebook(str(nb))
    assert {"device", "out_dir"} <= set(params)
    assert all(p["help"] for p in params.values()), "every parameter is documented with a comment"
    assert all(p["inferred_type_name"] != "None" for p in params.values()), "every parameter is typed"
    for c in code[1:]:  # the parameters cell declares, one line per parameter
        assert len(c.source.splitlines()) <= 14, f"{nb.name}: logic belongs in fastattn, not in a long cell"


@pytest.mark.slow
@pytest.mark.parametrize("stem", [s for s in SMOKE if s != "02_backend_selection"])
def test_runner_executes_each_notebook(stem, tmp_path):
    """The workbook through the runner, smoke-sized, one notebook at a time with its own parameters (02 runs under
    plain papermill below); 04 the way maintainers with weights run it, from a saved checkpoint (random weights are
    01, 03 and 05's path)."""
    params = SMOKE[stem]
    if stem == "04_patch_application":
        from fastattn.models import build_voxcpm2, save_voxcpm2
        ckpt = save_voxcpm2(build_voxcpm2("tiny", dtype=params["dtype"]), tmp_path / "ckpt")
        params = {**params, "checkpoint_path": str(ckpt)}
    run_dir, summary = wb.run_workbook(params, only=[stem], out=tmp_path / "runs", log=lambda *_: None, budget_s=None,
                                       timeout=300)  # a smoke cell takes seconds: a stall fails in minutes
    nb = summary["notebooks"][0]
    assert summary["status"] == "ok", nb.get("error")
    assert (run_dir / f"{stem}.ipynb").exists() and (run_dir / f"{stem}.html").exists()
    assert (run_dir / "summary.json").exists() and (run_dir / "index.html").exists()
    assert nb["findings"], f"{stem} wrote no findings"
    executed = nbformat.read(str(run_dir / f"{stem}.ipynb"), as_version=4)
    text = json.dumps(executed)
    assert "it/s]" not in text, "progress-bar spam in the executed notebook"
    if stem in ("01_root_cause", "03_causality_checks", "05_profiling"):
        assert list((run_dir / stem / "figures").glob("*.png"))
        assert "image/png" in text
    _check_report(run_dir, stem)
    _no_gpu_claim_judged_here(run_dir)
    if stem == "04_patch_application":
        assert "'weights': 'checkpoint'" in text
        assert nb["findings"]["exact patch, generate(): waveform torch.equal to upstream"] is True
    if stem == "03_causality_checks":  # a record names the sizes it ran at, never a default's
        ladder = load_run(run_dir).get("exactness_calibration")
        assert ladder["params"]["capacity"] == params["ladder_capacity"] and ladder["env"]["device"] == "cpu"


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path):
    runs = [wb._new_run_dir("cpu", tmp_path) for _ in range(3)]
    assert len(set(runs)) == 3 and all(r.is_dir() and r.parent == tmp_path for r in runs), runs


def _no_gpu_claim_judged_here(run_dir):
    """A claim made on a CUDA GPU reads "not measured at its scale" (or not run) on this CPU, never holds or fails."""
    from fastattn.lab.claims import NOT_RUN, NOT_SCALE, claims_ledger
    rows = [r for r in claims_ledger(run_dir) if "CUDA" in r["scale"]]
    assert len(rows) == 3 and all(r["verdict"] in (NOT_SCALE, NOT_RUN) for r in rows), rows


NUMBER = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])")


def _unrounded(text):
    """Numbers printed with more than 4 significant digits (version strings excluded by their dots)."""
    return [n for n in NUMBER.findall(text) if len(n.replace(".", "").lstrip("0")) > 4]


def _check_report(run_dir, stem):
    """What a maintainer receives: a landing page and a GitHub-ready summary with the environment, rounded
    numbers, no machine paths, no kernel folder."""
    index, md = (run_dir / "index.html").read_text(), (run_dir / "summary.md").read_text()
    for text in (index, md):
        assert "torch" in text and "device_name" in text and stem in text
        assert not _unrounded(text), _unrounded(text)[:5]
    assert "<style>" in index and "<table>" in index
    key = json.loads((run_dir / stem / "key_findings.json").read_text())
    import html
    assert key and all(html.escape(k) in index and k in md for k in key)  # the key findings lead its entry
    if stem == "05_profiling":
        assert "Verdicts" in index and "| claim | measured (95% CI) | goal | met | note |" in md
        assert "(n=" in md  # every timing ratio a target judges says how many samples it rests on
    assert "The seeds' claims, judged on this device" in index
    assert "| source | claim | scale | verdict | evidence |" in md
    if stem in ("01_root_cause", "05_profiling"):
        assert "<img src='" in index
    page = (run_dir / f"{stem}.html").read_text()
    for path in (str(repo_root()), sys.prefix, str(run_dir)):
        assert path not in page, f"{stem}.html shows the machine path {path}"
    assert "white-space: pre-wrap" in page
    assert not (run_dir / ".jupyter").exists()


def test_findings_key_names_must_be_findings(tmp_path, capsys):
    from fastattn.lab import workbook as wb
    wb.findings(tmp_path, {"a ms": 1.23456, "b": True, "c": "x"}, key=["b"])
    assert json.loads((tmp_path / "key_findings.json").read_text()) == ["b"]
    assert "b: yes   [key]" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"not found: \['z'\]"):
        wb.findings(tmp_path, {"a": 1}, key=["z"])


def test_bad_parameter_fails_before_anything_runs(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fastattn", "workbook", "--only", "01", "-p", "dtype", "int3",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "parameter dtype='int3'" in r.stderr and "Traceback" not in r.stderr
    assert not any(tmp_path.iterdir()), "nothing was run or written"


@pytest.mark.slow
def test_failing_cell_names_notebook_and_cell_and_keeps_the_partial_notebook(tmp_path):
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    out = tmp_path / "runs"
    r = subprocess.run([sys.executable, "-m", "fastattn", "workbook", "--only", "04", "-p", "checkpoint_path",
                        str(empty), "--out", str(out), "--budget", "0"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1
    assert "04_patch_application.ipynb, cell" in r.stderr and "model.safetensors" in r.stderr
    run = next(out.iterdir())
    assert (run / "04_patch_application.ipynb").exists(), "the partial executed notebook is kept"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed"


def test_runner_rejects_unknown_notebook_and_cuda_without_cuda(tmp_path):
    import torch
    with pytest.raises(ValueError, match="no notebook matches"):
        wb.run_workbook({}, only=["99"], out=tmp_path)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            wb.run_workbook({"device": "cuda"}, out=tmp_path)


@pytest.mark.parametrize("kw,match", [
    (dict(device="gpu"), r"parameter device='gpu': device must be one of auto, cpu, cuda, mps \(or 'cuda:N'\)"),
    (dict(device="CPU"), r"parameter device='CPU': device must be one of"),
    (dict(dtype="int8"), "dtype='int8'"),
    (dict(preset="huge"), "preset='huge'"),
    (dict(positions=[0, 9000], capacity=8192), "9000 is beyond capacity=8192"),
    (dict(repeats=0), "repeats=0"),
    (dict(checkpoint_path="/nonexistent/ckpt"), "not an existing directory"),
])
def test_check_params(kw, match):
    with pytest.raises(ValueError, match=match):
        wb.check_params(**kw)


@pytest.mark.slow
def test_plain_papermill_from_another_folder(tmp_path):
    """papermill run from any working directory finds fastattn and data/ through the package."""
    out = tmp_path / "out.ipynb"
    r = subprocess.run([sys.executable, "-m", "papermill", str(ROOT / "notebooks" / "02_backend_selection.ipynb"),
                        str(out), "-p", "capacity", "512", "-p", "position", "10", "-p", "out_dir", str(tmp_path)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "findings.json").exists()


def test_the_reference_profile_sizes_the_seeds_claims_and_is_checked_per_notebook():
    """The reference profile streams past chunk 400, decodes 12 steps, and plans tens of minutes here; its sizes are
    each notebook's own (01's repeats are not 05's); an unknown profile is refused naming the ones there are."""
    from fastattn.lab import budget
    prof = wb.load_profile("reference")
    nbs = prof["notebooks"]
    assert nbs["01_root_cause"]["chunks"] >= 400 and nbs["05_profiling"]["steps"] >= 12 and not prof["budget"]
    assert prof["timeout"] >= 3600  # 01's streams run in one cell
    for nb in wb.notebooks():
        wb._validate_run(nbs.get(nb.stem, {}), [nb])
    est = budget.profile_estimate(budget.calibration()["probe"], [p.stem for p in wb.notebooks()], nbs)
    assert 15 * 60 < sum(est.values()) < 100 * 60  # well past the default run's 600 s, under two hours
    with pytest.raises(ValueError, match="expected one of reference"):
        wb.load_profile("nope")


def test_the_landing_page_names_a_profile_run():
    from fastattn.lab.report import _params_line
    assert _params_line({"parameters": {}, "profile": None}) == "defaults"
    assert _params_line({"parameters": {"device": "cpu"}, "profile": "reference"}).startswith(
        "device=cpu; profile reference")


PLANTED_STALL = '''k = get_ipython().kernel
send = k.session.send
def drop_reply(stream, msg_or_type, *a, **kw):  # this cell's execute_reply never leaves the kernel
    if msg_or_type == "execute_reply":
        k.session.send = send
        return {"content": {"status": "ok"}, "header": {}, "parent_header": {}, "metadata": {}}
    return send(stream, msg_or_type, *a, **kw)
k.session.send = drop_reply'''


@pytest.mark.slow
def test_a_cell_stalled_on_an_idle_kernel_fails_fast_named_with_the_partial_notebook(tmp_path, monkeypatch):
    """The planted stall: the kernel goes idle and the client waits for a reply that never comes."""
    import time

    from papermill.exceptions import PapermillExecutionError

    from fastattn.lab import nbexec
    monkeypatch.setattr(nbexec, "IDLE_GRACE_S", 5.0)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell(PLANTED_STALL),
                nbformat.v4.new_code_cell("print(x)")]
    src, out = tmp_path / "stall.ipynb", tmp_path / "stall-out.ipynb"
    nbformat.write(nb, str(src))
    t0 = time.monotonic()
    with pytest.raises(PapermillExecutionError, match=r"stalled: the kernel went idle") as err:
        pm.execute_notebook(str(src), str(out), kernel_name="python3", engine_name=nbexec.ENGINE,
                            progress_bar=False, execution_timeout=600)
    assert time.monotonic() - t0 < 60
    assert err.value.ename == "StalledCell" and "cell 1 ('k = get_ipython().kernel') stalled" in err.value.evalue
    code = [c for c in nbformat.read(str(out), as_version=4).cells if c.cell_type == "code"]  # the partial notebook
    assert code[1].outputs[-1]["ename"] == "StalledCell" and not code[2].get("outputs")


#: measurements that stay on the CPU by design, on every device (their records say so)
CPU_ONLY = {"peak_rss", "compile_demo", "consumer_matrix"}


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_measurement_a_notebook_makes_runs_on_the_runs_device(nb):
    """A call to a function that takes ``device`` passes it (``P["device"]``): on a GPU run a record measured on
    the CPU by default would be judged as the GPU's (the KV claim once was)."""
    import ast
    import inspect

    from fastattn.lab import bench
    missing = []
    for cell in nbformat.read(str(nb), as_version=4).cells:
        if cell.cell_type != "code" or "parameters" in cell.metadata.get("tags", []):
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))):
                continue
            owner = ast.unparse(node.func.value) if isinstance(node.func, ast.Attribute) else "bench"
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            fn = getattr(bench, name, None) if owner in ("bench", "fastattn.lab.bench") else None
            if name in CPU_ONLY or not callable(fn) or "device" not in inspect.signature(fn).parameters:
                continue
            at = list(inspect.signature(fn).parameters).index("device")
            if len(node.args) <= at and not any(k.arg == "device" for k in node.keywords):
                missing.append(f"{name}(...) at: {ast.unparse(node)[:80]}")
    assert not missing, "\n".join(missing)


# workbook parameters: one type per name, checked before anything runs, named in the error
@pytest.mark.parametrize("params,match", [
    ({"positions": 99999}, r"parameter positions=99999: expected a non-empty list of ints"),
    ({"positions": "0:512:8"}, r"parameter positions='0:512:8': expected a non-empty list"),
    ({"device": "CPU"}, r"parameter device='CPU': device must be one of"),
    ({"seed": "abc"}, r"parameter seed='abc': expected an int"),
    ({"repeat": 1}, r"parameter 'repeat' is not declared by any selected notebook"),
    ({"positions": [0, 4000]}, r"03_causality_checks: parameter positions: 4000 is beyond capacity=2048"),
])
def test_run_parameters_checked_before_anything_runs(tmp_path, params, match):
    with pytest.raises(ValueError, match=match):
        wb.run_workbook(params, out=tmp_path, log=lambda *_: None)
    assert not any(tmp_path.iterdir())  # no run folder was made


def _cli(*args, cwd=ROOT):
    r = subprocess.run([sys.executable, "-m", "fastattn", "workbook", *args], capture_output=True, text=True,
                       cwd=cwd, timeout=300)
    return r.returncode, r.stdout + r.stderr


def _main(capsys, *args):
    """``python -m fastattn workbook ARGS`` in this process (the real process's exit and stderr: the test above)."""
    from fastattn.__main__ import main
    code = main(["workbook", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("make,match", [
    (lambda d: ["--out", str(d / "afile")], "exists and is not a folder"),
    (lambda d: ["--params", str(d / "missing.yaml")], "no such file"),
    (lambda d: ["--params", str(d / "list.yaml")], "expected a mapping of parameter names"),
    (lambda d: ["--params", str(d / "bad.yaml")], "not valid YAML"),
    (lambda d: ["--only", "03", "-p", "positions", "99999"], "parameter positions=99999"),
])
def test_runner_cli_errors_are_one_line_and_nonzero(tmp_path, capsys, make, match):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    code, out = _main(capsys, *make(tmp_path))
    assert code == 2 and match in out and out.count("\n") == 1, out


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_runner_cli_unwritable_out(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    code, out = _cli("--out", str(ro / "sub"))
    assert code == 2 and "cannot create" in out


def test_failed_html_marks_the_notebook_failed(tmp_path, monkeypatch):
    """The HTML step is under test, not 02: papermill's execution is stubbed by a copy of the source notebook."""
    import shutil

    import papermill

    def no_space(executed, *_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(papermill, "execute_notebook", lambda src, dst, **_: shutil.copy(src, dst))
    monkeypatch.setattr(wb, "_html", no_space)
    run_dir, summary = wb.run_workbook({"capacity": 1024, "position": 100}, only=["02"], out=tmp_path, budget_s=None,
                                       log=lambda *_: None)
    nb = summary["notebooks"][0]
    assert summary["status"] == "failed" and nb["status"] == "failed" and "HTML" in nb["error"]
