"""A decode step split into voxcpm's components (fastattn.lab.bench.split): the bytes are the modules' own
parameters, the windows attribute each call to its step, and every reader takes a GPU-shaped record too."""

import copy

import pytest

from fastattn.lab.bench import metrics
from fastattn.lab.bench.decode import Timers
from fastattn.lab.bench.split import COMPONENTS, PHASES, step_split, window_times
from fastattn.lab.bench.targets import check_targets


@pytest.fixture(scope="module")
def split():
    from fastattn.models import build_voxcpm2
    model = build_voxcpm2("tiny", seed=0)
    return step_split("tiny", steps=3, repeats=3, model=model), model


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def test_every_phase_and_component_has_bytes_time_and_a_floor(split):
    rec, _ = split
    assert [(r["phase"], r["component"]) for r in rec["rows"]] == [(p, c) for p in PHASES for c in COMPONENTS]
    for r in rec["rows"]:
        assert r["bytes"] > 0 and r["floor_s"] > 0 and r["time_s"] > 0 and r["bound"] in ("bytes", "flops")
        assert r["efficiency"] == pytest.approx(r["floor_s"] / r["time_s"])
    for phase in rec["phases"].values():
        assert 0 < phase["coverage"] < 1.5 and phase["n"] >= 1  # the 10% contract is a target, judged on a quiet box
    assert rec["lever"]["component"] in COMPONENTS and rec["dit_passes_per_step"] >= 1


def test_the_lms_bytes_are_their_parameters_without_the_embedding_table(split):
    rec, model = split
    step = {r["component"]: r for r in rec["rows"] if r["phase"] == "step"}
    base = _nbytes(model.base_lm.parameters()) - _nbytes(model.base_lm.embed_tokens.parameters())
    assert step["base_lm"]["bytes"] == base
    assert step["residual_lm"]["bytes"] == _nbytes(p for n, p in model.residual_lm.named_parameters()
                                                   if not n.startswith("embed_tokens"))
    assert step["feat_decoder"]["bytes"] == rec["dit_passes_per_step"] * _nbytes(model.feat_decoder.parameters())
    assert 0 < step["audio_vae"]["bytes"] <= _nbytes(model.audio_vae.decoder.parameters())


def test_windows_attribute_each_call_to_its_step():
    t = Timers("cpu")
    t.marks = [1.0, 2.0, 3.0]  # base-LM steps start at 1, 2, 3: prefill [0, 1), steps [1, 2) and [2, 3)
    t.samples = {"base_lm": [(1.0, 1.25), (2.0, 2.5)], "feat_decoder": [(0.5, 0.75), (1.5, 1.75)],
                 "audio_vae": [(3.1, 3.2)]}  # after the last mark: a tail, no whole step
    rows = window_times(t, 0.0)
    assert [r["wall_s"] for r in rows] == [1.0, 1.0, 1.0]
    assert [(r["base_lm"], r["feat_decoder"], r["audio_vae"]) for r in rows] == [(0, 0.25, 0), (0.25, 0.25, 0),
                                                                                 (0.5, 0, 0)]


def _gpu_shaped(rec: dict) -> dict:
    gpu = copy.deepcopy(rec)
    gpu["env"].update(device="cuda", device_name="NVIDIA H100 80GB HBM3", torch="2.11.0+cu128", cpu_features=None)
    return gpu


@pytest.mark.parametrize("shape", ["cpu", "gpu"])
def test_the_readers_take_a_record_of_either_device(split, shape, tmp_path):
    from fastattn.lab import plots, profiling
    from fastattn.lab.bench.records import save_record
    from tools.readme import machine_readings
    rec = split[0] if shape == "cpu" else _gpu_shaped(split[0])
    fig = metrics.step_floor(rec)
    assert fig.value == pytest.approx(rec["phases"]["step"]["wall_s"] / rec["phases"]["step"]["floor_s"])
    assert f"runs at {rec['phases']['step']['efficiency']:.2f} of its floor" in metrics.split_line(rec)
    rows = {r["id"]: r for r in check_targets({"split": rec})}
    assert rows["step_floor"]["measured"] == fig.value and rows["split_adds_up"]["verdict"] in ("yes", "no")
    assert len(profiling.split_table(rec)) == len(rec["rows"])
    plots.step_split(rec)
    save_record(rec, tmp_path / "machine-a", "step_split_tiny")
    assert "runs at" in machine_readings(tmp_path) and ("H100" in machine_readings(tmp_path)) == (shape == "gpu")


def test_compile_line_reads_each_variant_and_names_a_failure():
    walls = {"eager": [1.0, 1.1, 1.0], "compiled": [1.05, 1.1, 1.04]}
    variant = {"wall_s": walls, "ratio": 1.04, "ratio_ci": (1.0, 1.1), "compile_and_first_s": 94.0,
               "max_abs_diff": 1.1e-3, "output_rms": 0.18, "failed": {}}
    rec = {"params": {"preset": "full", "dtype": "bfloat16", "steps": 8}, "env": {"device": "cpu"},
           "variants": {"upstream": variant, "patched": {**variant, "failed": {"feat_decoder": "X: y"}}}}
    line = metrics.compile_line(rec)
    assert line.count("compiled / eager 1.04x (95% CI [1, 1.1], n=3)") == 2 and "compile plus first decode 94 s" in line
    assert "failed: {'feat_decoder': 'X: y'}" in line
