"""fastattn.lab.runner: named steps, --only/--skip, one deadline, resume; the bench jobs and the profile's extras
on it."""

import json
import subprocess
import sys

import pytest

from fastattn.lab import bench, runner, workbook
from fastattn.lab.bench import cli as bench_cli


def _rec(kind, **params):
    return lambda: [bench.record(kind, env={}, params=params, rows=[{"a": 1}])]


def test_select_names_steps_and_refuses_unknown_ones():
    steps = [runner.Step(n, _rec(n), 1, None) for n in ("a", "b", "c")]
    assert [s.name for s in runner.select(steps, skip=["b"])] == ["a", "c"]
    assert [s.name for s in runner.select(steps, default=("c",))] == ["c"]
    assert [s.name for s in runner.select(steps, only=["b", "a"])] == ["a", "b"]  # run order is the steps' own
    with pytest.raises(ValueError, match=r"unknown step\(s\) \['z'\]; the steps are a, b, c"):
        runner.select(steps, only=["z"])


def test_run_steps_logs_names_files_and_resumes_without_overwriting(tmp_path):
    steps = [runner.Step("a", _rec("k", dtype="bfloat16"), 1, None, lambda recs: ["named_a"]),
             runner.Step("b", lambda: 1 / 0, 1, None), runner.Step("c", _rec("k"), 1, "needs CUDA")]
    folder = runner.open_folder(tmp_path / "r", resume=False)
    entries = runner.run_steps(steps, folder, log=lambda *_: None)
    assert entries["a"]["files"] == ["named_a.json"] and entries["a"]["status"] == "ok"
    assert entries["b"]["status"] == "failed" and entries["b"]["why"].startswith("ZeroDivisionError")
    assert "c" not in entries  # skipped with its reason, never run
    with pytest.raises(ValueError, match="a run never overwrites an earlier one"):
        runner.open_folder(folder, resume=False)
    again = runner.run_steps(steps, runner.open_folder(folder, resume=True), resume=True, log=lambda *_: None)
    assert list(again) == ["b"]  # a ended ok earlier
    assert [json.loads(line)["step"] for line in (folder / "steps.jsonl").read_text().splitlines()] == ["a", "b", "b"]


def test_a_step_over_the_budget_is_stopped_before_it_starts(tmp_path):
    steps = [runner.Step("big", _rec("k"), 100, None)]
    entries = runner.run_steps(steps, runner.open_folder(tmp_path, resume=True), budget=5, log=lambda *_: None)
    assert entries["big"]["status"] == "stopped" and "over the 5 s left" in entries["big"]["why"]


def test_bench_jobs_are_the_cli_choices_and_all_names_jobs():
    names = [s.name for s in bench_cli.jobs("cpu")]
    assert set(bench_cli.ALL) <= set(names) and set(workbook.BENCH_EXTRAS) <= set(names)
    assert all(set(need) <= set(names) for need in bench_cli.NEEDS.values())


def test_the_profile_extras_run_through_the_runner_and_a_failure_is_listed(tmp_path, monkeypatch):
    ok = runner.Step("compiled", _rec("compiled_step"), 0, None, lambda recs: ["compiled_step_tiny"])
    bad = runner.Step("forms", lambda: (_ for _ in ()).throw(RuntimeError("no compiler")), 0, None)
    monkeypatch.setattr(bench_cli, "jobs", lambda device, **sizes: [ok, bad])
    out = tmp_path / "run" / "bench" / "records"
    done = workbook._run_bench(["compiled", "forms"], out, "cpu", lambda *_: None)
    assert done == ["bench/records/compiled_step_tiny.json", "failed: forms: RuntimeError: no compiler"]
    assert bench.load_record(out / "compiled_step_tiny.json")["kind"] == "compiled_step"


# the bench CLI validates before it measures or writes
def test_bench_cli_validates_first(tmp_path):
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "-m", "fastattn", "bench", "attention", "--positions", "0,9000",
                        "--capacity", "256", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--positions must be" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
