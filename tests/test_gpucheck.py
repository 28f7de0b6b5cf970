"""The GPU validation kit: its CPU quick run end to end, CUDA-only steps skipped with a reason, the refusal."""

import subprocess
import sys

import pytest
import torch

from fastattn import bench
from fastattn.gpucheck import gpu_check

from .conftest import cuda


@pytest.mark.slow
def test_cpu_quick_run_writes_records_and_summary(tmp_path):
    folder = gpu_check("cpu", quick=True, out=tmp_path / "kit", log=lambda *_: None)
    summary = (folder / "summary.md").read_text()
    for step in ("doctor", "backend_matrix", "exactness_calibration", "attention_sweep", "decode_step_sweep",
                 "whole_decode_eager"):
        assert f"| {step} | ok: " in summary, summary
    for step in ("whole_decode_optimized", "stream_under_optimize", "upstream_diff_compiled", "kit_decode"):
        assert f"| {step} | skipped: " in summary and "need CUDA" in summary
    assert "| decode_forms | skipped: the CUDA opt-in is chosen on CUDA" in summary
    assert "Until a GPU has run it, the CUDA choice is unmeasured." in summary
    assert "failed" not in summary
    kinds = {bench.load_record(p)["kind"] for p in folder.glob("*.json")}
    assert {"doctor", "backend_matrix", "exactness_calibration", "attention", "decode_step", "whole_decode"} <= kinds
    assert all(bench.load_record(p)["env"]["torch"] == torch.__version__ for p in folder.glob("*.json"))
    assert list(folder.glob("*.csv"))
    with pytest.raises(ValueError, match="not empty"):
        gpu_check("cpu", quick=True, out=folder, log=lambda *_: None)  # never over an earlier run


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_without_cuda_naming_it():
    r = subprocess.run([sys.executable, "-m", "fastattn", "gpu-check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "CUDA is not available" in r.stderr and "Traceback" not in r.stderr


@cuda
def test_cuda_quick_run(tmp_path):
    folder = gpu_check("cuda", quick=True, out=tmp_path / "kit", log=lambda *_: None)
    assert "failed" not in (folder / "summary.md").read_text()


def test_a_step_whose_record_reports_a_failure_fails_the_kit(tmp_path, monkeypatch):
    """A step that returns records saying "not bit-identical" or "exit status 1" is a failure, not an "ok"."""
    from fastattn import gpucheck
    rec = lambda **kw: bench.record("x", env={}, params={}, **kw)  # noqa: E731
    steps = [("diverged", lambda: [rec(rows=[], identical=False)], None),
             ("crashed", lambda: [rec(rows=[{"returncode": 1, "stderr": "Traceback: boom"}])], None),
             ("fine", lambda: [rec(rows=[{"returncode": 0}], identical=True)], None)]
    monkeypatch.setattr(gpucheck, "_steps", lambda device, size: steps)
    summary = (gpu_check("cpu", quick=True, out=tmp_path / "k", log=lambda *_: None) / "summary.md").read_text()
    assert "| diverged | failed: x: not bit-identical" in summary
    assert "| crashed | failed: x: exit status 1: Traceback: boom" in summary and "| fine | ok: " in summary
    assert list((tmp_path / "k").glob("diverged*.json"))  # the evidence is kept


@pytest.mark.slow
def test_kit_decode_runs_the_decode_attention_kit_and_keeps_the_default_identical():
    """gpu-check's kit_decode on CPU (eager: upstream's optimize() compiles only on CUDA): both modes decode
    through the patched copy, alternated; the mode off equals upstream here bit for bit."""
    from fastattn.experiments.decode_forms import kit_lines
    from fastattn.gpucheck import kit_decode
    rec = kit_decode("cpu", preset="tiny", steps=4, chunks=6, repeats=3)
    assert rec["identical_off"] is True and rec["params"]["compile"] is False
    assert [r["mode"] for r in rec["rows"]] == ["masked", "live"]
    assert all(len(r["wall_samples_s"]) == 3 and len(r["chunk_ms"]) == 6 for r in rec["rows"])
    assert "live / masked whole decode" in "\n".join(kit_lines(rec))


def test_a_child_process_runs_on_the_chosen_gpu(monkeypatch):
    """cuda:N is made current and the kit runs on "cuda": a child process must see that GPU as its "cuda", read
    through a CUDA_VISIBLE_DEVICES already set."""
    from fastattn.gpucheck import child_env
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert child_env("cpu") == {} and child_env("cuda") == {"CUDA_VISIBLE_DEVICES": "1"}
    assert child_env("cuda:3") == {"CUDA_VISIBLE_DEVICES": "3"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")
    assert child_env("cuda") == {"CUDA_VISIBLE_DEVICES": "6"}
    with pytest.raises(ValueError, match="past CUDA_VISIBLE_DEVICES"):
        child_env("cuda:2")
