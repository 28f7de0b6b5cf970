"""One source for every number: each headline figure that README, docs/results.md, the hardware matrix and the
targets print is the one function of bench.metrics applied to the committed reference records."""

import pytest

from fastattn.lab.bench import metrics
from fastattn.lab.bench.records import load_run
from fastattn.lab.paths import data_dir
from tools import readme, sources
from tools.compare import compare

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

REF = data_dir() / "results" / sources.REFERENCE


@pytest.fixture(scope="module")
def run():
    return load_run(REF)


def test_every_headline_is_printed_as_its_function_gives_it(run):
    figures = metrics.headlines(run)
    assert len(figures) >= 6, "the reference run holds the headline records"
    results = readme.current_block(readme._results_md())
    matrix = {r["measure"]: r for r in compare([REF])["rows"]}
    col = compare([REF])["machines"][0]
    for name, fig in figures.items():
        assert f"| {name} | {fig.text()} |" in results, name
        assert matrix[name][col] == fig.text(), name


def test_readme_quotes_the_same_functions(run):
    block = readme.current_block()
    for name in ("exact / reference, one call, p=256, fp32", "patched / upstream, decode step, p=256, bf16"):
        assert metrics.HEADLINES[name](run).text() in block, name
    assert metrics.whole_ratio(sources.records(REF)["whole"]).text() in block


def test_the_targets_record_is_the_metrics_of_its_records(run):
    r = sources.records(REF)
    t = {x["id"]: x for x in r["targets"]["rows"]}
    dec16 = run.get("decode_step", dtype="bfloat16")
    pairs = {"exact_p256": metrics.call_ratio(r["att32"], "exact", "reference"),
             "fast_p256": metrics.call_ratio(r["att32"], "fast", "reference"),
             "decode_bf16": metrics.step_ratio(dec16), "decode_fp32": metrics.step_ratio(r["dec32"])}
    for gid, fig in pairs.items():
        assert t[gid]["measured"] == pytest.approx(fig.value, rel=1e-12), gid
        if t[gid].get("ci_low") is not None:
            assert (t[gid]["ci_low"], t[gid]["ci_high"]) == pytest.approx(fig.ci, rel=1e-12), gid


def test_the_attention_share_explains_the_step_ratio():
    """Two machines' decode-step rows as the committed records hold them: the share of upstream's layer time its
    attention call takes, beside the patched / upstream step (76% -> 0.36x; 22% -> 0.75x)."""
    from fastattn.lab.bench.metrics import attention_share, attention_share_line

    def rec(attn, layer, patched):
        rows = [{"variant": v, "position": 256, "median_ms": ms * 4, "per_layer_ms": ms, "n": 9,
                 "samples_ms": [ms * 4 * (1 + 0.001 * i) for i in range(9)], "attention_in_step_ms": a}
                for v, ms, a in (("upstream", layer, attn), ("patched", patched, 0.1))]
        return {"rows": rows, "params": {"positions": [0, 256], "dtype": "bfloat16"}}
    epyc, amx = attention_share(rec(16.4, 21.7, 7.85), 256), attention_share(rec(1.71, 7.71, 5.8), 256)
    assert round(epyc["share"], 2) == 0.76 and round(amx["share"], 2) == 0.22
    assert epyc["ratio"] < amx["ratio"]  # the larger the attention's share, the more the patch removes
    line = attention_share_line(rec(1.71, 7.71, 5.8))
    assert "(22%)" in line and "0.75x" in line
    assert "did not time" in attention_share_line({"rows": [], "params": {"positions": [256], "dtype": "bfloat16"}})


def test_a_run_reads_the_latest_save_of_a_record_first(tmp_path):
    """A cell run again in JupyterLab saves ``x-2``, ``x-3`` beside ``x`` (save_record never overwrites): a run's
    ``get`` and 05's findings read the latest save, ``-10`` after ``-9`` included."""
    from fastattn.lab.bench.records import load_run, record, save_record
    for i in range(1, 11):
        save_record(record("attention", env={"device": "cpu"}, params={"dtype": "float32"}, rows=[{"i": i}]),
                    tmp_path / "records", "attention_float32")
    run = load_run(tmp_path)
    assert run.get("attention", dtype="float32")["rows"] == [{"i": 10}]
    assert [r["rows"][0]["i"] for r in run.all("attention")] == list(range(10, 0, -1))
