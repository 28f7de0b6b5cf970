"""scripts/voxcpm_decode_bench.py: its statistics, its baselines, and one tiny run of a tree against itself."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH_PATH = ROOT / "scripts" / "voxcpm_decode_bench.py"

spec = importlib.util.spec_from_file_location("voxcpm_decode_bench", BENCH_PATH)
bench = importlib.util.module_from_spec(spec)
assert spec.loader is not None
spec.loader.exec_module(bench)


def test_median_ci_brackets_the_median_and_needs_six_samples():
    median, ci = bench.median_ci([float(x) for x in range(1, 21)])

    assert median == 10.5 and ci[0] < median < ci[1]
    assert bench.median_ci([1.0, 2.0, 3.0]) == (2.0, None)


def test_slope_ci_recovers_a_linear_trend():
    slope, ci = bench.slope_ci([5.0 + 0.25 * i for i in range(60)])

    assert slope == pytest.approx(0.25) and ci[0] == pytest.approx(0.25) and ci[1] == pytest.approx(0.25)


def test_each_optimize_mode_is_compared_with_its_own_baseline():
    runs = bench.plan_runs([("main", None), ("pr", Path("src"))], "both")

    assert bench.baselines(runs) == {
        "main optimize=off": "main optimize=off",
        "pr optimize=off": "main optimize=off",
        "main optimize=on": "main optimize=on",
        "pr optimize=on": "main optimize=on",
    }


def test_a_tree_against_itself_decodes_the_same_waveform(tmp_path):
    """Random weights of a tiny VoxCPM2, on CPU: two processes of one tree give the same waveform."""
    out = tmp_path / "bench.json"
    tree = f"{ROOT / 'src'}"
    args = ["--random", "tiny", "--variant", f"a={tree}", "--variant", f"b={tree}", "--positions", "0,64"]
    args += ["--chunks", "6", "--rounds", "1", "--calls", "2", "--timesteps", "2", "--out", str(out)]
    subprocess.run([sys.executable, str(BENCH_PATH), *args], check=True, timeout=600)
    first, second = json.loads(out.read_text())["variants"]

    assert second["baseline"] == "a" and second["stream"]["equal_to_first"]
    assert set(second["steps"]) == {"0", "64"} and second["stream"]["chunks"] == 6
