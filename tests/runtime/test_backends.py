"""explain_sdpa / backend_matrix / doctor: proof of which kernel runs, from the running torch."""

import json
import subprocess
import sys

import pytest
import torch

from fastattn.backends import SDPAReport, backend_matrix, decode_inputs, explain_sdpa
from fastattn.lab.doctor import doctor, format_doctor

from ..conftest import cuda

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

CPU_FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


def decode_call(cap=1024, p=100, dtype=torch.float32, device="cpu"):
    q, k, v = decode_inputs(device, dtype, capacity=cap)
    return q, k, v, (torch.arange(cap, device=device) <= p).view(1, 1, 1, -1)


def test_upstream_masked_call_on_cpu_runs_flash_and_where():
    q, k, v, m = decode_call()
    r = explain_sdpa(q, k, v, attn_mask=m, enable_gqa=True)
    assert r.backend == "FLASH_ATTENTION"
    assert r.kernel == CPU_FLASH and "aten::where" in r.ops
    assert MATH not in r.ops  # the bool mask does NOT force the math kernel on CPU
    assert r.forced["MATH"]["ran"] and r.forced["MATH"]["kernel"] == MATH
    assert r.forced["FLASH_ATTENTION"]["kernel"] == CPU_FLASH
    assert set(r.eligibility) == {"FLASH_ATTENTION", "MATH"}
    assert "FLASH_ATTENTION" in str(r) and "<table>" in r._repr_html_()


def test_sliced_call_needs_no_where():
    q, k, v, _ = decode_call()
    r = explain_sdpa(q, k[:, :, :101], v[:, :, :101], enable_gqa=True)
    assert r.kernel == CPU_FLASH and "aten::where" not in r.ops


def test_forcing_a_backend_the_device_lacks_reports_the_error():
    q, k, v, m = decode_call()
    from fastattn import backends as B
    sdpa = torch.nn.functional.scaled_dot_product_attention
    r = B._forced("EFFICIENT_ATTENTION", lambda: sdpa(q, k, v, attn_mask=m, enable_gqa=True))
    if torch.cuda.is_available():
        pytest.skip("CUDA has an efficient kernel")
    assert r["ran"] is False and "RuntimeError" in r["error"]


def test_report_json_roundtrip():
    q, k, v, m = decode_call()
    r = explain_sdpa(q, k, v, attn_mask=m, enable_gqa=True)
    d = json.loads(json.dumps(r.to_dict()))
    r2 = SDPAReport.from_dict(d)
    assert r2 == r and r2.kernel == r.kernel


def test_bad_input():
    q, k, v, m = decode_call()
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        explain_sdpa(q.numpy(), k, v)
    with pytest.raises(ValueError, match="4-D"):
        explain_sdpa(q[0], k, v)
    with pytest.raises(TypeError, match="attn_mask must be"):
        explain_sdpa(q, k, v, attn_mask=[1, 2])
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="one device"):
            explain_sdpa(q.cuda(), k, v)
    else:
        with pytest.raises(ValueError, match="one device"):
            explain_sdpa(q.to("meta"), k, v)


def test_backend_matrix_cpu_matches_research():
    rows = backend_matrix("cpu", torch.float32, capacity=1024, position=100)
    by = {r["case"]: r for r in rows}
    up = by["upstream: bool mask over full cache + GQA"]
    assert up["kernel"] == CPU_FLASH and "aten::where" in up["helpers"] and up["correct"]
    assert by["fast: slice to length, no mask"]["helpers"] == [] and by["fast: slice to length, no mask"]["correct"]
    exact = next(r for c, r in by.items() if c.startswith("exact: window"))
    assert exact["correct"] and exact["keys"] in (512, 1024)  # the calibrated window (512), or the whole cache
    causal = by["is_causal=True with Lq=1 (top-left aligned)"]
    assert not causal["correct"] and causal["max_abs_err"] > 0.1  # attends to key 0 only: wrong
    assert any("head_dim 512" in c for c in by)
    json.dumps(rows)


@pytest.mark.slow
def test_doctor_cli():
    r = subprocess.run([sys.executable, "-m", "fastattn", "doctor", "--json", "--no-calibrate"], capture_output=True,
                       text=True, timeout=120)  # the calibration has tests of its own (test_exactness)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert "exact_granularity" not in info
    for key in ("torch", "voxcpm", "device", "threads", "cpu_capability", "torchaudio_placeholder", "cudnn_version"):
        assert key in info
    assert info["voxcpm"] == "2.0.3"
    assert "cpu_capability" in format_doctor(info)  # the text form prints the same facts (one process is enough)


def test_fastest_dtype_measured_reads_the_latest_save(tmp_path, monkeypatch):
    import fastattn.lab.doctor as doc
    records = tmp_path / "20260101T000000Z-cpu" / "05_profiling" / "records"
    records.mkdir(parents=True)
    env = {"device": "cpu", "device_name": doc.cpu_name()}
    for name, tag in (("dtype_decode.json", "first"), ("dtype_decode-2.json", "second")):  # x-2 sorts before x
        (records / name).write_text(json.dumps({"kind": "dtype_decode", "env": env, "params": {}, "tag": tag}))
    monkeypatch.setattr(doc, "reports_dir", lambda: tmp_path)
    monkeypatch.setattr(doc, "dtype_recommendation", lambda rec, flags: {
        "dtype": rec["tag"], "patched": False, "ratio": 0.5, "ratio_text": "0.50x (2 decodes)", "default": "bfloat16",
        "decided": True})
    line = doc.fastest_dtype_measured()
    assert line.startswith("second: 0.50x (2 decodes) of voxcpm's default step (bfloat16)")
    assert line.endswith("in run 20260101T000000Z-cpu")


@cuda
def test_cuda_masked_call_is_not_flash():
    q, k, v, m = decode_call(dtype=torch.bfloat16, device="cuda")
    r = explain_sdpa(q, k, v, attn_mask=m, enable_gqa=True)
    assert not r.eligibility["FLASH_ATTENTION"]["eligible"] and r.eligibility["FLASH_ATTENTION"]["reason"]
    assert r.forced["FLASH_ATTENTION"]["ran"] is False
    s = explain_sdpa(q, k[:, :, :101], v[:, :, :101], enable_gqa=True)
    assert s.eligibility["FLASH_ATTENTION"]["eligible"]
    assert doctor()["compute_capability"].startswith("sm_")


def test_seed_claims_checked_on_cpu():
    from fastattn.lab.experiments.backend_selection import check_claims
    rows = backend_matrix("cpu", capacity=1024, position=100)
    claims = {c["claim"]: c for c in check_claims(rows, "cpu")}
    verdicts = {c: v["verdict"] for c, v in claims.items()}
    assert verdicts["A bool attn_mask makes SDPA fall back to the math kernel"] == "does not hold"
    assert "bfloat16" in claims["A bool attn_mask makes SDPA fall back to the math kernel"]["shows"]  # voxcpm's dtype
    shows = claims["A bool attn_mask makes SDPA fall back to the math kernel"]["shows"]
    assert "fused kernel takes the bool mask" in shows
    assert verdicts["Slicing the cache to position+1 lets SDPA use flash attention"] == "holds in part"  # masked: flash
    rounding = "The sliced result differs only by ~1e-6 (which can shift the stop token)"
    assert verdicts[rounding] == "holds in part"  # float32's error is ~1e-7, bf16's ~1e-3
    from fastattn.lab import bench
    from fastattn.lab.claims import matrix_claims
    ledger = {r["claim"]: r["verdict"] for r in matrix_claims(bench.record(
        "backend_matrix", env={"device": "cpu"}, params={}, rows=rows))}
    assert ledger.items() <= verdicts.items()  # 02's table and the ledger: the same rows
    causal = verdicts["is_causal=True is a safe way to drop the mask for a one-query decode step"]
    assert causal.startswith("does not hold")


def test_window_claim_verdict_follows_the_measurement(monkeypatch):
    """The 256-slot-window claim: 'holds' only where measured identical, and never called exact by construction."""
    import torch.nn.functional as F

    from fastattn.exactness import reset_exactness_cache
    from fastattn.lab.experiments.backend_selection import _window_claim

    from ..helpers import order_sensitive

    here = _window_claim("cpu")
    import re
    assert "512-key block" in here["verdict"]
    g = re.search(r"default exact granularity here: (\w+)", here["shows"]).group(1)
    assert g == "None" or int(g) % 512 == 0  # a multiple of the kernel's key block, whatever this CPU measures
    if here["verdict"].startswith("holds"):
        assert "not by construction" in here["verdict"]
    monkeypatch.setattr(F, "scaled_dot_product_attention", order_sensitive(1024))
    reset_exactness_cache()
    broken = _window_claim("cpu")
    assert broken["verdict"].startswith("does not hold") and "differs at length" in broken["shows"]
    assert "default exact granularity here: 1024" in broken["shows"]
    reset_exactness_cache()


def test_claims_ledger_verdicts_come_from_measurements(tmp_path):
    """Every seed claim gets one of the ledger's verdicts; direct measurements decide some; run records others."""
    from fastattn.lab import bench
    from fastattn.lab.claims import FAILS, HOLDS, NOT_HERE, NOT_RUN, NOT_SCALE, PARTLY, UNDECIDED, claims_ledger
    ledger = claims_ledger(None)
    assert len(ledger) == 19 and {r["verdict"] for r in ledger} <= {HOLDS, FAILS, NOT_HERE, NOT_RUN, UNDECIDED, PARTLY,
                                                                     NOT_SCALE}
    by = {r["claim"]: r for r in ledger}
    assert by[".contiguous() on the layer caches is a no-op (no copy)"]["verdict"] == HOLDS
    assert by["sdpa_kernel switches SDPA's kernel for all threads (process-wide)"]["verdict"] == HOLDS
    assert by["Every request zero-fills the whole cache of both LMs"]["verdict"] == HOLDS
    assert by["MPS needs .contiguous() on sliced views"]["verdict"] == NOT_HERE
    symptom = "Streaming slows from ~0.3 s to 1-2 s per chunk after 400+ chunks (#293)"
    assert by[symptom]["verdict"] == NOT_RUN and "01_root_cause" in by[symptom]["evidence"]
    for word, verdict in (("grows", HOLDS), ("flat", FAILS), ("inconclusive", NOT_HERE), (None, NOT_RUN)):
        run = tmp_path / str(word)
        text = f"{word} (+80% over the stream, 95% CI [+70%, +90%], 2 repeats; ...)"
        trend = {} if word is None else {"trend": {"upstream": {"verdict": word}}}  # None: a record of one run
        rec = bench.record("stream_profile", env={"device": "cuda"}, params={"chunks": 600, "preset": "small",
                           "weights": "checkpoint"}, rows=[], verdict={"upstream": text}, **trend)
        bench.save_record(rec, run / "01_root_cause" / "records", "stream_profile")
        got = {r["claim"]: r for r in claims_ledger(run)}[symptom]
        assert got["verdict"] == verdict and (word is None or got["evidence"].endswith(f"): {word}"))


# backend_matrix names what it takes; no empty list, no KeyError
def test_backend_matrix_dtype_names_and_errors():
    rows = backend_matrix("cpu", dtype="float32", capacity=64, position=3)
    assert rows and {r["dtype"] for r in rows} == {"float32"}
    with pytest.raises(ValueError, match="dtype must be one of bfloat16, float32, float16"):
        backend_matrix("cpu", dtype=torch.float64, capacity=64, position=3)
