"""Calibrated exactness: the default `exact` equals upstream's full-cache call on any machine.

No test here asserts a bit-identity only some CPUs give. The contract tests assert the
default equals the reference on whatever kernels run them (and run again below under
torch's other CPU kernel builds); the injected kernels prove the calibration rejects a
granularity where the arithmetic depends on the key count.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fastattn import attention_step, calibrate_exact, exactness_report, reset_exactness_cache
from fastattn.exactness import CPU_FLASH_KEY_BLOCK

from ..helpers import order_sensitive, rand_cache

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16]


rand = rand_cache


def edge_lengths(cap, lq, step=256):
    """Every length around each multiple of 256 (so around every 512 block edge too), plus the ends."""
    picks = {lq, lq + 1, cap} | {e + d for e in range(step, cap + 1, step) for d in (-1, 0, 1)}
    return sorted(n for n in picks if lq <= n <= cap)


# --------------------------------------------------------------------------- the contract (any machine)
CASES = [  # (B, hq, hkv, capacity, D, lq)
    (3, 4, 2, 768, 64, 5),      # the case that failed on an EPYC with 256-slot windows
    (1, 16, 2, 2048, 128, 1),   # VoxCPM2's heads
    (2, 8, 1, 1024, 64, 3),     # GQA 8
    (3, 4, 4, 1536, 32, 1),     # no GQA, capacity not a power of two
    (1, 16, 2, 8192, 128, 5),   # the real capacity, Lq > 1
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,hq,hkv,cap,D,lq", CASES)
def test_contract_default_exact_is_reference(B, hq, hkv, cap, D, lq, dtype):
    q, k, v = rand(B, hq, hkv, cap, D, dtype, lq=lq, seed=cap + lq)
    step = 256 if cap <= 2048 else 512
    for n in edge_lengths(cap, lq, step):
        ref = attention_step(q, k, v, n, mode="reference")
        assert torch.equal(ref, attention_step(q, k, v, n)), f"length {n}"


def test_contract_calibration_on_this_machine():
    """Whatever this CPU's kernel rounds like: the chosen granularity is eligible by construction
    and was measured identical; every smaller eligible one was measured and failed."""
    cal = calibrate_exact("cpu", torch.float32, hq=4, hkv=2, head_dim=64, capacity=2048, lq=3)
    assert cal["kernel"] == "cpu FLASH_ATTENTION" and cal["key_block"] == CPU_FLASH_KEY_BLOCK
    cands = [r["candidate"] for r in cal["ladder"]]
    assert cands == [256, 512, 1024]  # the half block (ineligible, shown), then powers of two from the block
    assert all(r["measured"] and r["lengths_checked"] == cal["lengths"] and r["draws"] == 3 for r in cal["ladder"])
    assert cal["lengths"] == len(edge_lengths(2048, 3, 256))  # the half block's edges are walked too (255 etc.)
    elig = [r for r in cal["ladder"] if r["eligible"]]
    assert [r["candidate"] for r in elig] == [512, 1024]
    if cal["bucket"] is not None:
        chosen = next(r for r in elig if r["candidate"] == cal["bucket"])
        assert chosen["bit_identical"] and chosen["max_abs_diff"] == 0.0
        assert all(not r["bit_identical"] for r in elig if r["candidate"] < cal["bucket"])
    else:
        assert not any(r["bit_identical"] for r in elig)


# --------------------------------------------------------------------------- injected kernels
@pytest.fixture
def fresh():
    reset_exactness_cache()
    yield
    reset_exactness_cache()


def test_calibration_rejects_a_granularity_the_kernel_rounds_differently(monkeypatch, fresh):
    monkeypatch.setattr(F, "scaled_dot_product_attention", order_sensitive(1024))
    cap = 4096
    cal = calibrate_exact("cpu", torch.float32, hq=4, hkv=2, head_dim=32, capacity=cap)
    row = {r["candidate"]: r for r in cal["ladder"]}
    assert cal["bucket"] == 1024
    assert row[512]["bit_identical"] is False and row[512]["max_abs_diff"] > 0
    assert row[1024]["bit_identical"] and row[2048]["bit_identical"]
    q, k, v = rand(2, 4, 2, cap, 32, torch.float32)
    for n in edge_lengths(cap, 1, 512):
        assert torch.equal(attention_step(q, k, v, n, mode="reference"), attention_step(q, k, v, n)), n
    rep = [r for r in exactness_report() if r["check"] == "calibration"]
    assert rep and rep[-1]["bucket"] == 1024 and rep[-1]["capacity"] == cap


def test_only_the_full_capacity_is_exact_then_exact_is_reference(monkeypatch, fresh):
    monkeypatch.setattr(F, "scaled_dot_product_attention", order_sensitive(None, capacity=2048))
    cal = calibrate_exact("cpu", torch.float32, hq=4, hkv=2, head_dim=32, capacity=2048)
    assert cal["bucket"] is None and not any(r["bit_identical"] for r in cal["ladder"])
    q, k, v = rand(1, 4, 2, 2048, 32, torch.float32)
    with pytest.warns(RuntimeWarning, match="whole capacity"):
        out = attention_step(q, k, v, 300)
    assert torch.equal(out, attention_step(q, k, v, 300, mode="reference"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        for n in (1, 511, 513, 2048):
            assert torch.equal(attention_step(q, k, v, n), attention_step(q, k, v, n, mode="reference"))


def test_a_replaced_kernel_is_recalibrated(monkeypatch, fresh):
    q, k, v = rand(1, 4, 2, 2048, 32, torch.float32)
    attention_step(q, k, v, 10)
    n0 = len(exactness_report())
    monkeypatch.setattr(F, "scaled_dot_product_attention", order_sensitive(1024))
    attention_step(q, k, v, 10)
    assert len(exactness_report()) == n0 + 1


def test_no_key_block_argument_means_full_capacity(monkeypatch, fresh):
    """A kernel with no construction argument (CUDA's, CPU's math) never gets a window, whatever it measures."""
    from fastattn import exactness as E

    monkeypatch.setattr(E, "kernel_key_block", lambda *a, **kw: (None, "cpu MATH"))
    cal = calibrate_exact("cpu", torch.float32, hq=4, hkv=2, head_dim=32, capacity=2048)
    assert cal["bucket"] is None and cal["key_block"] is None
    assert all(not r["eligible"] and "no key-block argument" in r["reason"] for r in cal["ladder"])


def test_small_capacity_has_no_candidates(fresh):
    cal = calibrate_exact("cpu", torch.float32, hq=2, hkv=1, head_dim=16, capacity=300)
    assert cal["bucket"] is None and [r["candidate"] for r in cal["ladder"]] == [256]
    q, k, v = rand(1, 2, 1, 300, 16, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: the whole cache is tiny
        assert torch.equal(attention_step(q, k, v, 7), attention_step(q, k, v, 7, mode="reference"))


@pytest.mark.parametrize("kw,match", [
    (dict(hq=0), "hq must be a positive int"),
    (dict(hq=3, hkv=2), "multiple of hkv"),
    (dict(capacity=2.5), "capacity must be a positive int"),
    (dict(lq=5000), "lq .5000. must not exceed capacity"),
    (dict(draws=0), "draws must be a positive int"),
])
def test_calibrate_bad_arguments(kw, match):
    args = dict(hq=4, hkv=2, head_dim=32, capacity=1024) | kw
    with pytest.raises(ValueError, match=match):
        calibrate_exact("cpu", torch.float32, **args)


def test_meta_tensors_do_not_crash(fresh):
    q = torch.empty(1, 4, 1, 32, device="meta")
    k = torch.empty(1, 2, 2048, 32, device="meta")
    out = attention_step(q, k, k, 100)
    assert out.shape == q.shape and out.device.type == "meta"


# --------------------------------------------------------------------------- other kernel builds
@pytest.mark.slow
def test_contract_under_other_cpu_kernel_builds():
    """torch ships several CPU kernel builds in one wheel and honours ATEN_CPU_CAPABILITY: run the contract tests
    under the default and avx2 builds (side by side: two sessions), so every machine checks more than its own.
    The real-capacity case (8192 slots, 20 s a build) runs under the host's build only: past the window, the extra
    keys are masked blocks, which the capacity 768-2048 cases already walk at every edge."""
    builds = ["default"] + (["avx2"] if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else [])
    tests = ("(contract_default or contract_calibration or rejects or only_the_full or stream_is_bit_identical) "
             "and not 8192")
    files = [str(Path(__file__)), str(Path(__file__).with_name("test_vae.py"))]
    code = ("import sys, torch, pytest; print(torch.backends.cpu.get_cpu_capability(), flush=True); "
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *{files!r}, '-k', {tests!r}]))")
    procs = {b: subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, ATEN_CPU_CAPABILITY=b,
                                                                          PYTHONHASHSEED="0"), cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for b in builds}
    for build, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert out.splitlines()[0].strip().lower() == build, (build, out[-2000:] + err[-2000:])
        assert proc.returncode == 0 and " passed" in out and "failed" not in out, (build, out[-3000:] + err[-2000:])
