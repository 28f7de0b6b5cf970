"""MaskInfo: dense forms, describes() near-misses, attention() equals the dense-mask SDPA."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from fastattn.masks import MaskInfo, attention

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)


def hand_mask(B, Lq, Lk, lengths=None, causal=False, window=None, left=False):
    m = torch.zeros(B, 1, Lq, Lk, dtype=torch.bool)
    for b in range(B):
        n = Lk if lengths is None else lengths[b]
        for i in range(Lq):
            pos = i + Lk - Lq
            for j in range(Lk):
                ok = (j >= Lk - n) if left else (j < n)
                if causal:
                    ok = ok and j <= pos
                if window is not None:
                    ok = ok and j > pos - window
                m[b, 0, i, j] = ok
    return m


def keys_for(lengths, Lk, left=False):
    cols = torch.arange(Lk).view(1, -1)
    n = torch.tensor(lengths).view(-1, 1)
    return cols >= Lk - n if left else cols < n


@pytest.mark.parametrize("causal,window,pad", [
    (False, None, None), (True, None, None), (False, 3, None), (True, 4, None),
    (False, None, "right"), (True, None, "right"), (True, None, "left"), (True, 5, "right"),
])
def test_dense_matches_hand_built(causal, window, pad):
    B, Lq, Lk = 3, 4, 11
    lengths = [11, 7, 4]
    keys = keys_for(lengths, Lk, left=pad == "left") if pad else None
    info = MaskInfo(keys=keys, causal=causal, window=window, padding=pad)
    want = hand_mask(B if pad else 1, Lq, Lk, lengths if pad else None, causal, window, left=pad == "left")
    got = info.dense(Lq, Lk)
    assert got.shape == want.shape and torch.equal(got, want)
    assert info.describes(want) and info.describes(want.expand(B, 2, Lq, Lk))


def test_describes_rejects_near_misses():
    info = MaskInfo(causal=True)
    m = info.dense(4, 9)
    assert info.describes(m)
    for idx in [(0, 0, 0, 0), (0, 0, 0, 6), (0, 0, 3, 8), (0, 0, 2, 7)]:
        bad = m.clone()
        bad[idx] = ~bad[idx]
        assert not info.describes(bad), idx
    assert not MaskInfo(causal=True, window=3).describes(m)
    assert not MaskInfo().describes(m)
    assert not info.describes(m[..., :8])  # wrong Lk: a different structure
    with pytest.raises(TypeError, match="bool masks"):
        info.describes(m.float())


def test_bad_maskinfo():
    with pytest.raises(TypeError, match=r"keys must be a bool tensor of shape \(B, Lk\)"):
        MaskInfo(keys=torch.ones(2, 3))
    with pytest.raises(ValueError, match="window must be a positive int"):
        MaskInfo(window=0)
    with pytest.raises(ValueError, match="padding must be"):
        MaskInfo(keys=torch.ones(1, 3, dtype=torch.bool), padding="middle")
    with pytest.raises(ValueError, match="padding needs keys"):
        MaskInfo(padding="right")
    with pytest.raises(ValueError, match="keys has 3 columns but Lk is 4"):
        MaskInfo(keys=torch.ones(1, 3, dtype=torch.bool)).dense(1, 4)


def _sdpa_ref(q, k, v, m):
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m, enable_gqa=True)
    return torch.where(m.any(-1, keepdim=True), out, 0.0)


@given(B=st.integers(1, 3), Lq=st.integers(1, 6), Lk_extra=st.integers(0, 70), causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 40)), pad=st.sampled_from([None, "right", "left"]),
       data=st.data())
def test_attention_equals_dense_mask_sdpa(B, Lq, Lk_extra, causal, window, pad, data):
    Lk = Lq + Lk_extra
    lengths = [data.draw(st.integers(0, Lk)) for _ in range(B)] if pad else None
    keys = keys_for(lengths, Lk, left=pad == "left") if pad else None
    info = MaskInfo(keys=keys, causal=causal, window=window, padding=pad)
    g = torch.Generator().manual_seed(Lk)
    q = torch.randn(B, 4, Lq, 32, generator=g)
    k = torch.randn(B, 2, Lk, 32, generator=g)
    v = torch.randn(B, 2, Lk, 32, generator=g)
    m = info.dense(Lq, Lk)
    out = attention(q, k, v, mask=m, mask_info=info, enable_gqa=True, check=True)
    assert torch.isfinite(out).all()
    assert (out.double() - _sdpa_ref(q, k, v, m)).abs().max() <= 1e-5
    # mask_info alone stands for the mask
    assert torch.equal(out, attention(q, k, v, mask_info=info, enable_gqa=True))


def test_attention_bit_identical_for_prefix_decode():
    """A decode step over a right-padded prefix: the same bits as the dense masked call."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, 1, 128, generator=g)
    k = torch.randn(2, 2, 1024, 128, generator=g)
    v = torch.randn(2, 2, 1024, 128, generator=g)
    for lengths in ([1, 1], [300, 17], [1024, 513]):
        info = MaskInfo(keys=keys_for(lengths, 1024), padding="right")
        m = info.dense(1, 1024)
        dense = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        assert torch.equal(attention(q, k, v, mask=m, mask_info=info, enable_gqa=True), dense), lengths


def test_fully_masked_rows_are_zero_not_nan():
    q = torch.randn(2, 2, 3, 8)
    k = torch.randn(2, 2, 5, 8)
    v = torch.randn(2, 2, 5, 8)
    m = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    m[1] = False
    for info in (None, MaskInfo(keys=torch.tensor([[True] * 5, [False] * 5]), padding="right")):
        out = attention(q, k, v, mask=m, mask_info=info)
        assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))


def test_check_catches_wrong_structure(monkeypatch):
    info = MaskInfo(causal=True)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    wrong = MaskInfo(window=2).dense(4, 9)
    with pytest.raises(ValueError, match="does not describe"):
        attention(q, k, v, mask=wrong, mask_info=info, check=True)
    attention(q, k, v, mask=wrong, mask_info=info)  # unchecked by default ...
    monkeypatch.setenv("FASTATTN_CHECK_MASKS", "1")
    with pytest.raises(ValueError, match="does not describe"):  # ... and checked by the switch
        attention(q, k, v, mask=wrong, mask_info=info)
    lying = MaskInfo(keys=torch.tensor([[False, True, True, False, True, True, True, True, True]]), padding="right")
    with pytest.raises(ValueError, match="not right-padded"):
        attention(q, k, v, mask_info=lying, check=True)


def test_attention_bad_input():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="k must be a 4-D tensor"):
        attention(q, q[0], q)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        attention(q, q, q, mask=torch.zeros(1, 1, 4, 4))
    with pytest.raises(TypeError, match="mask_info must be a MaskInfo"):
        attention(q, q, q, mask_info="causal")
