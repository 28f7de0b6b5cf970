"""The upstream PRs, the #395 comment and the #293 reply: written from the records, current, in upstream's words."""

import re

import pytest

from fastattn.lab.paths import data_dir
from tools import prs

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

PRIVATE = re.compile(r"fastattn|workbook|seed 000|make workbook|0\d_[a-z_]+|gpu-check|\bbench\.|calibrate_exact|"
                     r"exactness_calibration|RightSizedKVCache|patch_voxcpm|\d+threads-torch|\bkits?\b", re.I)


@pytest.fixture(scope="module")
def docs():
    return prs.documents()


def test_prs_are_short_and_speak_upstreams_language(docs):
    for name, text in docs.items():
        assert not PRIVATE.search(text.replace(prs.REPO, "")), (name, PRIVATE.search(text.replace(prs.REPO, "")))
        if name[0].isdigit():
            assert len(text.splitlines()) <= 75, (name, len(text.splitlines()))


def test_each_pr_states_its_numbers(docs):
    rows = prs.machine_rows()
    ref = next(r for r in rows if r["reference"])
    right = docs["1-right-sized-decode.md"]
    assert f"{ref['kv_mb'][0]:.0f} MB -> {ref['kv_mb'][1]:.0f} MB" in right and prs._whole_cell(ref) in right
    assert all(f"| {r['torch']} |" in right for r in prs._matrix()) and len(prs._matrix()) >= 4
    assert {"2.5.1", "2.15.0"} <= {r["torch"] for r in prs._matrix()}
    dtype = docs["2-cpu-dtype.md"]
    assert "float32's step is slower than the default's" in dtype and "*may* be faster" in dtype
    assert "held until it has GPU numbers" in docs["3-live-decode-attention.md"]
    for name in ("1-right-sized-decode.md", "2-cpu-dtype.md", "3-live-decode-attention.md"):
        text = docs[name]
        assert all(f"#{n}" in text for n in (199, 395, 325, 363)), name
        assert prs.upstream_check()["commits"]["main"][:7] in text and "#293" in text, name
        assert re.search(r"not (offered as )?a fix for #293|#293's slowdown reproduced here", text), name


def test_the_395_comment_separates_what_ran_from_what_was_read(docs):
    text = docs["comment-395.md"]
    assert "**What we ran** (CPU only)" in text and "**What we only read, not ran**" in text
    assert all(f"| {r['torch']} |" in text for r in prs._matrix())


def test_the_293_reply_is_bilingual_answers_the_fix_and_names_the_gpu_leads(docs):
    text = docs["reply-293.md"]
    en, zh = text.split("\n---\n")
    assert len(re.findall(r"[\u4e00-\u9fff]", zh)) > 300 and "#395" in en and "#395" in zh and "#199" in en
    leads = re.findall(r"^\d+\. (\w+ \w+)", en, re.M)
    # what reproduced here first (the caller re-encoding the clip), then the leads only a GPU decides
    assert leads[:3] == ["The caller", "CUDA graphs", "Memory pressure"] and "The full" in leads[3:]
    assert re.search(r"^1\. The caller[^\n]*: reproduced here: ", en, re.M)
    assert "2.0.2" in en and "75cfa3e" in en and "retry on 2.0.3" in en and "2.0.3 上用上面的代码重试" in zh
    assert "empty_cache" in en and "empty_cache" in zh and "random weights" in en and "```python" in en
    assert "torch and voxcpm versions" not in text  # the post gives voxcpm's


def test_reply_for_293_reads_a_runs_stream_without_trends(tmp_path):
    """A run whose stream was timed whole (no components, no trend) still gets a reply, saying so."""
    import json
    import shutil

    from fastattn.lab.report import reply_for_293
    records = tmp_path / "01_root_cause" / "records"
    records.mkdir(parents=True)
    whole = data_dir() / "results" / "cpu-epyc-avx512-2threads-torch2.13.0" / "stream_profile_full.json"  # no parts
    shutil.copy(whole, records / "stream.json")
    reply = reply_for_293(tmp_path)
    assert "each chunk timed whole (not split into parts)" in reply and "按整个 chunk 计时" in reply
    assert json.loads((records / "stream.json").read_text())["kind"] == "stream_profile"
    assert reply_for_293(tmp_path / "nothing") is None


def test_the_bench_rehearsal_line_follows_its_records(monkeypatch):
    """Each PR's "Check it" section says what its bench command gave on main here, per switch, from the record."""
    def run(switch, equal, dtypes=("bfloat16", "bfloat16"), rc=0):
        return {"switch": switch, "equal": equal, "dtypes": list(dtypes), "returncode": rc}
    u = {"commits": {"main": "616d3d3e"}, "bench": {
        "cpu-dtype": [run({}, True), run({"VOXCPM_CPU_DTYPE": "float32"}, False, ("bfloat16", "float32"))],
        "right-sized": [run({}, None, rc=1)]}}
    monkeypatch.setattr(prs, "upstream_check", lambda: u)
    line = prs._bench_rehearsal("cpu-dtype")
    assert "main 616d3d3 against main with this diff alone: by default the waveforms were identical (`yes`); with " \
           "`VOXCPM_CPU_DTYPE=float32` the waveforms were different (`no`), the PR running float32." in line
    assert "the bench failed (exit status 1)" in prs._bench_rehearsal("right-sized")
    assert prs._bench_rehearsal("decode-attention") == "Not yet rehearsed on main here."


def test_the_script_line_follows_its_records(monkeypatch):
    """PR 2's line on upstream's check script: each run from the record, main's own script with the switch set last."""
    def run(switch, changed, rc, tail):
        return {"script": "scripts/x.py", "switch": switch, "script_changed": changed, "returncode": rc, "tail": tail}
    sw = {"VOXCPM_CPU_DTYPE": "float32"}
    u = {"commits": {"main": "616d3d3e"},
         "scripts": {"cpu-dtype": [run({}, True, 0, "5/5 passed"), run(sw, True, 0, "5/5 passed"),
                                   run(sw, False, 1, "4/5 passed")]}}
    monkeypatch.setattr(prs, "upstream_check", lambda: u)
    line = prs._script_line("cpu-dtype")
    assert "by default: 5/5 passed (exit status 0); with `VOXCPM_CPU_DTYPE=float32`: 5/5 passed (exit status 0); " \
           "with the script left as it is on main and `VOXCPM_CPU_DTYPE=float32` set: 4/5 passed (exit status 1)." \
           in line
    u["scripts"] = {}
    assert prs._script_line("cpu-dtype") == "Upstream's check scripts were not run here."


def test_the_landing_page_derives_05s_findings_and_01s_streams_and_293s_readings_again():
    """What a notebook printed when it ran is shown as it printed it, except what this code derives again from the
    records: 05's findings, 01's stream verdicts and #293's readings. A stale label (an old key, a stale value) never
    sits beside verdicts judged anew."""
    import json

    from fastattn.lab.bench.records import load_run
    from fastattn.lab.bench.targets import TARGETS_MET, met_count, run_targets
    from fastattn.lab.report import report_texts
    ref = data_dir() / "results" / "cpu-xeon-amx-2threads-torch2.13.0"
    summary = json.loads((ref / "summary.json").read_text())
    for nb in summary["notebooks"]:
        if nb["name"].startswith("05_"):
            nb["findings"][TARGETS_MET] = "99/99"
            nb["findings"]["fast at p=4096, fp32, K/V stale label: x DRAM floor"] = 1.0
        if nb["name"].startswith("01_"):
            nb["findings"]["#293: ruled out here"] = "a stale reading"
            key = next(k for k in nb["findings"] if k.startswith("stream, upstream: per-chunk cost"))
            nb["findings"][key] = "a stale stream verdict"
        if nb["name"].startswith("03_"):
            nb["findings"]["a finding as 03 printed it"] = "kept as printed"
    texts = report_texts(ref, summary)
    for name in ("summary.md", "index.html"):
        for stale in ("99/99", "a stale reading", "K/V stale label", "a stale stream verdict"):
            assert stale not in texts[name], (name, stale)
        assert met_count(run_targets(load_run(ref))) in texts[name] and "kept as printed" in texts[name]
        assert "as each notebook printed them when it ran" in texts[name]
