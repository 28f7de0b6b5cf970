"""tools.compare: the hardware matrix across record folders."""

import pytest

from fastattn.lab import bench
from tools.compare import compare, compare_html, compare_markdown

BW = {"gb_per_s": 10.0, "llc_bytes": 1 << 20}


def test_compare_two_record_folders(tmp_path):
    """A hardware matrix: one column per machine; a measure one machine lacks shows "not measured"."""
    a, b = tmp_path / "a", tmp_path / "b"
    att = bench.attention_sweep([256], capacity=8192, hq=2, hkv=1, head_dim=16, repeats=1, warmup=0, bw=BW,
                                progress=False)
    bench.save_record(att, a, "attention_float32")
    bench.save_record(att, b, "attention_float32")
    bench.save_record(bench.kv_memory("full"), b, "kv_memory_full")
    m = compare([a, b])
    assert len(m["machines"]) == 2
    kv = next(r for r in m["rows"] if r["measure"].startswith("KV of a 300-token"))
    assert kv[m["machines"][0]] == "not measured" and "MB" in kv[m["machines"][1]]
    ex = next(r for r in m["rows"] if r["measure"] == "exact / reference, one call, p=256, fp32")
    assert ex[m["machines"][0]].endswith("x")
    md = compare_markdown(m)
    assert md.startswith("| measure |") and "not measured" in md
    assert "<table>" in compare_html(m)
    with pytest.raises(ValueError, match="holds no fastattn records"):
        compare([tmp_path / "a" / ".."])  # a folder of folders, no records at its top or in */records
