"""#293 diagnosed: per-component stream trends (a planted growing DiT cost is named), the consumer matrix, and the
ranked differential with its reply, fed real streams and synthetic records. The planted cost's direction and the
timer's overhead are timing outcomes: benchmarks (``-m timing``), outside ``make test``."""

from __future__ import annotations

import math
import time

import pytest
import torch

from fastattn.lab import bench
from fastattn.lab.bench.consumers import consumer_matrix, consumer_table
from fastattn.lab.bench.stream import COMPONENTS, component_table
from fastattn.lab.diagnosis import ASK, NEEDS, REPRODUCES, RULES_OUT, diagnosis, reply_293
from fastattn.models import build_voxcpm2

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)


@pytest.fixture(scope="module")
def planted():
    """A tiny-preset upstream stream whose local DiT spins 40 us per position: a cost that grows with the chunk."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the spin is one thread: keep the process's CPU/wall level along the stream
    try:
        m = build_voxcpm2("tiny")
        dit = m.feat_decoder.forward

        def slow(*a, **k):
            end = time.perf_counter() + 4e-5 * m.base_lm.kv_cache.current_length
            while time.perf_counter() < end:
                pass
            return dit(*a, **k)
        m.feat_decoder.forward = slow
        yield bench.stream_profile("tiny", 80, model=m, modes=("upstream",), repeats=2, components=True,
                                   progress=False)
    finally:
        torch.set_num_threads(threads)


def test_components_add_up_to_the_chunk(planted):
    rows = planted["rows"]
    assert all(set(r["components"]) == set(COMPONENTS) for r in rows)
    assert all(r["components"]["other"] >= 0 for r in rows), "named components are timed inside the chunk"
    assert all(r["components"]["dit"] > 0 and r["components"]["base_lm"] > 0 for r in rows if r["chunk"] > 0)
    assert planted["timer_overhead_us"] is not None


@pytest.mark.timing
def test_the_component_timer_costs_microseconds(planted):
    assert 0 < planted["timer_overhead_us"] < 50


@pytest.mark.timing
def test_a_planted_growing_dit_cost_is_named_and_the_lms_are_not(planted):
    t = planted["trend"]["upstream"]
    assert {"slope_ms_per_100", "ci", "verdict"} <= set(t["dit"])
    assert t["base_lm"]["verdict"] != "grows" and t["residual_lm"]["verdict"] != "grows"
    busy = t["disturbed"] or t["why"].startswith("the machine was busy")  # tests/lab/test_noise.py owns the busy case
    if t["dit"]["verdict"] != "grows" and busy:
        pytest.skip(f"other processes shared the cores ({t['disturbed']} disturbed chunks): {t['why']}")
    assert t["dit"]["verdict"] == "grows", t["dit"]
    rows = {r["component"]: r for r in component_table(planted)}
    assert rows["dit"]["verdict"] == "grows" and rows["dit"]["slope ms / 100 chunks"] > 0
    dx = diagnosis(planted)
    assert dx[0]["reading"] == REPRODUCES and "dit: grows" in dx[0]["measured here"]


@pytest.mark.slow
def test_consumer_matrix_fits_the_cost_per_accumulated_sample():
    rec = consumer_matrix(at=(1, 4, 8), repeats=1)
    patterns = {r["pattern"] for r in rec["rows"]}
    assert {"append, concatenate once", "concatenate every chunk", "WAV + base64 of the whole clip"} <= patterns
    s = rec["summary"]  # which pattern costs more is a measurement (notebook 02), never a test's assertion
    assert all(sum(r["pattern"] == p for r in rec["rows"]) == 3 for p in s)
    assert all(math.isfinite(v["us_per_ksample"]) and v["ms_first"] >= 0 for v in s.values())
    assert all(v["reproduces_293"] is False for v in s.values()), "no chunk 400 measured: never a claim"
    table = consumer_table(rec)
    assert len(table) == len(s) + len(rec["skipped"])
    real = consumer_matrix([torch.zeros(7680).numpy(), torch.ones(3840).numpy()], at=(1, 3), repeats=1)
    assert real["params"]["real_chunks"] == 2 and {r["samples"] for r in real["rows"]} == {7680, 7680 + 3840 + 7680}


def _stream(verdicts: dict, whole: str = "flat") -> dict:
    comp = {c: {"verdict": v, "slope_ms_per_100": 0.1, "ci": [-0.2, 0.3], "level_ms": 10.0, "why": ""}
            for c, v in verdicts.items()}
    return {"trend": {"upstream": {"verdict": whole, **comp}}, "verdict": {"upstream": f"{whole} (...)"},
            "env": {"device": "cpu"}}


def _consumers(reproduces: bool) -> dict:
    s = {"us_per_ksample": 0.4, "ms_first": 3.0, "ms_at_400": 1300.0 if reproduces else 40.0, "chunk_at_1s": 320,
         "reproduces_293": reproduces}
    return {"summary": {"resample the whole clip": s}, "skipped": {}}


def test_a_quiet_flat_stream_and_a_growing_caller_rank_the_caller_first():
    dx = diagnosis(_stream({c: "flat" for c in COMPONENTS}), _consumers(True))
    assert dx[0]["reading"] == REPRODUCES and dx[0]["hypothesis"].startswith("The caller reprocesses")
    assert dx[-1]["reading"] == RULES_OUT
    gen = next(r for r in dx if r["hypothesis"].startswith("A part of the generator"))
    assert gen["reading"] == RULES_OUT
    reply = reply_293(dx)
    assert "ruled out here" in reply and "reproduced here" in reply and "---" in reply  # English, then Chinese
    assert all(a in reply for a in ASK)


def test_nothing_is_claimed_from_an_inconclusive_stream():
    dx = diagnosis(_stream({c: "inconclusive" for c in COMPONENTS}, "inconclusive"), _consumers(False))
    assert not [r for r in dx if r["reading"] == REPRODUCES]
    assert {r["reading"] for r in dx if r["hypothesis"].startswith(("The full-cache", "A part"))} == {NEEDS}
    cuda = diagnosis(_stream({c: "flat" for c in COMPONENTS}), None, "cuda:0")
    assert any("gpu-check's stream_under_optimize" in r["measured here"] for r in cuda)


def test_prompt_growth_grows_the_prefix_until_the_cache_is_full():
    from fastattn.lab.bench.prompts import WAYS, prompt_growth, prompt_table
    rec = prompt_growth("tiny", calls=30, ways=WAYS[1:], max_length=256, steps=4)
    for mode in ("upstream", "exact"):
        for way in WAYS[1:]:
            ok = [r for r in rec["rows"] if r["mode"] == mode and r["way"] == way and r["error"] is None]
            assert [r["prefix"] for r in ok] == sorted({r["prefix"] for r in ok}), "the prefix grows every call"
            assert rec["full_at"][mode][way] == len(ok) < 30
    errors = {r["mode"]: r["error"] for r in rec["rows"] if r["error"]}
    assert errors["exact"] == "KV cache is full", "the patched cache names the limit"
    assert len(prompt_table(rec)) == 4
    row = next(r for r in diagnosis(_stream({c: "flat" for c in COMPONENTS}), None, "cpu", rec)
               if r["hypothesis"].startswith("A prompt that grows"))
    assert row["reading"] in (REPRODUCES, NEEDS, RULES_OUT) and "cache full at call" in row["measured here"]


@pytest.mark.parametrize("last_ms,full,want", [(10.0, 17, NEEDS), (10.0, None, RULES_OUT), (13.0, 17, REPRODUCES),
                                               (5.0, 17, RULES_OUT)])
def test_a_prompt_growth_cut_off_by_a_full_cache_is_not_ruled_out(last_ms, full, want):
    """2.5x by the call where the cache filled: where it would have stopped is unseen, so not ruled out."""
    rows = [{"mode": "upstream", "way": "merge", "error": None, "prefix": 79 + 25 * i, "first_ms": ms}
            for i, ms in enumerate((4.0, 6.0, last_ms))]
    rec = {"params": {"ways": ["merge"]}, "rows": rows, "full_at": {"upstream": {"merge": full}}}
    row = next(r for r in diagnosis(_stream({c: "flat" for c in COMPONENTS}), None, "cpu", rec)
               if r["hypothesis"].startswith("A prompt that grows"))
    assert row["reading"] == want, row


def test_the_diagnosis_figures_draw(planted):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastattn.lab import plots
    for fig in (plots.stream_components(planted), plots.stream(planted),
                plots.consumers(consumer_matrix(at=(1, 2, 3), repeats=1))):
        assert fig.axes[0].get_lines()
        plt.close(fig)


def test_a_consumer_thread_beside_the_generator_is_timed_and_reported():
    from fastattn.lab.bench.consumers import consumer_contention
    rec = consumer_contention("tiny", 12, repeats=1)
    assert {(r["beside"], r["repeat"]) for r in rec["rows"]} == {(False, 0), (True, 0)}
    assert len(rec["consumer_ms"]) == 12 and rec["ratio"] > 0
    row = next(r for r in diagnosis(_stream({c: "flat" for c in COMPONENTS}), _consumers(True), "cpu", None, rec)
               if r["hypothesis"].startswith("The caller"))
    assert "in a thread beside the generator" in row["measured here"]


@pytest.mark.slow
def test_compile_counts_show_a_specialised_length_recompiling():
    """#293's recompile hypothesis on CPU: upstream compiles once; a slice length that reaches the graph as a Python
    int is specialised on, so the graphs grow with the steps (to dynamo's limit); the record feeds the differential.
    Dynamo decides the recompiles, so the eager backend counts the same graphs without inductor's code generation."""
    from fastattn.lab.bench.lm import compile_counts
    rec = compile_counts(12, backend="eager")
    by = {r["variant"]: r for r in rec["rows"]}
    assert by["upstream"]["unique_graphs"] == 1 and by["upstream"]["graph_breaks"] == 0
    assert by["slice fix, length a Python int"]["unique_graphs"] > 2
    row = next(r for r in diagnosis(_stream({c: "flat" for c in COMPONENTS}), compiles=rec)
               if r["hypothesis"].startswith("CUDA graphs"))
    assert "graphs compiled: upstream 1" in row["measured here"]


def test_an_unknown_consumer_pattern_is_refused_by_name():
    from fastattn.lab.bench.consumers import consumer_contention
    with pytest.raises(ValueError, match="pattern must be one of .*got 'mp3'"):
        consumer_contention("tiny", 4, pattern="mp3")


def test_a_generator_that_raises_still_ends_the_consumer_thread():
    import threading

    from fastattn.lab.bench.consumers import _timed_beside

    def gen():
        yield torch.zeros(8)
        raise OSError("stream cut")
    before = threading.active_count()
    with pytest.raises(OSError, match="stream cut"):
        _timed_beside(gen(), lambda prev, clip, chunk, sr: None, 48000, [])
    assert threading.active_count() == before


def test_a_failing_consumer_thread_is_an_error_not_a_silent_gap():
    from fastattn.lab.bench.consumers import _timed_beside

    def broken(prev, clip, chunk, sr):
        raise ValueError("codec gone")
    with pytest.raises(RuntimeError, match="consumer thread failed.*codec gone"):
        _timed_beside(iter([torch.zeros(8)] * 3), broken, 48000, [])
