"""fast mode: every candidate within tolerance, the chain drops broken and inaccurate ones, the report says why."""

import logging

import pytest
import torch

import fastattn
from fastattn import attention_step
from fastattn import fast as FA
from fastattn.devices import dtype_name
from fastattn.step import f64_attention

from ..conftest import cuda
from ..helpers import rand_cache

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rand(B, hq, hkv, n, D, dtype, lq=1, seed=0):
    return rand_cache(B, hq, hkv, n, D, dtype, seed=seed, lq=lq)


@pytest.fixture
def fresh():
    FA.reset_fast_cache()
    yield
    FA.reset_fast_cache()


@pytest.mark.parametrize("name", [n for n, (_, devs) in FA.CANDIDATES.items() if "cpu" in devs])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,hq,hkv,lq", [(1, 16, 2, 1), (2, 4, 4, 1), (3, 8, 1, 1), (1, 16, 2, 3), (3, 4, 2, 5)])
def test_every_candidate_within_tolerance_of_float64(name, dtype, B, hq, hkv, lq):
    fn = FA.CANDIDATES[name][0]
    for n in (lq, 511, 512, 513, 1024):
        q, k, v = rand(B, hq, hkv, n, 64, dtype, lq=lq, seed=n)
        out = fn(q, k, v)
        assert out.shape == q.shape and out.dtype == dtype
        assert (out.double() - f64_attention(q, k, v, n)).abs().max().item() <= TOL[dtype], (name, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_choice_is_accurate_and_reported(dtype, fresh):
    q, k, v = rand(1, 16, 2, 2048, 128, dtype)
    out = attention_step(q, k, v, 1500, mode="fast")
    rep = _report_for(1500)
    assert rep["winner"] in FA.CANDIDATES and rep["dtype"] == dtype_name(dtype)
    assert "trades bit-identity" in rep["note"]
    win = next(r for r in rep["candidates"] if r["candidate"] == rep["winner"])
    assert win["accepted"] and win["max_err"] <= 2 * rep["reference_max_err"] + 1e-12
    assert win["median_ms"] == min(r["median_ms"] for r in rep["candidates"] if r["accepted"])
    ref = attention_step(q, k, v, 1500, mode="reference")
    r64 = f64_attention(q, k, v, 1500)
    assert (out.double() - r64).abs().max() <= 2 * (ref.double() - r64).abs().max() + TOL[dtype] / 10


def _report_for(n_keys: int) -> dict:
    """The choice made for calls over ``n_keys`` keys (every key-count class is probed at first use)."""
    reports = fastattn.fast_report()
    assert {r["length_class"] for r in reports} == set(FA.LENGTH_CLASSES)  # no probe left for mid-decode
    return next(r for r in reports if r["length_class"] == FA._length_class(n_keys))


def _raises(q, k, v):
    raise RuntimeError("this kernel cannot run here")


def _inaccurate(q, k, v):
    return FA.sdpa_slice(q, k, v) + 1e-3


def _instant(q, k, v):  # fastest of all, and wrong
    return torch.zeros_like(q)


def test_chain_skips_broken_and_rejects_inaccurate(monkeypatch, caplog, fresh):
    monkeypatch.setitem(FA.CANDIDATES, "broken", (_raises, ("cpu",)))
    monkeypatch.setitem(FA.CANDIDATES, "inaccurate", (_inaccurate, ("cpu",)))
    monkeypatch.setitem(FA.CANDIDATES, "instant_but_wrong", (_instant, ("cpu",)))
    q, k, v = rand(1, 8, 2, 1024, 64, torch.float32)
    with caplog.at_level(logging.WARNING, logger="fastattn"):
        attention_step(q, k, v, 700, mode="fast")
        attention_step(q, k, v, 800, mode="fast")
    rep = _report_for(800)
    rows = {r["candidate"]: r for r in rep["candidates"]}
    assert rows["broken"]["broken"].startswith("RuntimeError") and not rows["broken"]["accepted"]
    assert not rows["inaccurate"]["accepted"] and not rows["instant_but_wrong"]["accepted"]
    assert rep["winner"] in ("sdpa_slice", "grouped_fp32")
    assert sum("broken" in m for m in caplog.messages) == 1  # logged once


def test_a_winner_that_raises_later_hands_over_once(monkeypatch, caplog, fresh):
    calls = {"broken": False}

    def flaky(q, k, v):  # fine while probed, fails later
        if calls["broken"]:
            raise RuntimeError("kernel failed")
        return FA.grouped_fp32(q, k, v)

    monkeypatch.setitem(FA.CANDIDATES, "grouped_fp32", (flaky, ("cpu",)))
    q, k, v = rand(1, 8, 2, 1024, 64, torch.float32)
    FA.reset_fast_cache()
    monkeypatch.setattr(FA, "_time", lambda fns, *a, **kw: {n: (0.0 if n == "grouped_fp32" else 1.0) for n in fns})
    attention_step(q, k, v, 600, mode="fast")
    assert _report_for(600)["winner"] == "grouped_fp32"
    calls["broken"] = True
    with caplog.at_level(logging.WARNING, logger="fastattn"):
        out = attention_step(q, k, v, 600, mode="fast")
        attention_step(q, k, v, 601, mode="fast")
    assert _report_for(600)["winner"] == "sdpa_slice"
    assert sum("raised" in m for m in caplog.messages) == 1
    assert (out.double() - f64_attention(q, k, v, 600)).abs().max() <= 1e-5


def test_no_accurate_candidate_is_a_clear_error(monkeypatch, fresh):
    only = {"inaccurate": (_inaccurate, ("cpu",))}
    with pytest.raises(RuntimeError, match="no candidate is within twice reference's error"):
        FA.choose_fast("cpu", torch.float32, hq=4, hkv=2, head_dim=32, candidates=only)


@cuda
def test_cuda_candidates_probed_and_accurate(fresh):
    q, k, v = (t.cuda() for t in rand(1, 16, 2, 4096, 128, torch.bfloat16))
    out = attention_step(q, k, v, 3000, mode="fast")
    rep = _report_for(3001)
    names = {r["candidate"] for r in rep["candidates"]}
    assert {"sdpa_flash", "sdpa_efficient", "sdpa_cudnn"} <= names
    assert (out.double() - f64_attention(q, k, v, 3000)).abs().max() <= TOL[torch.bfloat16]


def test_the_flash_op_is_a_cuda_candidate_that_can_win():
    """On CUDA the flash kernel competes as its aten op (no sdpa_kernel flags, no cuDNN plan per key count), not as
    a probe-only forced backend; an Lq > 1 call with a causal offset (a mask flash cannot take) goes through SDPA."""
    from fastattn.fast import CANDIDATES, PROBE_ONLY, flash_op, sdpa_slice
    assert CANDIDATES["flash_op"] == (flash_op, ("cuda",)) and "flash_op" not in PROBE_ONLY
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 10, 16)
    assert torch.equal(flash_op(q, k, k), sdpa_slice(q, k, k))


def test_fp32_acceptance_has_an_ulp_floor():
    """Reference's fp32 error is ulp noise: twice a lucky small one must not reject every candidate."""
    from fastattn.fast import choose_fast
    from fastattn.static import ULP_FLOOR
    r = choose_fast("cpu", torch.float32, hq=4, hkv=2, head_dim=16, length_class="keys<=512")
    assert r["bound"] >= ULP_FLOOR * torch.finfo(torch.float32).eps * 1e-3 and r["bound"] >= 2 * r["reference_max_err"]


@cuda
def test_the_flash_op_matches_sdpa_on_cuda():
    from fastattn.fast import flash_op, sdpa_slice
    q = torch.randn(1, 16, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    torch.testing.assert_close(flash_op(q, k, v), sdpa_slice(q, k, v), atol=2e-2, rtol=0)
