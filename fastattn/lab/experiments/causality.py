"""Notebook 03's experiments: exact vs reference bit for bit, all vs float64, padded batches, stale NaN; data only."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from fastattn.cache import RightSizedKVCache
from fastattn.core import check_positions
from fastattn.devices import resolve_device
from fastattn.exactness import calibration_ladders  # noqa: F401 (03 shows the ladder)
from fastattn.masks import MaskInfo, attention
from fastattn.modes import MODES
from fastattn.step import attention_step, f64_attention


@torch.no_grad()
def exactness_sweep(positions: Sequence[int], *, capacity: int = 2048, dtypes=("float32", "bfloat16"),
                    hq: int = 16, hkv: int = 2, head_dim: int = 128, bucket: Optional[int] = None, device="cpu",
                    seed: int = 0) -> list[dict]:
    """Per dtype and position on random data: ``exact`` and ``fast`` vs ``reference`` (identical? distance), vs f64."""
    rows, dist = [], lambda a, b: (a.double() - b.double()).abs().max().item()
    check_positions(positions, capacity, "capacity")
    for name in dtypes:
        dt = getattr(torch, name)
        g = torch.Generator().manual_seed(seed)
        k, v = (torch.randn(1, hkv, capacity, head_dim, generator=g).to(device=device, dtype=dt) for _ in range(2))
        for p in positions:
            q = torch.randn(1, hq, 1, head_dim, generator=g).to(device=device, dtype=dt)
            ref = attention_step(q, k, v, p + 1, mode="reference")
            ex = attention_step(q, k, v, p + 1, mode="exact", bucket=bucket)
            fa = attention_step(q, k, v, p + 1, mode="fast")
            r64 = f64_attention(q, k, v, p + 1)
            rows.append({"dtype": name, "position": p, "exact_identical": bool(torch.equal(ex, ref)),
                         "exact_max_abs": dist(ex, ref), "fast_identical": bool(torch.equal(fa, ref)),
                         "fast_max_abs": dist(fa, ref), "reference_vs_f64": dist(ref, r64),
                         "fast_vs_f64": dist(fa, r64)})
    return rows


def sweep_summary(sweep: list) -> dict:
    """Per dtype of an :func:`exactness_sweep`: positions, bit-identical counts, the largest distances."""
    out = {}
    for dt in sorted({r["dtype"] for r in sweep}):
        rr = [r for r in sweep if r["dtype"] == dt]
        out[dt] = {"positions": len(rr), "exact bit-identical": sum(r["exact_identical"] for r in rr),
                   "fast bit-identical": sum(r["fast_identical"] for r in rr),
                   "max |fast - reference|": max(r["fast_max_abs"] for r in rr),
                   "max |reference - f64|": max(r["reference_vs_f64"] for r in rr),
                   "max |fast - f64|": max(r["fast_vs_f64"] for r in rr)}
    return out


@torch.no_grad()
def gqa_check(device="cpu", *, seed: int = 0, capacity: int = 1024, batch: int = 3) -> dict:
    """Per GQA grouping, batched: ``exact`` == ``reference`` at every 37th length; every mode gives v[0] at one key."""
    device = resolve_device(device)
    g = torch.Generator().manual_seed(seed)
    out, lengths = {}, range(1, capacity + 1, 37)
    for hq, hkv in ((16, 2), (8, 8), (8, 1)):
        q = torch.randn(batch, hq, 1, 128, generator=g).to(device)
        k = torch.randn(batch, hkv, capacity, 128, generator=g).to(device)
        v = torch.randn(k.shape, generator=g).to(device)
        same = all(torch.equal(attention_step(q, k, v, n, mode="reference"), attention_step(q, k, v, n))
                   for n in lengths)
        p0 = all(torch.equal(attention_step(q, k, v, 1, mode=m), v[:, :, :1].repeat_interleave(hq // hkv, 1))
                 for m in MODES)
        out[f"{hq}/{hkv} heads, batch {batch}, {device.type}"] = {
            f"exact == reference ({len(lengths)} lengths)": same,
            "position 0 returns v[0] in every mode": p0}
    return out


def padded_batch_check(*, lengths=(37, 200, 5), Lq: int = 3, Lk: int = 256, hq: int = 8, hkv: int = 2,
                       head_dim: int = 64, seed: int = 0, device="cpu") -> dict:
    """A left-padded batch (Lq > 1) through :func:`fastattn.attention` with MaskInfo: equal to dense SDPA? vs f64?"""
    device = resolve_device(device)
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    q, k, v = (torch.randn(*s, generator=g).to(device) for s in ((B, hq, Lq, head_dim), (B, hkv, Lk, head_dim),
                                                                 (B, hkv, Lk, head_dim)))
    keys = (torch.arange(Lk).view(1, -1) >= Lk - torch.tensor(lengths).view(-1, 1)).to(device)
    info = MaskInfo(keys=keys, causal=True, padding="left")
    dense = info.dense(Lq, Lk)
    out = attention(q, k, v, mask=dense, mask_info=info, enable_gqa=True, check=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    ref = torch.stack([f64_attention(q[b:b + 1], k[b:b + 1, :, Lk - n:], v[b:b + 1, :, Lk - n:], n)[0]
                       for b, n in enumerate(lengths)])
    return {"lengths": list(lengths), "Lq": Lq, "structured_equals_dense_sdpa": bool(torch.equal(out, sdpa)),
            "max_abs_vs_f64": (out.double() - ref).abs().max().item(),
            "describes": info.describes(dense), "device": str(device)}


def stale_nan_check(*, capacity: int = 1024, length: int = 300, seed: int = 0, device="cpu") -> dict:
    """NaN stored past ``length``: which modes' outputs stay finite, and whether RightSizedKVCache clears it."""
    device = resolve_device(device)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g).to(device) for s in ((1, 16, 1, 128), (1, 2, capacity, 128),
                                                                 (1, 2, capacity, 128)))
    k[:, :, length:] = float("nan")
    v[:, :, length:] = float("nan")
    finite = {m: bool(torch.isfinite(attention_step(q, k, v, length, mode=m)).all()) for m in MODES}
    c = RightSizedKVCache(1, 2, 128, 1, device, torch.float32, max_length=capacity)
    garbage = torch.full((1, 2, length + 200, 128), float("nan"), device=device)
    c.fill_caches([(garbage, garbage)])  # an earlier, longer request leaves NaN in every slot it wrote
    c.fill_caches([(k[:, :, :length], v[:, :, :length])])  # the next request
    p = c.step()
    kk, vv = c.get_layer_cache(0)
    after = {m: bool(torch.isfinite(attention_step(q, kk, vv, p + 1, mode=m)).all()) for m in ("reference", "exact")}
    return {"finite_output_with_nan_past_length": finite, "finite_after_rightsized_fill": after, "device": str(device)}
