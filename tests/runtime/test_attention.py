"""attention_step: exact is bit-identical to reference, fast within tolerance, errors are clear."""

import math
import re
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fastattn
from fastattn.step import attention_step, check_exactness, window_for

from ..helpers import rand_cache

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

MODES_TEXT = re.escape(", ".join(map(repr, fastattn.MODES)))  # the message lists the registry

DTYPES = [torch.float32, torch.bfloat16]
# float64-reference tolerance per dtype: a few ulps of the output scale.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def f64_reference(q, k, v, length):
    """Plain float64 attention over keys [0, length), bottom-right causal."""
    B, hq, lq, D = q.shape
    g = hq // k.shape[1]
    kk = k[:, :, :length].double().repeat_interleave(g, dim=1)
    vv = v[:, :, :length].double().repeat_interleave(g, dim=1)
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(D)
    rows = torch.arange(lq).view(-1, 1) + (length - lq)
    s = s.masked_fill(torch.arange(length).view(1, -1) > rows, float("-inf"))
    return torch.softmax(s, dim=-1) @ vv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(16, 2), (4, 4), (8, 1)])  # GQA groups 8, 1, 8 ... and 2 below
def test_exact_bit_identical_dense_sweep(dtype, hq, hkv):
    cap = 1024 if dtype == torch.bfloat16 else 2048
    q, k, v = rand_cache(1, hq, hkv, cap, 128, dtype)
    edges = {e + d for e in range(128, cap + 1, 128) for d in (-2, -1, 0)}  # lengths around every 128-key edge
    for p in sorted(set(range(0, cap, 13)) | {e for e in edges if 0 <= e < cap}):
        qq = q * (1 + p % 7)  # vary the query without new allocations per position
        ref = attention_step(qq, k, v, p + 1, mode="reference")
        ex = attention_step(qq, k, v, p + 1, mode="exact")
        assert torch.equal(ref, ex), f"p={p}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_at_bucket_edges_full_capacity(dtype):
    q, k, v = rand_cache(1, 16, 2, 8192, 128, dtype, seed=1)
    edges = [0, 1, 255, 256, 257, 511, 512, 4095, 4096, 8190, 8191]
    for p in edges:
        ref = attention_step(q, k, v, p + 1, mode="reference")
        assert torch.equal(ref, attention_step(q, k, v, p + 1)), p


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_batch_gqa2_lq_gt_1(dtype):
    q, k, v = rand_cache(3, 4, 2, 768, 64, dtype, seed=2, lq=5)
    for length in [5, 6, 16, 17, 255, 256, 257, 600, 768]:
        ref = attention_step(q, k, v, length, mode="reference")
        assert torch.equal(ref, attention_step(q, k, v, length)), length
        f = attention_step(q, k, v, length, mode="fast")
        r64 = f64_reference(q, k, v, length)
        assert (f.double() - r64).abs().max() <= TOL[dtype]
        assert (ref.double() - r64).abs().max() <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_and_reference_vs_float64(dtype):
    q, k, v = rand_cache(2, 16, 2, 2048, 128, dtype, seed=3)
    for p in [0, 1, 100, 1000, 2047]:
        r64 = f64_reference(q, k, v, p + 1)
        for mode in fastattn.MODES:
            out = attention_step(q, k, v, p + 1, mode=mode)
            assert out.dtype == dtype and out.shape == q.shape
            assert (out.double() - r64).abs().max() <= TOL[dtype], (mode, p)


def test_position_zero_returns_v0():
    q, k, v = rand_cache(1, 16, 2, 512, 128, torch.float32)
    for mode in fastattn.MODES:
        out = attention_step(q, k, v, 1, mode=mode)
        assert torch.equal(out, v[:, :, :1].repeat_interleave(8, dim=1)), mode


def calibrated_window(q, k, length):
    g = fastattn.exactness.exact_granularity("cpu", q.dtype, hq=q.shape[1], hkv=k.shape[1], head_dim=q.shape[3],
                                             capacity=k.shape[2], lq=q.shape[2])
    return k.shape[2] if g is None else window_for(length, k.shape[2], g)


@given(
    B=st.integers(1, 3), hkv=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 8]),
    D=st.sampled_from([16, 64, 128]), cap=st.sampled_from([100, 768, 1024, 1536, 2048]), lq=st.integers(1, 5),
    data=st.data(),
)
def test_property_default_exact_equals_reference(B, hkv, group, D, cap, lq, data):
    """The contract on whatever machine runs it: the default (calibrated) exact is the reference, bit for bit,
    through an int length and through a tensor length with the calibrated window."""
    length = data.draw(st.integers(lq, cap), label="length")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    q, k, v = rand_cache(B, hkv * group, hkv, cap, D, dtype, seed=length, lq=lq)
    ref = attention_step(q, k, v, length, mode="reference")
    assert torch.equal(ref, attention_step(q, k, v, length))
    w = calibrated_window(q, k, length)
    assert torch.equal(ref, attention_step(q, k, v, torch.tensor([length]), window=w))
    fast = attention_step(q, k, v, length, mode="fast")
    assert (fast.double() - f64_reference(q, k, v, length)).abs().max() <= TOL[dtype]


def test_tensor_length_with_window_matches_int():
    q, k, v = rand_cache(1, 16, 2, 1024, 128, torch.float32)
    for p in [0, 200, 255, 256, 511, 512, 1023]:
        w = calibrated_window(q, k, p + 1)
        a = attention_step(q, k, v, torch.tensor([p + 1]), window=w)
        b = attention_step(q, k, v, torch.tensor(p + 1))  # no window: read back
        assert torch.equal(a, b) and torch.equal(a, attention_step(q, k, v, p + 1, mode="reference"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_stale_garbage_past_length(bad):
    """fast never reads past length; reference/exact read it masked, and NaN/Inf there poisons them."""
    q, k, v = rand_cache(1, 16, 2, 512, 128, torch.float32)
    length = 100
    clean = attention_step(q, k, v, length, mode="fast")
    k2, v2 = k.clone(), v.clone()
    k2[:, :, length:] = bad
    v2[:, :, length:] = bad
    assert torch.equal(attention_step(q, k2, v2, length, mode="fast"), clean)
    # Documented: the masked modes multiply the stale values by a zero weight.
    for mode in ("reference", "exact"):
        assert not torch.isfinite(attention_step(q, k2, v2, length, mode=mode)).all(), mode
    # Finite stale values change nothing, in any mode.
    k3, v3 = k.clone(), v.clone()
    k3[:, :, length:] = 1e4
    v3[:, :, length:] = -1e4
    for mode in fastattn.MODES:
        assert torch.equal(attention_step(q, k3, v3, length, mode=mode), attention_step(q, k, v, length, mode=mode))


def test_int_bucket_self_check_reports_and_warns(monkeypatch):
    """An explicit int bucket keeps its meaning: checked once per geometry, warned about where it differs."""
    A = fastattn.exactness  # where the int-bucket self-check lives
    fastattn.reset_exactness_cache()
    q, k, v = rand_cache(1, 16, 2, 1024, 128, torch.float32)
    attention_step(q, k, v, 10, bucket=256)
    rep = [r for r in fastattn.exactness_report() if r["check"] == "self-check"]
    assert len(rep) == 1 and rep[0]["bucket"] == 256 and rep[0]["dtype"] == "float32"
    assert isinstance(rep[0]["bit_identical"], bool)
    # A device whose kernels differ: the self-check must warn once, with the difference.
    fastattn.reset_exactness_cache()
    monkeypatch.setattr(A, "check_exactness", lambda *a, **kw: {"bit_identical": False, "max_abs_diff": 1e-7,
                                                                 "positions_checked": 3, "first_diff_position": 0})
    with pytest.warns(RuntimeWarning, match="NOT bit-identical"):
        attention_step(q, k, v, 10, bucket=256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention_step(q, k, v, 11, bucket=256)  # once per geometry
    fastattn.reset_exactness_cache()


def test_check_exactness_direct():
    r = check_exactness("cpu", torch.bfloat16, hq=8, hkv=2, head_dim=64, bucket=64)
    assert isinstance(r["bit_identical"], bool) and r["positions_checked"] >= 5 and r["bucket"] == 64
    assert r["bit_identical"] == (r["first_diff_position"] is None)


def test_window_for():
    assert window_for(1, 8192) == 256
    assert window_for(256, 8192) == 256
    assert window_for(257, 8192) == 512
    assert window_for(8000, 8192) == 8192
    assert window_for(300, 400, 256) == 400


# ------------------------------------------------------------------ bad input
def _ok():
    return rand_cache(1, 16, 2, 64, 32, torch.float32)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dims"),
    (lambda q, k, v: (q, k[0], v), ValueError, "k_cache must have 4 dims"),
    (lambda q, k, v: (q, k, v[:, :, :10]), ValueError, "same shape"),
    (lambda q, k, v: (q[:, :15], k, v), ValueError, "multiple of KV heads"),
    (lambda q, k, v: (q[..., :16], k, v), ValueError, "head dim"),
    (lambda q, k, v: (q.double(), k, v), TypeError, "dtypes differ"),
    (lambda q, k, v: (q.numpy(), k, v), TypeError, "q must be a torch.Tensor"),
    (lambda q, k, v: (torch.cat([q, q]), k, v), ValueError, "batch"),
])
def test_bad_tensors(mutate, exc, match):
    q, k, v = mutate(*_ok())
    with pytest.raises(exc, match=match):
        attention_step(q, k, v, 5)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(length=0), ValueError, "length must satisfy"),
    (dict(length=65), ValueError, "length must satisfy"),
    (dict(length=3.0), TypeError, "length must be an int"),
    (dict(length=True), TypeError, "bool"),
    (dict(length=torch.tensor([1.0])), TypeError, "integer dtype"),
    (dict(length=torch.tensor([1, 2])), ValueError, "one element"),
    (dict(length=5, bucket=0), ValueError, "bucket must be None .calibrated. or a positive multiple of 16"),
    (dict(length=5, bucket=24), ValueError, "bucket must be None .calibrated. or a positive multiple of 16"),
    (dict(length=5, mode="flash"), ValueError, MODES_TEXT),
    (dict(length=5, window=65), ValueError, "window must satisfy"),
    (dict(length=40, window=32), ValueError, "exceeds window"),
    (dict(length=5, window=32.0), TypeError, "window must be a Python int"),
    (dict(length=5, window=32, mode="fast"), ValueError, "window= is for mode='exact'"),
    (dict(length=torch.tensor([70])), ValueError, "length must satisfy"),
    (dict(length=torch.tensor(0), mode="reference"), ValueError, "length must satisfy"),
    (dict(length=torch.tensor(20), window=16), ValueError, "exceeds window"),
])
def test_bad_arguments(kw, exc, match):
    q, k, v = _ok()
    with pytest.raises(exc, match=match):
        attention_step(q, k, v, **kw)


# a mask that SDPA would reject (or that would be truncated) is refused
@pytest.mark.parametrize("shape", [(1, 49), (1, 51), (2, 1, 1, 50), (1, 1, 1, 1, 50)])
def test_attention_mask_shape_must_broadcast(shape):
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 50, 16)
    with pytest.raises(ValueError, match=r"does not broadcast to \(B, Hq, Lq, Lk\)"):
        fastattn.attention(q, k, k, mask=torch.ones(shape, dtype=torch.bool), enable_gqa=True)
    out = fastattn.attention(q, k, k, mask=torch.ones(1, 1, 1, 50, dtype=torch.bool), enable_gqa=True)
    assert out.shape == q.shape


# absurd buckets are refused before any allocation, naming the argument
@pytest.mark.parametrize("bucket", [2**31, 2**70])
def test_huge_bucket_is_refused_or_harmless(bucket):
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 64, 16)
    out = attention_step(q, k, k, 10, bucket=bucket)  # a bucket at or above capacity windows the whole cache
    assert torch.equal(out, attention_step(q, k, k, 10, mode="reference"))
    with pytest.raises(ValueError, match="bucket="):
        fastattn.check_exactness("cpu", torch.float32, hq=4, hkv=2, head_dim=16, bucket=bucket)


# integer and meta tensors get a clear error / a clean result
def test_integer_tensors_are_a_clear_error():
    z = lambda *s: torch.zeros(*s, dtype=torch.int64)  # noqa: E731
    with pytest.raises(TypeError, match="must be floating point"):
        attention_step(z(1, 2, 1, 8), z(1, 1, 16, 8), z(1, 1, 16, 8), 3)


def test_meta_tensors_in_exact():
    q, k = torch.empty(1, 4, 1, 16, device="meta"), torch.empty(1, 2, 2048, 16, device="meta")
    assert attention_step(q, k, k, 100).shape == q.shape
