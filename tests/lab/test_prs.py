"""The upstream PRs (the bench first), the #395 comment and the #293 reply: written from the records, current,
within their word budgets, runnable without this repository, in upstream's words."""

import re

import pytest

from fastattn.lab.paths import data_dir
from tools import prs

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

PRIVATE = re.compile(r"fastattn|workbook|seed 000|make workbook|0\d_[a-z_]+|gpu-check|\bbench\.(?!json\b)|"
                     r"calibrate_exact|exactness_calibration|RightSizedKVCache|patch_voxcpm|\d+threads-torch|"
                     r"\bkits?\b|data/|record kind|\.diff\b", re.I)
BENCH = "scripts/voxcpm_decode_bench.py"  # its path in upstream's repository, once the bench PR is merged


@pytest.fixture(scope="module")
def docs():
    return prs.documents()


def _languages(reply: str) -> tuple:
    en, zh = reply.split("\n---\n")
    return en, zh


def test_texts_speak_upstreams_language_and_carry_no_placeholder(docs):
    assert set(prs.BUDGETS) == set(docs)
    for name, text in docs.items():
        assert not PRIVATE.search(text), (name, PRIVATE.search(text))
        assert not any(p in text for p in prs.PLACEHOLDERS), name
        if name[0].isdigit():
            assert len(text.splitlines()) <= 60, (name, len(text.splitlines()))


def test_each_text_holds_its_word_budget(docs):
    """PR 1: 500 words, PR 2: 350, the reply: 400 per language; the bench PR, PR 3 and the #395 comment: their own."""
    assert prs.BUDGETS["1-right-sized-decode.md"] == 500 and prs.BUDGETS["2-cpu-dtype.md"] == 350
    assert prs.BUDGETS["reply-293.md"] == 400
    for name, text in docs.items():
        parts = _languages(text) if name == "reply-293.md" else (text,)
        for part in parts:
            assert prs.words(part) <= prs.BUDGETS[name], (name, prs.words(part))


def test_words_counts_what_a_reader_counts():
    assert prs.words("| a | b-c |\n|---|---|\n| `x=1` | 2 |") == 4
    assert prs.words("感谢您详细的分析") == 4 and prs.words("torch 2.13 上运行") == 4


def test_the_fix_prs_are_checked_with_the_bench_pr(docs):
    """PR 1-3 name the bench by its upstream path, with the bench PR applied, and check out their own branch."""
    assert docs["0-decode-bench.md"].startswith(f"# `{BENCH}`") and "#158" in docs["0-decode-bench.md"]
    for name in ("1-right-sized-decode.md", "2-cpu-dtype.md", "3-live-decode-attention.md"):
        text = docs[name]
        assert ("the bench PR applied" in text or "the bench PR's" in text) and BENCH in text, name
        assert "git apply" not in text, name
    assert "checked out in `../voxcpm-pr`" in docs["1-right-sized-decode.md"]


def test_each_pr_states_its_numbers(docs):
    rows = prs.machine_rows()
    ref = next(r for r in rows if r["reference"])
    right = docs["1-right-sized-decode.md"]
    assert f"{ref['kv_mb'][0]:.0f} MB -> {ref['kv_mb'][1]:.0f} MB" in right and prs._whole_cell(ref) in right
    assert prs._exact_versions() in right and prs.math_versions() in right
    assert {"2.9.1", "2.15.0"} <= set(re.findall(r"\d\.\d+\.\d", prs._exact_versions()))
    for missing in ("the real checkpoint on CPU across 512 tokens", "CUDA under `optimize()`", "more than 2 cores"):
        assert missing in right, missing
    dtype = docs["2-cpu-dtype.md"]
    assert "every float32 decode was slower" in dtype and "*may* be faster" in dtype and "float16` is refused" in dtype
    assert "right-sized" not in dtype.lower() and "95% CI" not in dtype  # nothing that rests on PR 1; no step CIs
    assert "adjusted dtype bfloat16 -> float32 for device cpu" in dtype
    live = docs["3-live-decode-attention.md"]
    assert "held until it has GPU numbers" in live and "fullgraph=True` on CPU" in live.splitlines()[0]
    assert "under `optimize()` too" not in live and "ms at 0 |" in live and "not a fix for #293" in live
    main = prs.upstream_check()["commits"]["main"][:7]
    for name in ("0-decode-bench.md", "1-right-sized-decode.md", "2-cpu-dtype.md", "3-live-decode-attention.md"):
        assert main in docs[name] and "Applies alone and stacked with the other three PRs" in docs[name], name
    assert "#395" in right and "#395" in live and "#325" in live and "#363" in live


def test_the_kits_comment_names_the_torch_versions_the_records_checked():
    """The right-sized cache's comment names the torch versions its 512-key argument was checked on: the matrix's."""
    from fastattn.lab.upstream import cache_source
    named = re.search(r"on CPU with torch ([\d., and]+?);", cache_source().replace("\n# ", " "))
    assert named and named[1].replace(",", "").split() == prs._exact_versions().replace(",", "").split()


def test_the_395_comment_separates_what_ran_from_what_was_read(docs):
    text = docs["comment-395.md"]
    assert "**What we ran** (CPU only)" in text and "**What we only read, not ran**" in text
    assert "| 2.5.1 |" not in text and prs._slice()[0] in text  # the error table is one sentence
    assert f"{prs._gate_layers()} times a step" in text and "current_length - 1" in text


def test_the_293_reply_answers_the_fix_first_then_the_cheapest_tests(docs):
    en, zh = _languages(docs["reply-293.md"])
    assert len(re.findall(r"[\u4e00-\u9fff]", zh)) > 300 and "#395" in en and "#395" in zh and "#199" in en
    fix = en.split("**Your fix.**")[1].split("\n\n")[0]
    assert en.index("**Your fix.**") < en.index("**The cheapest tests") < en.index("**The leads")
    assert len(re.findall(r"[.!?](?:\s|$)", fix.strip())) == 2, fix  # two sentences
    tests = en.split("**The cheapest tests")[1].split("**The leads")[0]
    assert "optimize=False" in tests and "TORCH_LOGS=recompiles,cudagraphs" in tests and "empty_cache()" in tests
    leads = en.split("**The leads:**")[1].split("\n\n")[0]
    assert re.search(r"^1\. [^\n]*not your slowdown", leads, re.M) and "2 CPU threads, 4 LM layers" in leads
    assert re.search(r"^\d\. Does your prompt grow[^\n]*\?", leads, re.M)  # lead 4 became a question
    assert "ruled out here (CPU, random weights)" in leads and leads.count("+2.78") <= 1
    assert "2.0.2" in en and "75cfa3e" in en and "across calls, not one within a call" in en
    assert "2.0.3 上重试" in zh and "empty_cache" in zh and "TORCH_LOGS" in zh and "```python" in en
    assert "linked PRs" not in en and "相关 PR" not in zh and "2.8.0, 2.9.1" not in en  # no version list


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
    assert "upstream's whole chunk" in reply and "---" in reply and "**Your fix.**" in reply
    assert json.loads((records / "stream.json").read_text())["kind"] == "stream_profile"
    assert reply_for_293(tmp_path / "nothing") is None


def test_the_bench_rehearsal_line_follows_its_records(monkeypatch):
    """The bench PR says what each fix PR's bench command gave on main here, per switch, from the record."""
    def run(switch, equal, rc=0):
        return {"switch": switch, "equal": equal, "returncode": rc, "wall_s": 60.0}
    u = {"commits": {"main": "616d3d3e"}, "bench": {
        "cpu-dtype": [run({}, True), run({"VOXCPM_CPU_DTYPE": "float32"}, False)],
        "right-sized": [run({}, True)], "decode-attention": [run({}, None, rc=1)]}}
    monkeypatch.setattr(prs, "upstream_check", lambda: u)
    line = prs._bench_rehearsal()
    assert "main 616d3d3 against each of the three decode PRs gave identical waveforms in 2 of 2 runs" in line
    assert "different ones in 1 of 1 with them set" in line and "decode-attention by default (exit status 1)" in line
    u["bench"] = {}
    assert prs._bench_rehearsal() == "It has not been run against the three decode PRs here yet."


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
    assert "On main 616d3d3 with this PR: by default 5/5 passed; with `VOXCPM_CPU_DTYPE=float32` 5/5 passed; main's " \
           "unchanged script with `VOXCPM_CPU_DTYPE=float32` set: 4/5 passed." in line
    u["scripts"] = {}
    assert prs._script_line("cpu-dtype") == "Upstream's check scripts were not run here."


def test_pr1_says_the_programs_measurement_is_missing_without_its_record(monkeypatch):
    """PR 1's sentence on upstream's CLI and a streaming service comes from a ``wrapped_programs`` record; without
    one it says the measurement is missing, with no figure."""
    monkeypatch.setattr(prs, "machines_with", lambda results, kind, **k: [])
    line = prs._programs_line()
    assert line.startswith("Not measured yet") and not re.search(r"\d", line)


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
