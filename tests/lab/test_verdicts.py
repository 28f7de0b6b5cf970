"""Every verdict at its own scale, from planted records: the words follow the numbers, an interval that reaches
its goal is undecided, a claim is judged only at the scale it speaks of, targets are judged against their bounds."""

import json
import statistics

import pytest

from fastattn.lab.bench.stats import NO, UNDECIDED, YES, judge
from fastattn.lab.bench.targets import check_targets, met_count
from fastattn.lab.claims import FAILS, HOLDS, NOT_SCALE, PARTLY, claims_ledger, position_cost

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)


def timed(mode_or_variant: dict, position: int, ms: list) -> dict:
    return {**mode_or_variant, "position": position, "median_ms": sorted(ms)[len(ms) // 2], "samples_ms": ms,
            "disturbed_flags": [False] * len(ms), "n": len(ms)}


def sweep(costs: dict, positions=(0, 4000, 8000)) -> dict:
    """An attention record: ``costs[mode](position, i)`` gives sample i's ms."""
    rows = [timed({"mode": m}, p, [f(p, i) for i in range(9)]) for m, f in costs.items() for p in positions]
    return {"kind": "attention", "params": {"positions": list(positions), "capacity": 8192, "modes": list(costs),
                                            "dtype": "float32", "caches": 1}, "rows": rows, "env": {"device": "cpu"}}


FLAT = lambda p, i: 4.0 + 0.01 * i  # noqa: E731
RISING = lambda p, i: 4.0 + p / 8000 * 5.5 + 0.01 * i  # noqa: E731  (4.46 ms -> 9.55 ms, as the EPYC run)
SLICE = lambda p, i: 0.1 + p / 8000 * 3 + 0.01 * i  # noqa: E731


@pytest.mark.parametrize("cost,verdict,word", [(FLAT, "flat", "stays flat"), (RISING, "grows", "grows with")])
def test_the_cost_line_under_01s_figure_follows_the_numbers(cost, verdict, word):
    r = position_cost(sweep({"reference": cost}))
    assert r["verdict"] == verdict and word in r["line"] and f"{r['growth']:.3g}x" in r["line"]


def test_noise_that_reaches_1_5x_leaves_the_cost_undecided():
    noisy = lambda p, i: 4.0 * (1 + 0.5 * (p > 0) * (i % 3))  # noqa: E731  medians 1x, 1.5x ... 2x
    assert position_cost(sweep({"reference": noisy}))["verdict"] == "undecided"


def _run(tmp_path, *records) -> str:
    rec_dir = tmp_path / "05_profiling" / "records"
    rec_dir.mkdir(parents=True)
    for i, r in enumerate(records):
        (rec_dir / f"r{i}.json").write_text(json.dumps(r))
    return tmp_path


def _ledger(run) -> dict:
    return {r["claim"]: r for r in claims_ledger(run)}


def test_the_floor_and_the_growth_of_seed_003s_claim_are_judged_apart(tmp_path):
    claim = "Decode attention cost scales with max_length, not with the sequence"
    flat = _ledger(_run(tmp_path / "a", sweep({"reference": FLAT, "slice_fix": SLICE})))[claim]
    rising = _ledger(_run(tmp_path / "b", sweep({"reference": RISING, "slice_fix": SLICE})))[claim]
    assert flat["verdict"] == HOLDS and "stays flat" in flat["evidence"]
    assert rising["verdict"] == PARTLY and "grows with the position" in rising["evidence"]
    assert "the floor is max_length's" in rising["evidence"]


def _stream(chunks: int, verdict: str, device: str = "cuda", weights: str = "checkpoint") -> dict:
    return {"kind": "stream_profile", "params": {"chunks": chunks, "preset": "full", "dtype": "bfloat16",
                                                 "weights": weights},
            "trend": {"upstream": {"verdict": verdict}}, "verdict": {"upstream": f"{verdict} (...)"},
            "rows": [], "env": {"device": device}}


@pytest.mark.parametrize("chunks,verdict,device,weights,want", [
    (60, "flat", "cuda", "checkpoint", NOT_SCALE), (60, "grows", "cuda", "checkpoint", NOT_SCALE),
    (500, "flat", "cuda", "checkpoint", FAILS), (500, "grows", "cuda", "checkpoint", HOLDS),
    (500, "flat", "cpu", "random", NOT_SCALE), (500, "grows", "cuda", "random", NOT_SCALE)])
def test_293s_row_is_judged_only_at_its_scale_and_device(tmp_path, chunks, verdict, device, weights, want):
    """#293 is a stream of 400+ chunks on the reporter's GPU with the real checkpoint: anything else is evidence."""
    row = _ledger(_run(tmp_path, _stream(chunks, verdict, device, weights)))[
        "Streaming slows from ~0.3 s to 1-2 s per chunk after 400+ chunks (#293)"]
    assert row["verdict"] == want and "400+" in row["scale"] and "CUDA" in row["scale"]
    if want == NOT_SCALE and chunks < 400:
        assert row["evidence"].startswith(f"({chunks} of 400+ chunks)")
    elif want == NOT_SCALE:
        assert row["evidence"].endswith(f"): {verdict}") and ("cpu" in row["evidence"] or "random" in row["evidence"])


def _whole(device: str, steps: int, patched_s: float) -> dict:
    rows = [{"variant": v, "repeat": i, "wall_s": (patched_s if v == "patched" else 1.0) * (1 + 0.001 * i)}
            for i in range(7) for v in ("upstream", "patched")]
    return {"kind": "whole_decode", "env": {"device": device}, "rows": rows, "identical": True,
            "params": {"preset": "full", "dtype": "bfloat16", "steps": steps}, "median_wall_s": {},
            "patched_granularity": 512}


@pytest.mark.parametrize("device,steps,patched_s,want", [
    ("cuda", 3600, 1 / 1.36, HOLDS), ("cuda", 3600, 1 / 1.1, FAILS), ("cuda", 12, 1 / 1.36, NOT_SCALE),
    ("cpu", 3600, 1 / 1.36, NOT_SCALE)])
def test_end_to_end_is_read_as_speed_and_judged_only_at_3500_steps_on_cuda(tmp_path, device, steps, patched_s, want):
    """"~36% faster" is 1.36x speed (the seed's 951 -> 699 s is 26.5% less time), over 3500+ steps on CUDA."""
    row = _ledger(_run(tmp_path, _whole(device, steps, patched_s)))["~36% faster end to end"]
    assert row["verdict"] == want, row
    assert f"{1 / patched_s:.2f}x the speed" in row["evidence"] and "3500+" in row["scale"]


@pytest.mark.parametrize("measured,ci,goal,want", [(0.943, (0.372, 1.6), 0.75, UNDECIDED),  # the two rows
                                                   (0.247, (0.17, 0.322), 0.2, UNDECIDED),
                                                   (0.85, (0.8, 0.9), 0.75, NO), (0.6, (0.5, 0.7), 0.75, YES),
                                                   (0.9, None, 0.75, NO)])
def test_an_interval_that_reaches_its_goal_is_undecided(measured, ci, goal, want):
    assert judge(measured, ci, goal) == want


def test_a_timed_figure_too_small_for_an_interval_is_undecided():
    """Two whole decodes a variant give a ratio but no interval: neither yes nor no (a count or a deterministic
    figure, with no n, is judged by its value)."""
    assert judge(0.9, None, 1.15, n=2) == UNDECIDED and judge(0.9, (0.85, 0.95), 1.15, n=5) == YES
    assert judge(0.9, None, 1.15) == YES


def test_no_target_reads_no_with_an_interval_that_reaches_its_goal():
    a = sweep({"reference": FLAT, "exact": lambda p, i: 0.2 + 0.05 * i, "fast": lambda p, i: 0.1 + 0.2 * (i % 2)},
              positions=(256,))
    rows = {t["id"]: t for t in check_targets({"attention_fp32": a})}
    assert rows["exact_p256"]["verdict"] == UNDECIDED and rows["exact_p256"]["passed"] is None
    assert all(not (t["verdict"] == NO and t["ci_low"] is not None and t["ci_low"] <= float(t["goal"][3:]))
               for t in rows.values())
    assert "undecided" in met_count(list(rows.values()))


def test_the_whole_decode_and_the_floor_are_judged_against_their_bounds():
    whole = {"params": {"preset": "full", "dtype": "bfloat16", "steps": 12}, "identical": True,
             "rows": [{"variant": v, "wall_s": w, "lm_attention_s": a, "local_dit_s": 5.0}
                      for v, w, a in (("upstream", 18.9, 6.6), ("patched", 12.3, 0.3)) for _ in range(3)]}
    w = next(t for t in check_targets({"whole": whole}) if t["id"] == "whole")
    bound = 1 - 6.6 / 18.9
    assert w["measured"] == pytest.approx(12.3 / 18.9 / bound) and "attention-free estimate 0.65" in w["note"]
    cold = sweep({"fast": lambda p, i: 1.2 + 0.01 * i, "gemm_floor": lambda p, i: 1.0 + 0.01 * i}, positions=(4096,))
    for r in cold["rows"]:
        r.update(floor_ms=0.26, x_floor=r["median_ms"] / 0.26, floor_meaningful=True)
    f = next(t for t in check_targets({"attention_fp32_cold": cold}) if t["id"] == "fast_floor_4096")
    assert f["measured"] == pytest.approx(1.2, rel=0.02) and f["verdict"] == YES and "DRAM floor 0.26 ms" in f["note"]


def test_the_end_to_end_claims_scale_is_the_seeds_own_record():
    """3500 steps and 1.36x speed are read from data/published/pr199.csv's row, not typed apart from it."""
    import re

    from fastattn.lab.claims import END_TO_END_STEPS
    from fastattn.lab.paths import load_published
    row = next(r for r in load_published("pr199.csv") if r["metric"] == "end-to-end wall time")
    assert int(re.search(r"min_len=(\d+)", row["note"])[1]) == END_TO_END_STEPS
    assert round(float(row["before"]) / float(row["after"]), 2) == 1.36  # "~36% faster" read as speed


# The audit's labels, each from the record it describes: plant the record both ways, the words follow.
def _whole_decode(up_s, pa_s, attention_share=0.5):
    rows = [{"variant": v, "repeat": i, "wall_s": w, "lm_attention_s": w * attention_share if v == "upstream" else
             0.0, "other_s": w * (1 - attention_share)} for v, w in (("upstream", up_s), ("patched", pa_s))
            for i in range(3)]
    return {"kind": "whole_decode", "rows": rows, "identical": True, "patched_granularity": 256,
            "median_wall_s": {"upstream": up_s, "patched": pa_s}}


@pytest.mark.parametrize("patched_s, below", [(4.0, True), (6.0, False)])  # Amdahl's estimate: 5.0 s of 10 s
def test_the_amdahl_line_says_below_its_estimate_only_when_patched_is(patched_s, below):
    from fastattn.lab.profiling import amdahl_line
    line = amdahl_line(_whole_decode(10.0, patched_s))
    assert "if that attention cost nothing: 5.0 s (0.50x)" in line
    assert ("below that estimate" in line) is below


@pytest.mark.parametrize("flags, capacity, last, verdict, count", [
    ((True,) * 6, 8192, 8191, HOLDS, "6 of 6"), ((True,) * 6, 2048, 511, PARTLY, "6 of 6"),
    ((True,) * 6, 8192, 511, PARTLY, "6 of 6"), ((True,) * 5 + (False,), 2048, 511, FAILS, "5 of 6")])
def test_the_exactness_row_counts_calls_and_holds_only_at_the_claims_scale(flags, capacity, last, verdict, count):
    """"Every position" is every one below voxcpm's 8192: a sweep that stops short of it (whatever its cache's
    capacity) holds in part, and says so."""
    from fastattn.lab.claims import _default_exact
    rows = [{"dtype": dt, "position": p, "exact_identical": f}
            for (dt, p), f in zip([(dt, p) for dt in ("bfloat16", "float32") for p in (0, 256, last)], flags)]
    got, evidence = _default_exact({"exactness_sweep": [{"rows": rows, "params": {"capacity": capacity}}]}, {})
    assert got == verdict and f"exact == reference in {count} calls (3 positions 0-{last} x bfloat16, float32, " \
        f"capacity {capacity})" in evidence
    assert ("were not swept here" in evidence) is (verdict == PARTLY)


@pytest.mark.parametrize("capacity, identical, verdict", [(8192, True, HOLDS), (8192, False, PARTLY),
                                                          (2048, True, PARTLY)])
def test_past_the_sweep_the_default_mode_rests_on_03s_calibration_at_the_block_edges(capacity, identical, verdict):
    """A 2048-slot sweep holds for every position below 8192 only where 03's calibration ran to 8192 and found its
    chosen window bit-identical at every block edge, in every dtype."""
    from fastattn.lab.claims import _default_exact
    sweep = {"rows": [{"dtype": "float32", "position": p, "exact_identical": True} for p in (0, 511)],
             "params": {"capacity": 2048}}
    ladder = {"params": {"capacity": capacity}, "rows": [
        {"dtype": dt, "lq": lq, "candidate": c, "chosen": 512, "bit_identical": identical or c != 512}
        for dt in ("float32", "bfloat16") for lq in (1, 5) for c in (256, 512, 1024)]}
    got, evidence = _default_exact({"exactness_sweep": [sweep], "exactness_calibration": [ladder]}, {})
    assert got == verdict and ("block edge up to 8192" in evidence) is (verdict == HOLDS)


@pytest.mark.parametrize("ci, want", [((1.1, 1.3), YES), ((1.6, 2.0), NO), ((0.2, 0.4), NO), ((1.4, 1.6), UNDECIDED),
                                      (None, UNDECIDED)])
def test_one_rule_judges_every_interval_and_the_ledger_speaks_it(ci, want):
    """stats.verdict is the rule; targets (judge) and the ledger (within) read it, each in its own words."""
    from fastattn.lab.bench.stats import verdict
    from fastattn.lab.claims import UNDECIDED as LEDGER_UNDECIDED
    from fastattn.lab.claims import within
    assert verdict(ci, 1.0, 1.5) == want
    assert within(ci, 1.0, 1.5) == {YES: HOLDS, NO: FAILS, UNDECIDED: LEDGER_UNDECIDED}[want]
    if ci and ci[0] >= 1.0:  # a goal ``<= 1.5``: the same interval, the same verdict
        assert judge(statistics.median(ci), ci, 1.5) == want


def test_fast_over_its_gemms_is_shown_at_the_position_that_decides_it():
    """Judged at every position: the row shows the one whose interval crosses the goal (undecided), not the worst
    value that stays inside it, and names the others' verdicts."""
    import random
    rng = random.Random(0)

    def rows(p, fast_ms, spread):
        gemm = [1.0 * rng.uniform(0.99, 1.01) for _ in range(9)]
        fast = [fast_ms * rng.uniform(1 - spread, 1 + spread) for _ in range(9)]
        return [{"mode": m, "position": p, "samples_ms": s, "median_ms": statistics.median(s), "n": 9,
                 "floor_ms": 0.5, "x_floor": statistics.median(s) / 0.5, "floor_meaningful": True}
                for m, s in (("fast", fast), ("gemm_floor", gemm))]
    att = {"params": {"caches": 36, "dtype": "float32"}, "rows": rows(1024, 1.3, 0.25) + rows(2048, 1.4, 0.02)}
    row = next(t for t in check_targets({"attention_fp32_cold": att}) if t["id"] == "fast_floor_far")
    assert row["verdict"] == UNDECIDED and "shown: p=1024" in row["target"] and row["ci_high"] > 1.5
    assert "p=2048: yes" in row["note"]


def test_a_dtype_ratio_names_its_decodes_beside_the_pooled_interval():
    from fastattn.lab.bench.metrics import dtype_ratio_text
    row = {"x bfloat16 upstream": 1.8, "per decode": [1.86, 1.79], "n": 22, "95% low": 1.77, "95% high": 1.82}
    assert dtype_ratio_text(row) == "1.80x (2 decodes: 1.86x, 1.79x; 95% CI over their 22 steps [1.77, 1.82])"


@pytest.mark.parametrize("n", [3, 4, 7, 8, 21])
def test_vectorized_intervals_equal_the_per_resample_statistics_median(n):
    """ratio_ci / scaled_ci resample in one call with numpy's median: the same bits as one Python call per resample
    with statistics.median (the intervals the committed records' docs were written with)."""
    import numpy as np
    from scipy.stats import bootstrap

    from fastattn.lab.bench.stats import CONFIDENCE, RESAMPLES, ratio_ci, scaled_ci
    rng = np.random.default_rng(n)
    a, b, c = rng.lognormal(0, 0.3, n), rng.lognormal(0.1, 0.3, n), rng.random(n + 2)

    def slow(data, stat, paired):
        res = bootstrap(data, stat, paired=paired, vectorized=False, n_resamples=RESAMPLES, method="percentile",
                        confidence_level=CONFIDENCE, random_state=np.random.default_rng(0))
        return float(res.confidence_interval.low), float(res.confidence_interval.high)
    ratio = lambda x, y: statistics.median(x) / statistics.median(y)  # noqa: E731
    assert ratio_ci(a, b) == slow((a, b), ratio, True)
    assert ratio_ci(a, c) == slow((a, c), ratio, False)
    assert scaled_ci(a, 0.7) == slow((a,), lambda x: statistics.median(x) / 0.7, False)
