"""The GPU validation kit: its CPU first-contact run end to end, named steps (--only, --skip, --resume), a budget that
stops a step, a killed run that leaves its records and a summary, counters from before the compile, the refusal."""

import json
import subprocess
import sys
import sysconfig
import time

import pytest
import torch

from fastattn.lab import bench, gpucheck
from fastattn.lab.bench.timing import stats_ms
from fastattn.lab.gpucheck import FIRST_CONTACT, Step, gpu_check
from fastattn.lab.machine import compile_toolchain

from ..conftest import cuda

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

QUIET = {"log": lambda *_: None}


def _stub(monkeypatch, *steps):
    monkeypatch.setattr(gpucheck, "_steps", lambda device, size: list(steps))


def _rec(**kw):
    return bench.record("x", env={}, params={}, rows=kw.pop("rows", []), **kw)


@pytest.mark.slow
def test_cpu_quick_run_is_the_first_contact_set_with_its_plan(tmp_path):
    said = []
    folder = gpu_check("cpu", quick=True, out=tmp_path / "kit", log=said.append)
    summary = (folder / "summary.md").read_text()
    assert said[0].startswith("[gpu-check] plan: environment ~") and "budget 480 s" in said[0]
    for step in ("environment", "forms_check", "static_inputs", "eager_slices"):
        assert f"| {step} | ok: " in summary, summary
    assert "| optimize_counters | skipped: " in summary and "need CUDA" in summary
    assert "exactness_calibration" not in summary and "failed" not in summary  # the full run's steps: not planned
    assert "- static inputs, flex_decode at position" in summary and "- eager slices at position" in summary
    assert "Until a GPU has run it, the CUDA choice is unmeasured." in summary
    kinds = {bench.load_record(p)["kind"] for p in folder.glob("*.json")}
    assert kinds == {"doctor", "backend_matrix", "form_checks", "static_inputs", "eager_slices"}
    assert all(bench.load_record(p)["env"]["torch"] == torch.__version__ for p in folder.glob("*.json"))
    doctor = bench.load_record(folder / "doctor.json")["rows"][0]
    assert doctor["compile_toolchain"] == "ok" and ("sdp_priority_order" in doctor or doctor["device"] == "cpu")
    assert all("refused" in r for r in bench.load_record(folder / "backend_matrix.json")["rows"])
    with pytest.raises(ValueError, match="not empty"):
        gpu_check("cpu", quick=True, out=folder, **QUIET)  # never over an earlier run


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_without_cuda_naming_it():
    r = subprocess.run([sys.executable, "-m", "fastattn", "gpu-check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "CUDA is not available" in r.stderr and "Traceback" not in r.stderr


@cuda
def test_cuda_quick_run(tmp_path):
    folder = gpu_check("cuda", quick=True, out=tmp_path / "kit", **QUIET)
    assert "failed" not in (folder / "summary.md").read_text()


def test_a_step_whose_record_reports_a_failure_fails_the_kit(tmp_path, monkeypatch):
    """A step that returns records saying "not bit-identical" or "exit status 1" is a failure, not an "ok"."""
    _stub(monkeypatch, Step("diverged", lambda: [_rec(identical=False)], 1, None),
          Step("crashed", lambda: [_rec(rows=[{"returncode": 1, "stderr": "Traceback: boom"}])], 1, None),
          Step("raised", lambda: 1 / 0, 1, None), Step("fine", lambda: [_rec(rows=[{"returncode": 0}])], 1, None))
    summary = (gpu_check("cpu", out=tmp_path / "k", **QUIET) / "summary.md").read_text()
    assert "| diverged | failed: x: not bit-identical" in summary and "(records: x.json)" in summary
    assert "| crashed | failed: x: exit status 1: Traceback: boom" in summary and "| fine | ok: x-3.json" in summary
    assert "| raised | failed: ZeroDivisionError: division by zero |" in summary
    log = [json.loads(line) for line in (tmp_path / "k" / "steps.jsonl").read_text().splitlines()]
    assert "ZeroDivisionError" in log[2]["traceback"]  # the evidence is kept


def test_only_skip_and_resume_name_steps(tmp_path, monkeypatch):
    ran = []
    steps = [Step(n, lambda n=n: ran.append(n) or [_rec()], 1, None) for n in ("a", "b", "c")]
    _stub(monkeypatch, *steps)
    gpu_check("cpu", out=tmp_path / "k", only=["b"], **QUIET)
    assert ran == ["b"]
    gpu_check("cpu", out=tmp_path / "k", skip=["c"], resume=True, **QUIET)  # b ended ok there: not again
    assert ran == ["b", "a"]
    summary = (tmp_path / "k" / "summary.md").read_text()
    assert "| a | ok: " in summary and "| b | ok: " in summary and "| c | not run" not in summary
    gpu_check("cpu", out=tmp_path / "k", only=["c"], resume=True, **QUIET)  # a later call names c alone
    summary = (tmp_path / "k" / "summary.md").read_text()
    assert all(f"| {n} | ok: " in summary for n in "abc"), summary  # the earlier calls' steps stay in the summary
    with pytest.raises(ValueError, match="unknown step.*the steps are a, b, c"):
        gpu_check("cpu", out=tmp_path / "new", only=["nosuch"], **QUIET)
    assert gpucheck.main(["--device", "cpu", "--only", "nosuch", "--out", str(tmp_path / "m")]) == 2


def test_a_step_that_would_overrun_the_budget_is_stopped(tmp_path, monkeypatch):
    """Before a step: its estimate against what is left. During it: interrupted when the budget runs out (a
    BaseException, so the step's own ``except Exception`` cannot swallow it); the run goes on and says so."""
    def swallows():
        try:
            time.sleep(30)
        except Exception:  # noqa: BLE001 - what a step's own handler does
            return [_rec()]
    _stub(monkeypatch, Step("quick", lambda: [_rec()], 0.0, None), Step("slow", swallows, 0.1, None),
          Step("big", lambda: [_rec()], 100, None))
    t0 = time.perf_counter()
    summary = (gpu_check("cpu", out=tmp_path / "k", budget=1.0, **QUIET) / "summary.md").read_text()
    assert time.perf_counter() - t0 < 10
    assert "| quick | ok: " in summary and "| slow | stopped: the run's budget ran out during this step" in summary
    assert "| big | stopped: its estimate of 100 s is over the 0 s left of the budget" in summary
    summary = (gpu_check("cpu", out=tmp_path / "k", only=["big"], resume=True, budget=0, **QUIET) / "summary.md")
    assert "| big | ok: " in summary.read_text()


def test_a_killed_run_leaves_the_records_before_it_and_a_summary(tmp_path):
    """A run killed inside a step (SIGKILL: no handler runs) keeps the records of the steps before it and a summary
    rebuilt after each of them."""
    script = f"""
import os, signal
from fastattn.lab import bench, gpucheck
rec = lambda: [bench.record("first", env={{}}, params={{}}, rows=[{{"a": 1}}])]
steps = [gpucheck.Step("first", rec, 1, None), gpucheck.Step("killed", lambda: os.kill(os.getpid(), signal.SIGKILL),
         1, None), gpucheck.Step("after", rec, 1, None)]
gpucheck._steps = lambda device, size: steps
gpucheck.gpu_check("cpu", out={str(tmp_path / "k")!r}, log=lambda *_: None)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr[-2000:]
    summary = (tmp_path / "k" / "summary.md").read_text()
    assert "| first | ok: first.json |" in summary and bench.load_record(tmp_path / "k" / "first.json")["rows"]
    assert "| killed | not run (not reached, or killed) |" in summary and "| after | not run" in summary


def test_a_missing_tool_for_the_kits_is_a_reported_failure_not_a_lost_step(monkeypatch):
    """A kit whose copy cannot be made (no ``patch`` binary: FileNotFoundError, not RuntimeError) fails the step
    with the reason, in a record."""
    def no_tool(*a, **k):
        raise FileNotFoundError(2, "No such file or directory", "patch")
    monkeypatch.setattr(gpucheck, "run_in_patched_copy", no_tool)
    for rec in (gpucheck.kit_decode("cpu", preset="tiny"), gpucheck._diff_compiled("cpu", {"preset": "tiny",
                                                                                           "steps": 2})):
        assert gpucheck._failures(rec) and "FileNotFoundError" in rec["rows"][0]["stderr"]
        assert "patch" in rec["rows"][0]["stderr"]


#: the kit's child with a cudagraph skip planted where a compile logs one (before the warm-up decode)
_PLANTED = ("import sys; from fastattn.lab import gpucheck; "
            "from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter as skip; "
            "gpucheck.upstream_optimized = lambda m: skip('skipping cudagraphs due to a planted mutated input'); "
            "gpucheck.{}(*sys.argv[1:])")


@pytest.mark.slow
def test_kit_decode_counts_a_skip_logged_at_compile_and_keeps_the_default_identical(monkeypatch):
    """gpu-check's kit_decode on CPU through the decode-attention kit (a fresh process), with a cudagraph skip
    planted in the compile: counters reset before it, so each mode reports it (they used to be reset after the
    warm-up, which always read 0). Both modes decode, alternated; the mode off equals upstream's here bit for bit."""
    from fastattn.lab.bench.forms import kit_lines
    monkeypatch.setattr(gpucheck, "_LAUNCH", _PLANTED)
    monkeypatch.setattr(gpucheck, "upstream_optimized", lambda m: None)  # the parent's upstream decode: eager here
    rec = gpucheck.kit_decode("cpu", preset="tiny", steps=4, chunks=6, repeats=3, compile=True)
    assert rec["identical_off"] is True and rec["params"]["compile"] is True, rec["rows"]
    assert [r["mode"] for r in rec["rows"]] == ["masked", "live"]
    assert all(len(r["wall_samples_s"]) == 3 and len(r["chunk_ms"]) == 6 for r in rec["rows"])
    assert all(r["cudagraph_skips"] == 1 and "planted" in r["cudagraph_skip_reasons"][0] for r in rec["rows"])
    text = "\n".join(kit_lines(rec))
    assert "live / masked whole decode" in text and "1 cudagraph skip(s) (skipping cudagraphs due to a planted" in text


def test_a_child_process_runs_on_the_chosen_gpu(monkeypatch):
    """cuda:N is made current and the kit runs on "cuda": a child process must see that GPU as its "cuda", read
    through a CUDA_VISIBLE_DEVICES already set."""
    from fastattn.lab.gpucheck import child_env
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert child_env("cpu") == {} and child_env("cuda") == {"CUDA_VISIBLE_DEVICES": "1"}
    assert child_env("cuda:3") == {"CUDA_VISIBLE_DEVICES": "3"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")
    assert child_env("cuda") == {"CUDA_VISIBLE_DEVICES": "6"}
    with pytest.raises(ValueError, match="past CUDA_VISIBLE_DEVICES"):
        child_env("cuda:2")


def test_the_first_contact_set_fits_its_budget_on_cuda():
    """The plan read without a GPU: --quick is exactly the first-contact set, its estimate inside the budget (the
    estimates are plan figures; the records' seconds are what a GPU run measures)."""
    plan = gpucheck.plan(torch.device("cuda"), quick=True)
    assert [s.name for s in plan] == list(FIRST_CONTACT) and not any(s.skip for s in plan)
    assert sum(s.estimate_s for s in plan) <= gpucheck.QUICK_BUDGET_S
    full = [s.name for s in gpucheck.plan(torch.device("cuda"), quick=False)]
    assert full[:len(FIRST_CONTACT)] == list(FIRST_CONTACT) and "kit_decode_eager" in full


def _timed(variant: str, ms: float, n: int = 9, **kw) -> dict:
    samples = [ms * (1 + 0.01 * (i % 3)) for i in range(n)]
    return {"variant": variant, **stats_ms([x / 1e3 for x in samples]), **kw}


def test_first_contact_lines_read_gpu_shaped_records(tmp_path):
    """The first-contact summary on records shaped as an H200 run would write them: CUDA graphs recorded, a
    counted cudagraph skip with its reason, cuDNN's per-length plan in the eager slices, host time per call."""
    cuda_env = {"device": "cuda", "device_name": "NVIDIA H200", "torch": "2.11.0+cu128"}
    rec = lambda kind, params, rows, **kw: bench.record(kind, env=cuda_env, params=params, rows=rows, **kw)  # noqa: E731
    static = rec("static_inputs", {"form": "flex_decode", "layers": 28}, [
        _timed("not static, 28 calls per replay", 0.9, position=256, per_layer_ms=0.032, host_ms_per_call=0.004),
        _timed("static, 28 calls per replay", 0.3, position=256, per_layer_ms=0.011, host_ms_per_call=0.004)])
    counters = rec("optimize_counters", {"preset": "small", "steps": 30}, [{
        "variant": "upstream optimize()", "unique_graphs": 3, "cudagraph_skips": 1, "cudagraph_recordings": 2,
        "cudagraph_skip_reasons": ["skipping cudagraphs due to mutated inputs"]}])
    slices = rec("eager_slices", {"position": 1024, "calls": 50, "capacity": 8192}, [
        _timed("slice, fresh length per call", 30.0), _timed("slice, one length", 0.05),
        _timed("slice, fresh length, cuDNN left out", 0.06), _timed("masked, whole cache", 0.2)],
        slice_backend="CUDNN_ATTENTION")
    folder = tmp_path / "gpu"
    folder.mkdir()
    with open(folder / "steps.jsonl", "w") as f:
        for name, r in (("static_inputs", static), ("optimize_counters", counters), ("eager_slices", slices)):
            f.write(json.dumps({"step": name, "status": "ok", "seconds": 1.0,
                                "files": [bench.save_record(r, folder, name).name]}) + "\n")
    text = "\n".join(gpucheck.summary_lines(folder, [], ["# head"]))
    assert "- static inputs, flex_decode at position 256: not static, 28 calls per replay: 32.0 us/layer" in text
    assert "not static, 28 calls per replay / static, 28 calls per replay: 3.0" in text
    assert "3 dynamo graph(s), 1 cudagraph skip(s) (skipping cudagraphs due to mutated inputs), 2 CUDA graph(s)" in text
    assert "(SDPA picks CUDNN_ATTENTION)" in text and "slice, fresh length per call / slice, one length: 600" in text
    assert "slice, fresh length, cuDNN left out / masked, whole cache: 0.3" in text
    assert gpucheck.HOST_BOUND in text  # single eager calls on a GPU time launches: said where the ratio is
    assert "plan cost per new key count: 30.2 ms (fresh 30.3 - repeated 0.0505)" in text
    assert "36 layers share one, 0.84 ms per layer" in text  # a single call charges a whole plan to one layer (B3)
    assert "| eager_slices | ok: eager_slices.json | 1.0 |" in text


def test_without_a_compiler_the_compile_steps_are_skipped_with_why_and_eager_steps_run(tmp_path, monkeypatch):
    """A box with no build tools (a planted PATH with no compiler on it): forms_check would crash at its first
    compile, so it is skipped with the reason; the eager steps run. A missing Python.h is named too."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert compile_toolchain("cpu").startswith("no C++ compiler")
    said = []
    folder = gpu_check("cpu", quick=True, out=tmp_path / "kit", log=said.append,
                       only=["environment", "forms_check", "eager_slices"])
    summary = (folder / "summary.md").read_text()
    assert "| forms_check | skipped: no C++ compiler" in summary and "| eager_slices | ok: " in summary, summary
    assert bench.load_record(folder / "doctor.json")["rows"][0]["compile_toolchain"].startswith("no C++ compiler")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert "no Python.h at" in compile_toolchain("cuda") and "no C compiler ($CC, gcc or clang)" in compile_toolchain(
        "cuda")


def test_on_cuda_a_key_count_called_earlier_in_the_process_is_not_fresh_again():
    """cuDNN's plan cache is process-wide: a sweep after the fast probe (or eager_slices) walks past every key count
    already called on that CUDA device and dtype; the CPU keeps the plain walk (nothing plans there)."""
    from fastattn import static
    static._CALLED.clear()
    first = static.fresh_positions(4096, 9, 8192, device="cuda:0", dtype=torch.bfloat16)
    assert first == list(range(4096, 4087, -1))
    again = static.fresh_positions(4096, 9, 8192, device="cuda:0", dtype=torch.bfloat16)
    assert not {i + 1 for i in again} & {i + 1 for i in first} and again == list(range(4087, 4078, -1))
    assert static.fresh_positions(4096, 9, 8192, device="cuda:0", dtype=torch.float32) == first  # its own plans
    assert static.fresh_positions(4096, 9, 8192) == static.fresh_positions(4096, 9, 8192) == first
    static.called_key_counts("cuda:0", torch.bfloat16).update(range(1, 4098))  # the fast probe's and more
    assert static.fresh_positions(4096, 3, 8192, device="cuda:0", dtype=torch.bfloat16) == [4097, 4098, 4099]
    static._CALLED.clear()
