"""The workbook's time budget (fastattn.lab.budget) and 05's dtype comparison, fed CPU- and GPU-shaped records.

No timing is asserted: the plan is a pure function of a probe and the calibration, and the dtype readings are
pure functions of records.
"""

from __future__ import annotations

import ast
import copy
import random
from pathlib import Path

import pytest

from fastattn.lab import budget
from fastattn.lab.bench.decode import dtype_table, steps_for
from fastattn.lab.profiling import dtype_findings, dtype_recommendation, sizing_line, whole_dtypes
from fastattn.lab.workbook import _planned, check_params, notebooks

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

CAL = budget.calibration()
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = [p.stem for p in notebooks()]


def _probe(bf16_ms: float, fp32_ms: float) -> dict:
    return {"kind": "budget_probe", "device": "cpu",
            "rows": [{"dtype": "bfloat16", "chunk_ms": bf16_ms, "n": 4, "build_s": 2.0},
                     {"dtype": "float32", "chunk_ms": fp32_ms, "n": 4, "build_s": 1.0}]}


REF_MS = {r["dtype"]: r["chunk_ms"] for r in CAL["probe"]["rows"]}
#: the calibration machine itself; an AVX2 CPU without native bf16 (bf16 3x slower, fp32 1.2x); a GPU
SAME = _probe(REF_MS["bfloat16"], REF_MS["float32"])
NO_BF16 = _probe(3 * REF_MS["bfloat16"], 1.2 * REF_MS["float32"])
GPU = _probe(REF_MS["bfloat16"] / 20, REF_MS["float32"] / 20)


def test_scalable_defaults_are_the_notebooks_own():
    import papermill as pm
    for name, (stem, default, minimum) in budget.SCALABLE.items():
        nb = next(p for p in notebooks() if p.stem == stem)
        assert ast.literal_eval(pm.inspect_notebook(str(nb))[name]["default"]) == default
        assert 1 <= minimum < default


def test_the_kernel_class_is_read_off_the_cpu_flags_and_picks_its_calibration():
    assert budget.kernel_class("cpu", {"amx_bf16": True, "avx512_bf16": True}) == "bf16-amx"
    assert budget.kernel_class("cpu", {"avx512_bf16": True, "amx_bf16": False}) == "bf16-native"  # the EPYC
    assert budget.kernel_class("cpu", {"bf16": True}) == "bf16-native"  # Arm with BF16
    assert budget.kernel_class("cpu", {"avx2": True}) == "bf16-emulated"
    assert budget.kernel_class("cuda:0") == "cuda"
    for cls in (*budget.KERNEL_CLASSES, "cuda"):
        cal = budget.calibration(cls)
        assert cal["for_class"] == cls and cal["kernel_class"] in budget.KERNEL_CLASSES
        assert (cal["kernel_class"] == cls) == (budget.data_dir() / "budget" / f"{cls}.json").exists()


def test_the_plan_names_its_calibration_and_a_borrowed_one_says_so():
    own = budget.plan(dict(SAME, kernel_class="bf16-amx"), NOTEBOOKS)
    assert "the bf16-amx calibration (this machine's kernel class)" in budget.plan_lines(own)[1]
    lent = budget.plan(dict(SAME, kernel_class="cuda"), NOTEBOOKS)  # no GPU calibration: the nearest CPU's
    assert "no calibration for this machine's kernel class (cuda)" in budget.plan_lines(lent)[1]


def test_each_notebook_follows_its_own_probe_not_a_mean():
    """bf16 4x slower and float32 as fast (the EPYC against the AMX Xeon): only what runs bf16 takes 4x."""
    cal = budget.calibration("bf16-amx")
    ref = budget.probe_ms(cal["probe"])
    est = budget._estimates(_probe(4 * ref["bfloat16"], ref["float32"]), cal)
    for stem, kernels in budget.FOLLOWS.items():
        assert est["fixed_s"][stem] == pytest.approx(cal["fixed_s"][stem] * (4.0 if kernels == "bfloat16" else 1.0))
    host = _probe(ref["bfloat16"], ref["float32"])
    host["rows"].append({"kernels": "host", "preset": "tiny", "dtype": "float32", "chunk_ms": 3.0, "n": 4,
                         "build_s": 0.3})
    with_host = dict(cal, probe=host)
    slow_host = dict(host, rows=host["rows"][:2] + [dict(host["rows"][2], chunk_ms=6.0)])
    assert budget._speed(slow_host, with_host) == pytest.approx({"bfloat16": 1.0, "float32": 1.0, "host": 2.0})
    assert budget._speed(slow_host, cal)["host"] == 1.0, "a calibration without the host kernel: it follows float32"
    assert set(budget.FOLLOWS) == set(NOTEBOOKS) and set(budget.FOLLOWS.values()) <= set(budget.PROBES)


def test_calibration_is_a_run_not_typed_figures():
    assert CAL["source"] and set(CAL["fixed_s"]) == set(NOTEBOOKS)
    assert set(CAL["full_over_small"]) == {"bfloat16", "float32"} and CAL["full_build_s"] > 0
    assert {"bfloat16", "float32"} <= set(budget.probe_ms(CAL["probe"])) <= set(budget.PROBES)
    assert CAL["kernel_class"] in budget.KERNEL_CLASSES


def test_a_slow_cpu_is_scaled_to_the_budget_with_reasons():
    p = budget.plan(NO_BF16, NOTEBOOKS)
    at_minimum = all(p["sizes"][n] == budget.SCALABLE[n][2] for n in budget.SCALABLE)
    assert p["total_s"] <= budget.BUDGET_S or at_minimum
    assert {s["param"] for s in p["scaled"]} == set(budget.SCALABLE)
    for s in p["scaled"]:
        assert s["value"] < s["default"] and s["value"] >= budget.SCALABLE[s["param"]][2]
        assert "would not fit" in s["why"] and "bfloat16 3.00x" in s["why"]
    assert p["params"] == {s["param"]: s["value"] for s in p["scaled"]}
    lines = budget.plan_lines(p)
    assert f"01_root_cause: streams {p['sizes']['chunks']} chunks" in "\n".join(lines)
    assert any(line.strip().startswith("scaled chunks 480 ->") for line in lines)


def test_a_fast_device_runs_the_defaults():
    p = budget.plan(GPU, NOTEBOOKS)
    assert p["scaled"] == [] and p["params"] == {}
    assert p["sizes"] == {n: default for n, (_, default, _) in budget.SCALABLE.items()}


def test_a_machine_too_slow_for_the_minimums_gets_the_minimums_and_says_the_estimate():
    p = budget.plan(_probe(50 * REF_MS["bfloat16"], 50 * REF_MS["float32"]), NOTEBOOKS)
    assert p["sizes"] == {n: budget.SCALABLE[n][2] for n in budget.SCALABLE}
    assert p["total_s"] > budget.BUDGET_S and p["at_minimum"]
    lines = budget.plan_lines(p)
    assert "against a 600 s budget" in lines[0]
    assert "even at their minimum sizes" in lines[-1] and "the run goes on at the minimums" in lines[-1]
    assert not any("minimum sizes" in line for line in budget.plan_lines(budget.plan(NO_BF16, NOTEBOOKS)))


def test_given_parameters_are_never_changed_and_count_at_their_value():
    free = budget.plan(NO_BF16, NOTEBOOKS)
    p = budget.plan(NO_BF16, NOTEBOOKS, given={"chunks": 480})
    assert "chunks" not in p["params"] and p["sizes"]["chunks"] == 480
    assert p["sizes"]["steps"] <= free["sizes"]["steps"]
    only05 = budget.plan(NO_BF16, ["05_profiling"])
    assert set(only05["sizes"]) == {"steps", "repeats"} and set(only05["estimate_s"]) == {"05_profiling"}


def test_the_runner_passes_the_plan_only_where_declared_and_not_given():
    p = budget.plan(NO_BF16, NOTEBOOKS)
    d01, d05 = {"chunks": {}, "seed": {}}, {"steps": {}, "repeats": {}, "budget_s": {}}
    assert _planned(p, {}, d01, 0.0, "01_root_cause") == {"chunks": p["sizes"]["chunks"]}
    got = _planned(p, {}, d05, 300.0, "05_profiling")
    assert got["steps"] == p["sizes"]["steps"] and got["budget_s"] > 0
    assert _planned(p, {"steps": 12, "repeats": 9}, d05, 300.0) == {}, "-p steps: no budget for the whole decodes"
    assert _planned(None, {}, d05, 0.0) == {}


def test_notebook_budget_follows_the_time_actually_left_but_never_vanishes():
    p = budget.plan(NO_BF16, NOTEBOOKS)
    fixed05 = p["estimate_s"]["05_profiling"] - p["whole_s"]
    early, late = budget.notebook_budget(p, 100.0), budget.notebook_budget(p, 450.0)
    assert early > late >= fixed05 + p["whole_s"] / 3
    assert budget.notebook_budget(p, 10_000.0) == pytest.approx(fixed05 + p["whole_s"] / 3)


def test_time_left_counts_from_check_params():
    import time

    from fastattn.lab.workbook import time_left
    assert time_left(check_params(budget_s=0.0)) is None
    P = check_params(budget_s=100.0)
    assert 84 < time_left(P) <= 85.0
    P["_started"] = time.monotonic() - 200
    assert time_left(P) == 0.0


def test_steps_for_fits_and_clamps():
    assert steps_for(1.0, 10_000, steps=12) == 12
    assert steps_for(1.0, 4 * 8, steps=12) == 7      # 4 generates of (7 + 1) steps
    assert steps_for(10.0, 1.0, steps=12) == 3


def test_check_params_budget():
    assert check_params(budget_s=0.0)["budget_s"] == 0.0
    for bad in (-1, "10", True):
        with pytest.raises(ValueError, match="budget_s"):
            check_params(budget_s=bad)


# ------------------------------------------------------------------ 05's dtype comparison, from records
def _decode(step_s: float, n: int, rng, identical=True, disturbed=0, pf=0.97) -> dict:
    rows = []
    for variant, f in (("upstream", 1.0), ("patched", pf)):
        for r in range(2):
            steps = [step_s * f * rng.uniform(0.97, 1.03) for _ in range(n)]
            flags = [i < disturbed for i in range(n)]
            steps = [s * (5 if d else 1) for s, d in zip(steps, flags)]
            rows.append({"variant": variant, "repeat": r, "wall_s": sum(steps), "step_seconds": steps,
                         "step_disturbed": flags})
    return {"rows": rows, "identical": identical, "params": {"steps": n + 1}}


def _dtype_rec(steps: dict, peak: dict, device="cpu", seed=0, disturbed=0, pf=0.97) -> dict:
    rng = random.Random(seed)
    w = {"bfloat16": 4.9e9, "float32": 9.8e9, "float16": 4.9e9}
    return {"kind": "dtype_decode", "env": {"device": device}, "params": {"dtypes": list(steps), "steps": 12,
            "budget_s": 100.0, "inference_timesteps": 10, "preset": "full"},
            "dtypes": {d: {"decode": _decode(s, 11, rng, disturbed=disturbed, pf=pf), "peak_bytes": peak.get(d),
                           "weights_bytes": w[d], "build_s": 20.0} for d, s in steps.items()},
            "sizing": {}}


NO_BF16_FLAGS = {"avx512f": False, "avx512_bf16": False, "amx_bf16": False, "avx2": True, "bf16": False}


def test_cpu_without_native_bf16_is_told_to_opt_into_fp32_with_its_price():
    rec = _dtype_rec({"bfloat16": 9.5, "float32": 3.7}, {"bfloat16": 6e9, "float32": 11e9})
    rows = dtype_table(rec)
    assert [(r["dtype"], r["variant"]) for r in rows][0] == ("bfloat16", "upstream")
    r = dtype_recommendation(rec, NO_BF16_FLAGS)
    assert r["decided"] and r["dtype"] == "float32" and r["patched"] and r["changes_results"]
    assert r["ratio"] < 0.4 and r["ci"][1] < 1 and r["native_bf16"] is False
    assert "opt-in" in r["line"] and "VOXCPM_CPU_DTYPE=float32" in r["line"] and "no bf16 instructions" in r["line"]
    assert "weights 4.9 -> 9.8 GB" in r["line"] and "peak 6.0 -> 11.0 GB" in r["line"]
    f = dtype_findings(r)
    assert f["fastest configuration here (opt-in where its dtype is not voxcpm's default)"] == "float32 + patch"


def test_native_bf16_keeps_the_default_and_noise_never_decides():
    fast_bf16 = _dtype_rec({"bfloat16": 1.5, "float32": 2.25}, {})
    r = dtype_recommendation(fast_bf16, {"avx512_bf16": True})
    assert r["dtype"] == "bfloat16" and not r["changes_results"] and r["native_bf16"] is True
    tie = _dtype_rec({"bfloat16": 2.0, "float32": 2.0}, {}, pf=1.0)  # noise alone: never a recommendation
    r = dtype_recommendation(tie)
    assert r["dtype"] == "bfloat16" and "Keep voxcpm's default" in r["line"]


def test_disturbed_steps_are_left_out_and_counted():
    rec = _dtype_rec({"bfloat16": 1.5, "float32": 2.25}, {}, disturbed=3)
    rows = dtype_table(rec)
    assert all(r["disturbed"] == 6 and r["n"] == 16 for r in rows)
    assert rows[0]["step s"] < 1.6, "the 5x disturbed steps would move the median"


def test_gpu_shaped_dtypes_include_fp16_and_the_default_first():
    assert whole_dtypes("cpu", "bfloat16") == ("bfloat16", "float32")
    assert whole_dtypes("cpu", "float32") == ("bfloat16", "float32")
    rec = _dtype_rec({"bfloat16": 0.02, "float32": 0.05, "float16": 0.02}, {"bfloat16": 6e9}, device="cuda:0")
    r = dtype_recommendation(rec, {})
    assert r["dtype"] in ("bfloat16", "float16") and r["native_bf16"] is None
    assert len(dtype_table(rec)) == 6


def test_sizing_line_says_what_was_scaled():
    rec = _dtype_rec({"bfloat16": 1.5, "float32": 2.25}, {})
    assert "no time budget" in sizing_line(rec)
    rec = copy.deepcopy(rec)
    rec["sizing"] = {"bfloat16": {"warm_step_s": 9.5, "budget_s": 120.0, "steps": 4}}
    assert "scaled down from 12" in sizing_line(rec) and "bfloat16: 4 steps" in sizing_line(rec)


def test_the_ledger_judges_the_default_dtype(tmp_path):
    import json

    from fastattn.lab.claims import claims_ledger
    rec = _dtype_rec({"bfloat16": 9.5, "float32": 3.7}, {})
    rec["flags"] = NO_BF16_FLAGS
    (tmp_path / "05_profiling" / "records").mkdir(parents=True)
    (tmp_path / "05_profiling" / "records" / "dtype_decode.json").write_text(json.dumps(rec))
    row = next(r for r in claims_ledger(tmp_path) if r["source"] == "voxcpm")
    assert row["verdict"] == "does not hold" and "float32" in row["evidence"]


def test_the_dtype_target_is_judged_only_without_native_bf16():
    from fastattn.lab.bench.targets import check_targets
    slow = _dtype_rec({"bfloat16": 9.5, "float32": 3.0}, {})
    slow["flags"] = NO_BF16_FLAGS
    row = next(t for t in check_targets({"dtypes": slow}) if t["id"] == "dtype_opt_in")
    assert row["passed"] is True and row["measured"] < 0.35 and row["ci_high"] is not None and row["n"] == 22
    native = _dtype_rec({"bfloat16": 1.5, "float32": 2.25}, {})
    native["flags"] = {"avx512_bf16": True}
    row = next(t for t in check_targets({"dtypes": native}) if t["id"] == "dtype_opt_in")
    assert row["passed"] is None and row["note"].startswith("not applicable here")


def test_the_dtype_figure_draws_every_configuration():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastattn.lab import plots
    fig = plots.dtype_decode(_dtype_rec({"bfloat16": 9.5, "float32": 3.7}, {"bfloat16": 6e9, "float32": 11e9}))
    assert len(fig.axes[0].patches) == 4
    plt.close(fig)


def test_05s_repeats_never_reach_01():
    p = budget.plan(NO_BF16, NOTEBOOKS)
    assert "repeats" in p["params"]
    assert "repeats" not in _planned(p, {}, {"chunks": {}, "repeats": {}}, 0.0, "01_root_cause")
    assert _planned(p, {}, {"repeats": {}, "steps": {}}, 0.0, "05_profiling")["repeats"] == p["params"]["repeats"]


def test_step_timers_on_cuda_read_events(monkeypatch):
    """The CUDA branch of the step marks and component timers, fed fake events on CPU: elapsed times between
    consecutive marks, after one synchronisation."""
    from fastattn.lab.bench import decode

    class Event:
        clock = [0.0]

        def __init__(self, enable_timing=True):
            self.t = None

        def record(self):
            Event.clock[0] += 5.0
            self.t = Event.clock[0]

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(decode.torch.cuda, "Event", Event)
    monkeypatch.setattr(decode.torch.cuda, "synchronize", lambda *device: None)
    timers = decode.Timers("cuda")
    step = timers.mark(timers.wrap("base_lm", lambda: None))
    for _ in range(4):
        step()
    assert timers.step_s() == [0.015, 0.015, 0.015]  # mark, start, end: 15 ms apart in the fake clock
    assert timers.totals_s() == {"base_lm": 0.02} and timers.totals_s() == {}
    assert len(timers.step_disturbed()) == 3


def test_no_time_plan_on_a_gpu_from_cpu_calibrations():
    """The calibrations are CPU runs: a GPU's plan would give 04's cold CUDA-graph compiles seconds (B6), so a GPU
    run gets its notebooks' defaults and the reason, not a borrowed plan."""
    assert budget.unplannable("cpu") is None
    why = budget.unplannable("cuda:0")
    assert why.startswith("no time plan on cuda:0") and "GPU compile time" in why


def test_calibration_script_writes_a_calibration_the_planner_reads(tmp_path):
    """scripts/calibrate_budget.py on the committed reference run (01-05): the fixed seconds per notebook, the sweeps'
    seconds and the full model's cost over the probe's, in the form ``budget.calibration`` reads."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("calibrate_budget", ROOT / "scripts" / "calibrate_budget.py")
    cal_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal_mod)
    import json
    import shutil
    run = tmp_path / "run"  # the committed reference run, and an executed 05 whose sweep cells took 30 s
    shutil.copytree(ROOT / "data" / "results" / "cpu-xeon-amx-2threads-torch2.13.0", run)
    cells = [{"cell_type": "code", "source": ['x = sweep(P["repeats"])'], "metadata": {"papermill": {"duration": 30}}},
             {"cell_type": "code", "source": ["y = 1"], "metadata": {"papermill": {"duration": 99}}}]
    (run / "05_profiling.ipynb").write_text(json.dumps({"cells": cells}))
    cal = cal_mod.calibrate([run], CAL["probe"], path=tmp_path / "x.json")
    assert budget.calibration(path=tmp_path / "x.json")["fixed_s"] == cal["fixed_s"]
    assert set(cal["fixed_s"]) == set(NOTEBOOKS) and cal["sweep_s"] == pytest.approx(30 * 9 / 21)
    assert set(cal["full_over_small"]) == {"bfloat16", "float32"} and cal["source"] == [run.name]
    with pytest.raises(ValueError, match="no finished run of"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "summary.json").write_text(json.dumps({"notebooks": []}))
        cal_mod.calibrate([tmp_path / "empty"], CAL["probe"], path=tmp_path / "y.json")
