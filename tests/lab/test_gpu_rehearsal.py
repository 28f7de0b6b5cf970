"""The GPU run, rehearsed on CPU: every record consumer fed records shaped like three GPU runs
(``tests/gpu_shapes.py``: torch's CUDA selection rules, no exact window, no last-level cache size).

Nothing may crash, and every verdict must be the right one for that GPU: kernel claims in voxcpm's dtype
(bf16), slice-fix claims from the slice fix's own rows, CPU-only claims "not measurable here", memory targets
"not applicable" where the patched cache keeps every slot.
"""

import pytest

from fastattn.backends import SDPAReport
from fastattn.lab import profiling
from fastattn.lab.bench.records import find_row
from fastattn.lab.bench.targets import met_count
from fastattn.lab.claims import FAILS, HOLDS, NOT_HERE, NOT_RUN, claims_ledger
from fastattn.lab.experiments import backend_selection

from ..gpu_shapes import PROFILES, REF, gpu_records, write_reference_folder, write_run_folder

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

#: per profile: the bf16 masked call's kernel verdict words, the bf16 slice's flash verdict
EXPECT = {"a100-torch2.13": ("caused by GQA", HOLDS), "h200-cudnn9.19-torch2.13": ("fused kernel", FAILS),
          "a100-torch2.14": ("fused kernel", HOLDS)}


@pytest.fixture(scope="module", params=sorted(PROFILES))
def gpu(request, tmp_path_factory):
    recs = gpu_records(request.param)
    base = tmp_path_factory.mktemp(request.param)
    return request.param, recs, write_reference_folder(recs, base / "ref"), write_run_folder(recs, base / "run")


def test_targets_judge_what_applies_and_count_only_that(gpu):
    _, recs, _, _ = gpu
    rows = {t["id"]: t for t in recs["targets"]["rows"]}
    for gid in ("kv_bytes", "growth_time", "growth_moves", "capacity_bound"):
        assert rows[gid]["passed"] is None and rows[gid]["note"].startswith("not applicable here")
    assert rows["exact_p256"]["measured"] == pytest.approx(1.0)  # the same call: no saving, honestly a miss
    assert rows["exact_p256"]["passed"] is False
    verdicts = [t["verdict"] for t in rows.values() if t["verdict"] is not None]
    undecided = verdicts.count("undecided")
    assert met_count(recs["targets"]["rows"]) == f"{verdicts.count('yes')}/{len(verdicts) - undecided}" + (
        f", {undecided} undecided" if undecided else "")
    assert "last-level cache size is unknown" in rows["fast_floor_far"]["note"]


def test_claims_ledger_verdicts_are_the_gpus(gpu):
    profile, _, _, run = gpu
    ledger = {r["claim"]: r for r in claims_ledger(run)}
    assert not [r for r in ledger.values() if "could not read" in r["evidence"]]
    why, flash = EXPECT[profile]
    mask = ledger["A bool attn_mask makes SDPA fall back to the math kernel"]
    assert mask["verdict"] == FAILS and why in mask["evidence"] and mask["evidence"].startswith("bfloat16")
    assert ledger["Slicing the cache to position+1 lets SDPA use flash attention"]["verdict"] == flash
    assert "the slice fix" in ledger["2.5-3.5x faster per position"]["evidence"]
    assert "slice fix" in ledger["After the fix a step costs O(position), not O(max_length)"]["evidence"]
    assert ledger["~36% faster end to end"]["verdict"] == NOT_RUN
    assert ledger["On CPU the zero-fill is only ~0.1-0.2 s of a ~50 s request"]["verdict"] == NOT_HERE
    assert ledger["KV allocation ~605 MB -> ~20-38 MB per request (fp32)"]["verdict"] == NOT_HERE


def test_02s_findings_agree_with_the_ledger(gpu):
    profile, recs, _, _ = gpu
    rows = recs["backend_matrix"]["rows"]
    up = find_row(rows, case="upstream: bool mask over full cache + GQA", dtype="bfloat16", head_dim=128)
    sl = find_row(rows, case="fast: slice to length, no mask", dtype="bfloat16", head_dim=128)
    fast_rec = {"rows": [{"class": "bfloat16, keys>2048", "candidate": "sdpa_slice", "winner": True}]}
    f = backend_selection.findings(rows, "cuda", SDPAReport.from_dict(up["report"]),
                                   SDPAReport.from_dict(sl["report"]), True, fast_rec)
    assert f["dtype of these findings (voxcpm's on this device)"] == "bfloat16"
    assert f["kernel op that ran for upstream's masked call"] == up["kernel"]
    assert f["bool mask forces the math kernel here"] is False and EXPECT[profile][0] in f["why (the matrix's rows)"]


def test_05s_readings_do_not_divide_by_a_saving_that_is_not_there(gpu):
    from fastattn.lab.bench.records import load_run
    _, recs, _, run = gpu
    att = {"float32": recs["attention_float32"], "bfloat16": recs["attention_bfloat16"]}
    dec = {"bfloat16": recs["decode_step_bfloat16"], "float32": recs["decode_step_float32"]}
    r = profiling.step_vs_call(dec["float32"], att["float32"], recs["attention_float32_cold"], 256)
    assert r["step saving / rotated call saving"] is None and "upstream's own call" in r["note"]
    assert all(row["floor binds (K/V > LLC)"] is None for row in profiling.fast_table(att, [256, 4096]))
    assert profiling.patched_steps_identical(dec)
    assert "upstream's computation" in profiling.amdahl_line(recs["whole_decode_full"])
    growth = profiling.growth_table({8000: recs["cache_growth_full"]})
    assert growth[0]["right-sized here"] is False and growth[0]["moves"] == 0
    mem = profiling.memory_summary(recs["kv_memory_full"], recs["step_allocations"], recs["peak_rss_small"])
    assert mem["patched KV right-sized on this device"] is False
    h = profiling.headline(att, dec, recs["whole_decode_full"], recs["targets"]["rows"], position=256)
    assert h["targets met"] == met_count(recs["targets"]["rows"])
    found = profiling.findings(load_run(run))  # what 05 prints and the report derives again, from the records
    assert found["decode step fp32 saving per layer / rotated call saving"] is None
    assert found["bf16 instructions on this CPU"].startswith("n/a") and set(profiling.headline_key(found)) <= set(found)


def test_index_summary_compare_and_readme_findings(gpu):
    from fastattn.lab.report import write_report
    from tools import readme
    from tools.compare import compare
    profile, _, ref, run = gpu
    index, summary = write_report(run, {"status": "ok", "notebooks": [], "environment": {"device": "cuda"}})
    md = summary.read_text()
    assert "n/a" in md and "could not read" not in md and "could not read" not in index.read_text()
    matrix = compare([REF, ref])
    gpu_col = matrix["machines"][1]
    assert find_row(matrix["rows"], measure="exact granularity, float32")[gpu_col] == "None"
    text = readme.reference_findings(ref)
    assert "No key window is exact by construction" in text and "512-key block" not in text
    assert PROFILES[profile][0] in text and "this GPU" in text and "this CPU" not in text
    assert EXPECT[profile][0] in text
