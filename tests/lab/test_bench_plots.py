"""Benchmarks and plots on tiny sizes: records have their fields, interleaving and repeats are honoured,
plots build from records, the floor math, no CUDA touched without CUDA. No test asserts a timing."""

import json
from pathlib import Path

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from fastattn.lab import bench, plots  # noqa: E402
from fastattn.lab.bench import metrics  # noqa: E402

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)


def test_time_interleaved_honours_repeats_and_balances_neighbours():
    """Every repeat runs each variant once; across repeats each variant follows every other one (a call pays
    for its predecessor's cache traffic: a rotated order keeps the same neighbour and biases one variant)."""
    calls = []
    fns = {n: (lambda n=n: calls.append(n)) for n in "abcd"}
    out = bench.time_interleaved(fns, repeats=40, warmup=1)
    assert {n: len(v) for n, v in out.items()} == {n: 40 for n in "abcd"}
    timed = calls[4:]  # after one warm-up round
    rounds = [timed[i * 4:(i + 1) * 4] for i in range(40)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    before = {n: {s[i - 1] for s in rounds for i in range(1, 4) if s[i] == n} for n in "abcd"}
    assert all(len(p) == 3 for p in before.values()), before  # each follows all three others
    calls.clear()
    bench.time_interleaved(fns, repeats=40, warmup=1)
    assert calls[4:] == timed  # seeded: the same order again
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        bench.time_interleaved(fns, repeats=0)


def test_floor_math():
    assert bench.live_kv_bytes(1000, 2, 128, "float32") == 2 * 2 * 1000 * 128 * 4
    assert bench.live_kv_bytes(1000, 2, 128, "bfloat16") == 2 * 2 * 1000 * 128 * 2
    assert bench.floor_ms(1000, 2, 128, "float32", gb_per_s=2.048) == pytest.approx(1.0)


BW = {"gb_per_s": 10.0, "llc_bytes": 1 << 20}


def test_attention_sweep_record_fields():
    rec = bench.attention_sweep([0, 40, 200], capacity=256, hq=4, hkv=2, head_dim=16, repeats=2, warmup=0,
                                bw=BW, progress=False)
    assert rec["kind"] == "attention" and len(rec["rows"]) == 15  # 3 modes, slice fix, bare GEMMs; 3 positions
    assert rec["params"]["modes"] == ["reference", "exact", "fast", "slice_fix", "gemm_floor"]
    assert rec["params"]["caches"] == 1
    assert rec["fast_choice"] and rec["fast_choice"][0]["winner"] in ("sdpa_slice", "grouped_fp32")
    for key in ("torch", "voxcpm", "device_name", "dtype", "threads", "git_commit", "time_utc"):
        assert key in rec["env"]
    r = rec["rows"][0]
    for key in ("mode", "position", "length", "window", "median_ms", "p10_ms", "p90_ms", "floor_ms", "x_floor",
                "floor_meaningful", "n", "max_err_f64"):
        assert key in r
    assert all(r["n"] == 2 == len(r["samples_ms"]) for r in rec["rows"])
    assert all(r["max_err_f64"] is None for r in rec["rows"] if r["mode"] == "gemm_floor")
    assert {r["window"] for r in rec["rows"] if r["mode"] == "reference"} == {256}
    assert [r["window"] for r in rec["rows"] if r["mode"] == "fast"] == [1, 41, 201]
    assert [r["window"] for r in rec["rows"] if r["mode"] == "slice_fix"] == [1, 41, 201]
    json.dumps(rec)
    with pytest.raises(ValueError, match=r"positions must be in \[0, capacity=256\)"):
        bench.attention_sweep([256], capacity=256, bw=BW, progress=False)
    with pytest.raises(ValueError, match="caches must be an int >= 1"):
        bench.attention_sweep([0], capacity=256, caches=0, bw=BW, progress=False)


def test_cold_sweep_rotates_caches_and_judges_the_floor_there():
    """caches=N: each call reads a different cache (the data cycled, not one cache, decides whether the
    floor binds); the errors are those of cache 0, the same as a warm sweep's on the same seed."""
    kw = dict(capacity=256, hq=4, hkv=2, head_dim=16, repeats=3, warmup=0, progress=False, modes=("reference", "fast"))
    warm = bench.attention_sweep([200], bw={"gb_per_s": 10.0, "llc_bytes": 100_000}, **kw)
    cold = bench.attention_sweep([200], bw={"gb_per_s": 10.0, "llc_bytes": 100_000}, caches=4, **kw)
    live = cold["rows"][0]["live_bytes"]  # 2 x 2 heads x 201 x 16 x 4 B = 51 kB: one fits, four do not
    assert live < 100_000 < 4 * live
    assert [r["floor_meaningful"] for r in warm["rows"]] == [False] * 4
    assert [r["floor_meaningful"] for r in cold["rows"]] == [True] * 4
    assert [r["max_err_f64"] for r in warm["rows"]][:2] == [r["max_err_f64"] for r in cold["rows"]][:2]
    t = {x["target"]: x for x in bench.check_targets({"attention_fp32": warm, "attention_fp32_cold": cold})}
    assert all("rotated over 4 caches" in x["note"] for k, x in t.items() if "floor" in k)


def test_ratio_intervals_bracket_the_median_ratio_and_need_samples():
    import random
    rnd = random.Random(0)
    a = [1.0 + 0.1 * rnd.random() for _ in range(15)]
    b = [2.0 + 0.1 * rnd.random() for _ in range(15)]
    lo, hi = bench.ratio_ci(a, b)
    import statistics
    assert lo <= statistics.median(a) / statistics.median(b) <= hi and hi - lo < 0.1
    assert bench.ratio_ci(a[:2], b[:2]) is None  # two samples: no interval worth the name
    lo, hi = bench.scaled_ci(a, 0.5)
    assert lo <= statistics.median(a) / 0.5 <= hi
    assert bench.ratio_ci(a, b) == bench.ratio_ci(a, b)  # seeded: the same records give the same interval


def test_targets_carry_intervals_n_and_whether_the_interval_decides():
    row = lambda m, ms, spread: {"mode": m, "position": 256, "median_ms": ms, "n": 9,  # noqa: E731
                                 "samples_ms": [ms + spread * (i - 4) / 4 for i in range(9)]}
    tight = {"rows": [row("reference", 10.0, 0.1), row("exact", 0.5, 0.01), row("fast", 0.49, 0.2)]}
    t = bench.check_targets({"attention_fp32": tight})
    exact, fast = t[0], t[1]
    assert exact["n"] == 9 and exact["ci_low"] <= exact["measured"] <= exact["ci_high"] and exact["decided"]
    assert fast["verdict"] == "undecided" and fast["passed"] is None  # 0.049 <= 0.05, the interval straddles it
    goals = bench.target_goals()
    from fastattn.lab.bench.targets import MUST_HOLD
    assert all(g["goal"] for g in goals) and len(goals) == len(bench.GOALS) + len(MUST_HOLD)
    restated = {g["target"]: g["history"] for g in goals if g["history"] != "as first set"}
    assert len(restated) == 3 and all("restated 2026-12-02 (e186bf7)" in h for h in restated.values())


def test_a_goal_over_positions_is_judged_at_every_position():
    """fast / bare GEMMs at p >= 1024: one position's interval across 1.5 makes the target undecided, though the
    worst position's interval is below it; one position wholly above makes it a miss."""
    from fastattn.lab.bench.stats import judge_all
    met, crossing, missed = (1.2, (1.1, 1.3), 9), (1.3, (1.11, 1.54), 9), (1.7, (1.6, 1.8), 9)
    assert judge_all([met, met], 1.5) == "yes"
    assert judge_all([met, crossing], 1.5) == "undecided"
    assert judge_all([crossing, missed], 1.5) == "no"


def test_decode_step_sweep_tiny_is_bit_identical():
    rec = bench.decode_step_sweep([0, 5, 300], preset="tiny", dtype="float32", repeats=2, warmup=0,
                                  max_length=512, progress=False)
    assert {(r["variant"], r["position"]) for r in rec["rows"]} == {(v, p) for v in ("upstream", "patched")
                                                                       for p in (0, 5, 300)}
    assert all(r["bit_identical"] for r in rec["rows"])
    assert rec["params"]["hidden"] == 64


def test_whole_decode_tiny_breakdown():
    import torch.nn.functional as F
    sdpa = F.scaled_dot_product_attention
    rec = bench.whole_decode("tiny", steps=6, dtype="float32", inference_timesteps=2, repeats=2, progress=False)
    assert rec["identical"] is True
    assert len(rec["rows"]) == 4 and {r["variant"] for r in rec["rows"]} == {"upstream", "patched"}
    for r in rec["rows"]:
        assert r["base_lm_s"] > 0 and r["residual_lm_s"] > 0 and r["local_dit_s"] > 0 and r["lm_attention_s"] > 0
        assert r["lm_attention_s"] <= r["base_lm_s"] + r["residual_lm_s"]
    up = [r for r in rec["rows"] if r["variant"] == "upstream"][0]
    pa = [r for r in rec["rows"] if r["variant"] == "patched"][0]
    assert pa["kv_bytes"] * 10 <= up["kv_bytes"]
    assert rec["patched_granularity"] == 512  # a real window on CPU (None where the cache keeps every slot)
    assert F.scaled_dot_product_attention is sdpa  # the attention timer is removed afterwards


def test_kv_memory_and_allocations():
    kv = bench.kv_memory("full", prefill=100, steps=200)
    assert kv["upstream_bytes"] == 36 * 2 * 2 * 128 * 2 * 8192  # the 302 MB of RESEARCH.md, bf16
    assert kv["ratio"] <= 0.1
    assert {(r["lm"], r["variant"]): r["slots"] for r in kv["rows"]} == {
        ("base_lm", "upstream"): 8192, ("base_lm", "patched"): 512,  # 300 tokens in 512-slot windows
        ("residual_lm", "upstream"): 8192, ("residual_lm", "patched"): 512}
    longer = bench.kv_memory("tiny", prefill=100, steps=600, max_length=1024)
    assert {r["slots"] for r in longer["rows"] if r["variant"] == "patched"} == {1024}  # grew past 512
    al = bench.step_allocations(preset="tiny", layers=1, position=100, max_length=1024)
    assert al["variants"]["upstream"]["allocated_bytes"] > al["variants"]["patched"]["allocated_bytes"]


def test_save_record_never_overwrites(tmp_path):
    rec = {"kind": "x", "env": {"device": "cpu", "dtype": "float32"}, "rows": [{"a": 1, "b": [1]}]}
    p1, p2 = bench.save_record(rec, tmp_path), bench.save_record(rec, tmp_path)
    assert p1 != p2 and p1.exists() and p2.exists() and p1.with_suffix(".csv").exists()
    assert bench.load_record(p1) == rec


def test_check_targets_from_records():
    att = {"rows": [{"mode": "reference", "position": 256, "median_ms": 10.0},
                    {"mode": "exact", "position": 256, "median_ms": 0.9},
                    {"mode": "fast", "position": 256, "median_ms": 0.6},
                    {"mode": "fast", "position": 2048, "median_ms": 1.0, "x_floor": 2.5, "floor_meaningful": False,
                     "floor_ms": 0.4},
                    {"mode": "gemm_floor", "position": 2048, "median_ms": 0.9, "x_floor": 2.25}]}
    t = bench.check_targets({"attention_fp32": att})
    assert [x["verdict"] for x in t] == ["yes", "no", "yes"]  # no samples: no interval, the median decides
    assert "last-level cache" in t[2]["note"] and t[2]["measured"] == pytest.approx(1.0 / 0.9)


def test_check_targets_fast_and_growth_branches():
    row = lambda m, p, ms, err, **kw: {"mode": m, "position": p, "median_ms": ms, "max_err_f64": err, **kw}  # noqa: E731
    att = {"fast_choice": [{"winner": "grouped_fp32"}],
           "rows": [row("reference", 2048, 10.0, 1e-3), row("fast", 2048, 1.0, 1.5e-3),
                    row("slice_fix", 2048, 4.0, 1e-3), row("reference", 4096, 10.0, 1e-3),
                    row("fast", 4096, 1.0, 2.5e-3), row("slice_fix", 4096, 6.0, 1e-3)]}
    growth = {"params": {"prefill": 100, "steps": 8000, "preset": "full", "dtype": "bfloat16", "max_length": 8192},
              "summary": {"step_total_s": 0.3, "moves": 4, "bound_held_every_step": True, "upstream_fill_ms": 7.0}}
    t = {x["target"]: x for x in bench.check_targets({"attention_bf16": att, "growth": growth})}
    assert t["attention p=2048, bfloat16: fast / slice fix (seed 000)"]["passed"] is False   # 0.25 > 0.20
    assert t["attention p=4096, bfloat16: fast / slice fix (seed 000)"]["passed"] is True    # 0.17
    assert "grouped_fp32" in t["attention p=4096, bfloat16: fast / slice fix (seed 000)"]["note"]
    err = t["attention bfloat16: fast's error vs float64 / reference's (worst position)"]
    assert err["measured"] == pytest.approx(2.5) and err["passed"] is False
    grow = [x for k, x in t.items() if k.startswith("cache growth")]
    assert [x["passed"] for x in grow] == [False, True]  # 0.3 s > 0.2 s; 4 moves <= 6
    assert t["cache capacity <= max(2 x live length, granularity) at every step"]["passed"]


def test_no_cuda_touched_without_cuda(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    def boom(*a, **k):
        raise AssertionError("CUDA was touched")
    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    monkeypatch.setattr(torch.cuda, "Event", boom)
    bench.attention_sweep([3], capacity=64, hq=2, hkv=1, head_dim=16, repeats=1, warmup=0, bw=BW, progress=False,
                          device="auto")
    with pytest.raises(ValueError, match="CUDA is not available"):
        bench.attention_sweep([3], capacity=64, device="cuda", bw=BW, progress=False)


def test_plots_build_from_records():
    att = bench.attention_sweep([0, 100], capacity=128, hq=4, hkv=2, head_dim=16, repeats=1, warmup=0, bw=BW,
                                progress=False)
    dec = bench.decode_step_sweep([0, 50], preset="tiny", dtype="float32", repeats=1, warmup=0, max_length=256,
                                  progress=False)
    whole = bench.whole_decode("tiny", steps=3, dtype="float32", inference_timesteps=2, repeats=1, progress=False)
    figs = [plots.attention_sweep(att), plots.decode_step(dec), plots.breakdown(whole),
            plots.memory(bench.kv_memory("tiny")),
            plots.published_vs_ours(plots.load_published("seed000_forward_step.csv"), dec),
            plots.exactness([{"dtype": "float32", "position": 0, "fast_max_abs": 0.0, "reference_vs_f64": 1e-7,
                              "exact_identical": True}])]
    for f in figs:
        assert f.axes
    assert "<table>" in plots.backend_table([{"case": "c", "dtype": "float32", "head_dim": 128, "backend": "MATH",
                                              "kernel": "k", "helpers": [], "max_abs_err": 0.0, "correct": True}])


def test_published_numbers_have_sources():
    for name in ("seed000_forward_step.csv", "seed003_per_request.csv", "pr199.csv"):
        rows = plots.load_published(name)
        assert rows and all(r["source"] for r in rows)


def test_compiled_step_sweep_one_graph_per_variant():
    rec = bench.compiled_step_sweep([0, 40, 300], preset="tiny", backend="aot_eager", repeats=1, warmup=1,
                                    max_length=512, bucket=16, progress=False)
    assert {r["variant"] for r in rec["rows"]} == {"eager upstream", "compiled upstream", "eager patched",
                                                   "compiled patched"}
    assert rec["graphs"]["graph_breaks"] == 0
    assert rec["graphs"]["unique_graphs"] <= 2 + 1  # one per variant (+1 if the window's first size specialises)


REF = Path(__file__).resolve().parents[2] / "data" / "results" / __import__("tools.sources").sources.REFERENCE


def test_readme_figures_are_the_reference_records():
    """The records say what README claims (its figures are written from them by make docs, never typed)."""
    run = bench.load_run(REF)  # records by kind: a workbook run folder or a flat one
    assert run.get("whole_decode")["identical"] and run.get("stream_profile")["identical"]["exact"]
    ladder = run.get("exactness_calibration")["rows"]
    assert {r["chosen"] for r in ladder} == {512}
    assert run.get("targets")["env"]["git_commit"]  # README names the commit the records were made at


def _row_ms(rows, variant, position=256):
    return next(r for r in rows if r["variant"] == variant and r["position"] == position)["median_ms"]


def _lines_by_label(ax):
    """{label: (x, y)} of every line in the axes, errorbar medians included."""
    out = {}
    for c in ax.containers:  # errorbar containers: (data line, caplines, barlines)
        line = c.lines[0]
        out[c.get_label()] = (list(line.get_xdata()), list(line.get_ydata()))
    for line in ax.get_lines():
        if not line.get_label().startswith("_"):
            out.setdefault(line.get_label(), (list(line.get_xdata()), list(line.get_ydata())))
    return out


def test_plots_draw_the_records_medians():
    """The figures draw the record's numbers: each mode's medians and the floor, point for point."""
    rec = bench.attention_sweep([0, 40, 200], capacity=256, hq=4, hkv=2, head_dim=16, repeats=2, warmup=0,
                                bw=BW, progress=False)
    ax = plots.attention_sweep(rec).axes[0]
    drawn = _lines_by_label(ax)
    for mode in rec["params"]["modes"]:
        rows = [r for r in rec["rows"] if r["mode"] == mode]
        assert drawn[mode] == ([r["position"] for r in rows], [r["median_ms"] for r in rows]), mode
    floor = next(v for k, v in drawn.items() if k.startswith("floor"))
    assert floor[1] == [r["floor_ms"] for r in rec["rows"] if r["mode"] == "reference"]
    dec = {"params": {"layers": 2, "hidden": 8, "heads": 2, "kv_heads": 1, "dtype": "float32"}, "env": {},
           "rows": [{"variant": v, "position": p, "median_ms": m, "p10_ms": m - 0.1, "p90_ms": m + 0.2}
                    for v, m0 in (("upstream", 5.0), ("patched", 1.0)) for p, m in ((0, m0), (256, m0 + 1))]}
    drawn = _lines_by_label(plots.decode_step(dec).axes[0])
    assert drawn["upstream"] == ([0, 256], [5.0, 6.0]) and drawn["patched"] == ([0, 256], [1.0, 2.0])


@pytest.mark.slow
def test_bench_cli_smoke(tmp_path, capsys):
    """`python -m fastattn bench attention` on a tiny sweep writes records that load back; bad input is clear."""
    from fastattn.lab.bench.cli import main
    assert main(["attention", "--positions", "0,40", "--capacity", "256", "--repeats", "1",
                 "--dtype", "float32", "--out", str(tmp_path / "run")]) == 0
    written = [p for p in capsys.readouterr().out.split() if p.endswith(".json")]
    kinds = {bench.load_record(p)["kind"] for p in written}
    assert kinds == {"bandwidth", "attention"}
    with pytest.raises(SystemExit):
        main(["nonsense"])
    with pytest.raises(SystemExit):  # skipping all it asked for runs nothing, not everything
        main(["bandwidth", "--skip", "bandwidth", "--out", str(tmp_path / "none")])
    assert "leaves nothing to run" in capsys.readouterr().err and not (tmp_path / "none").exists()


def test_bench_vae_streams_upstream_and_patched_interleaved(tmp_path, capsys):
    """`bench vae --preset tiny`: one record, both variants timed alike, the audio bit-identical."""
    from fastattn.lab.bench.cli import main
    assert main(["vae", "--preset", "tiny", "--steps", "2", "--repeats", "3", "--out", str(tmp_path / "run")]) == 0
    (path,) = [p for p in capsys.readouterr().out.split() if p.endswith(".json")]
    rec = bench.load_record(path)
    assert Path(path).name.startswith("vae_stream_tiny") and rec["identical"] is True
    assert [r["variant"] for r in rec["rows"]] == ["upstream", "patched"] and all(r["n"] >= 3 for r in rec["rows"])
    assert rec["params"]["weight_norm_convs"] > 0 and metrics.vae_ratio(rec).n >= 3
    assert "bit-identical" in metrics.vae_line(rec) and "NOT" not in metrics.vae_line(rec)


def test_stream_profile_record_and_verdict():
    rec = bench.stream_profile("tiny", 14, modes=("upstream", "exact"), progress=False, retries=0)
    assert rec["kind"] == "stream_profile" and rec["params"]["chunks"] == 14
    assert {r["variant"] for r in rec["rows"]} == {"upstream", "exact"} and len(rec["rows"]) == 2 * 2 * 14
    assert all(r["ms"] > 0 and r["cpu_s"] >= 0 and r["switches"] >= 0 for r in rec["rows"])
    assert rec["rows"][1]["position"] == rec["rows"][0]["position"] + 1
    assert all(isinstance(r["disturbed"], bool) for r in rec["rows"])
    assert rec["identical"] == {"upstream": True, "exact": True}  # exact streams upstream's chunks bit for bit
    assert len(rec["sixths"]["exact"]) == 6
    assert rec["trend"]["exact"]["verdict"] in ("flat", "grows", "shrinks", "inconclusive")
    assert rec["verdict"]["exact"].startswith(rec["trend"]["exact"]["verdict"])
    drawn = _lines_by_label(plots.stream(rec).axes[0])
    assert any(k.startswith("exact: ") for k in drawn)
    with pytest.raises(ValueError, match="modes must be"):
        bench.stream_profile("tiny", 14, modes=("flash",))
    with pytest.raises(ValueError, match="chunks must be an int >= 7"):
        bench.stream_profile("tiny", 3)


def test_fmt_rounds_and_names_units():
    from fastattn.lab.tables import fmt, short
    assert fmt(1.003278041605974) == "1" and fmt(0.07687639974275731) == "0.0769" and fmt(6.761084000004303) == "6.76"
    assert fmt(4194304, "KV bytes upstream") == "4.19 MB" and fmt(True) == "yes"
    assert len(short("x" * 400)) == 160 and short("a  b") == "a b"


def test_dtype_costs_names_every_op_in_both_dtypes():
    rec = bench.dtype_costs(length=64, capacity=128, hq=4, hkv=2, head_dim=16, repeats=2, warmup=0)
    ops = {r["op"] for r in rec["rows"]}
    assert set(rec["ratios"]) == ops - {"bf16 -> fp32 conversion of K"} and len(ops) == 4
    assert all(v > 0 for v in rec["ratios"].values()) and all(r["n"] == 2 for r in rec["rows"])
    assert set(rec["flags"]) <= {"avx512f", "avx512_bf16", "amx_bf16", "avx2", "bf16"}


@pytest.mark.slow
def test_peak_rss_separates_the_caches_from_the_noise():
    rec = bench.peak_rss("tiny", steps=4, runs=1)
    up, pa = rec["variants"]["upstream"], rec["variants"]["patched"]
    assert up["cache_bytes"] > pa["cache_bytes"] > 0  # read from the caches: not a measurement outcome
    assert rec["summary"]["cache_bytes_saved"] == up["cache_bytes"] - pa["cache_bytes"]
    for r in rec["rows"]:
        assert r["request_bytes"] == r["peak_bytes"] - r["trimmed_bytes"]
        assert r["allocator_retained_bytes"] == r["resting_bytes"] - r["trimmed_bytes"]


def test_profiling_readings_are_arithmetic_on_the_records():
    from fastattn.lab import profiling
    row = lambda m, p, ms, **kw: {"mode": m, "position": p, "median_ms": ms, "n": 9, **kw}  # noqa: E731
    warm = {"rows": [row("reference", 256, 2.0), row("exact", 256, 0.2), row("fast", 4096, 0.5)]}
    cold = {"rows": [row("reference", 256, 4.0), row("exact", 256, 0.5), row("fast", 4096, 1.0, x_floor=4.0),
                     row("gemm_floor", 4096, 0.8, x_floor=3.2)]}
    dec = {"params": {"layers": 4, "dtype": "float32"},
           "rows": [{"variant": "upstream", "position": 256, "median_ms": 20.0},
                    {"variant": "patched", "position": 256, "median_ms": 6.0}]}
    r = profiling.step_vs_call(dec, warm, cold, 256)
    assert r["decode step saving per layer ms"] == 3.5 and r["isolated call saving ms, K/V warm"] == 1.8
    assert r["step saving / rotated call saving"] == pytest.approx(1.0)
    wc = {x["mode"]: x for x in profiling.warm_vs_cold(warm, cold)}
    assert wc["reference"]["rotated / warm"] == 2.0 and "gemm_floor" not in wc  # no warm row to compare
    fl = profiling.floor_reading(cold, 4096)
    assert fl["x_dram_floor"] == 4.0 and fl["x_gemm_floor"] == pytest.approx(1.25) and fl["gemm_x_dram_floor"] == 3.2


def test_dtype_reading_says_what_it_read():
    from fastattn.lab import profiling
    ops = ("masked SDPA over the capacity (upstream)", "SDPA over the slice", "bare GEMM q @ k^T")
    costs = {"params": {"length": 4096}, "ratios": dict(zip(ops, (3.0, 6.0, 2.0))), "flags": {"avx512_bf16": False},
             "rows": [{"op": "bf16 -> fp32 conversion of K", "dtype": "bfloat16", "median_ms": 0.1}]}
    att = lambda f: {"rows": [{"mode": m, "position": 4096, "median_ms": f * x}  # noqa: E731
                              for m, x in (("reference", 1.0), ("exact", 1.0), ("fast", 1.0), ("slice_fix", 1.0))]}
    r = profiling.dtype_reading(costs, att(1.0), att(2.0), 4096)
    assert r["bf16 / fp32 time per mode"]["fast"] == 2.0
    assert "6.0x fp32 in SDPA over the slice" in r["reading"] and "avx512_bf16 no" in r["reading"]


def GOAL(gid):
    return bench.GOALS[gid][1]


def test_target_rows_carry_unique_ids_and_are_judged_by_their_goal():
    from fastattn.lab.bench.targets import MUST_HOLD
    rows = bench.load_run(REF).get("targets")["rows"]
    ids = [r["id"] for r in rows]
    judged = {i.split("@")[0] for i in ids}
    assert len(ids) == len(set(ids)) and judged <= set(bench.GOALS) | set(MUST_HOLD)
    newer = {"dtype_opt_in", "step_floor", "split_adds_up"}  # set after the reference run was made
    assert (set(bench.GOALS) | set(MUST_HOLD)) - judged <= newer, "only targets newer than the reference"
    from fastattn.lab.bench.stats import judge
    from fastattn.lab.bench.targets import run_targets
    again = {r["id"]: r["verdict"] for r in run_targets(bench.load_run(REF))}  # today's rules, from the records
    assert {r["id"]: r["verdict"] for r in rows} == again
    for r in (r for r in rows if r["measured"] is not None and r["id"] != "fast_floor_far"):  # one point each
        gid = r["id"].split("@")[0]
        ci = (r["ci_low"], r["ci_high"]) if r.get("ci_low") is not None else None
        want = judge(r["measured"], ci, GOAL(gid), r.get("n")) if gid in bench.GOALS else (
            "yes" if r["measured"] else "no")
        assert r.get("verdict", want) == want


def test_time_shares_are_medians_over_repeats():
    from fastattn.lab.bench.decode import time_shares
    rows = [{"variant": "upstream", "wall_s": w, "lm_attention_s": a, "local_dit_s": 1.0}
            for w, a in ((10.0, 4.0), (20.0, 5.0), (12.0, 3.0))] + [{"variant": "patched", "wall_s": 1.0,
                                                                       "lm_attention_s": 0.5, "local_dit_s": 0.1}]
    s = time_shares({"rows": rows})
    assert s["lm_attention"] == 4.0 / 12.0 and s["local_dit"] == 1.0 / 12.0
    assert time_shares({"rows": rows}, "patched")["lm_attention"] == 0.5
