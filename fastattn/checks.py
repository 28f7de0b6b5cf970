"""Correctness sweeps the causality notebook plots: exact vs reference bit for bit, fast and
reference vs a float64 reference, over dense position sweeps. Plain data out, no plotting."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .attention import attention_step

__all__ = ["f64_attention", "exactness_sweep", "first_divergence"]


def f64_attention(q, k, v, length: int) -> torch.Tensor:
    """Float64 decode attention over keys [0, length), bottom-right causal; GQA by repetition."""
    lq = q.shape[2]
    g = q.shape[1] // k.shape[1]
    kk = k[:, :, :length].double().repeat_interleave(g, 1)
    vv = v[:, :, :length].double().repeat_interleave(g, 1)
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    rows = torch.arange(lq, device=q.device).view(-1, 1) + (length - lq)
    s = s.masked_fill(torch.arange(length, device=q.device).view(1, -1) > rows, float("-inf"))
    return torch.softmax(s, -1) @ vv


@torch.no_grad()
def exactness_sweep(positions: Sequence[int], *, capacity: int = 2048, dtypes=("float32", "bfloat16"),
                    hq: int = 16, hkv: int = 2, head_dim: int = 128, bucket: int = 256, device="cpu",
                    seed: int = 0) -> list[dict]:
    """For each dtype and position: is ``exact`` torch.equal to ``reference``, and how far are
    ``fast`` (from reference) and both (from float64)? Random data, one fresh query per position."""
    rows = []
    for name in dtypes:
        dt = getattr(torch, name)
        g = torch.Generator().manual_seed(seed)
        k = torch.randn(1, hkv, capacity, head_dim, generator=g).to(device=device, dtype=dt)
        v = torch.randn(1, hkv, capacity, head_dim, generator=g).to(device=device, dtype=dt)
        for p in positions:
            if not 0 <= p < capacity:
                raise ValueError(f"positions must be in [0, capacity={capacity}), got {p}")
            q = torch.randn(1, hq, 1, head_dim, generator=g).to(device=device, dtype=dt)
            ref = attention_step(q, k, v, p + 1, mode="reference")
            ex = attention_step(q, k, v, p + 1, mode="exact", bucket=bucket)
            fa = attention_step(q, k, v, p + 1, mode="fast")
            r64 = f64_attention(q, k, v, p + 1)
            rows.append({"dtype": name, "position": p, "exact_identical": bool(torch.equal(ex, ref)),
                         "exact_max_abs": (ex.double() - ref.double()).abs().max().item(),
                         "fast_identical": bool(torch.equal(fa, ref)),
                         "fast_max_abs": (fa.double() - ref.double()).abs().max().item(),
                         "reference_vs_f64": (ref.double() - r64).abs().max().item(),
                         "fast_vs_f64": (fa.double() - r64).abs().max().item()})
    return rows


def first_divergence(a: torch.Tensor, b: torch.Tensor, *, axis: int = -1, chunk: int = 1) -> dict:
    """Where two sequences (e.g. two decodes' waveforms) first differ and by how much."""
    n = min(a.shape[axis], b.shape[axis])
    a, b = a.narrow(axis, 0, n), b.narrow(axis, 0, n)
    diff = (a.double() - b.double()).abs()
    ax = axis % diff.dim()
    other = [d for d in range(diff.dim()) if d != ax]
    per = diff.amax(dim=other) if other else diff
    nz = torch.nonzero(per > 0)
    first = int(nz[0, 0]) // chunk if len(nz) else None
    return {"identical": first is None and a.shape == b.shape, "first_diff_index": first,
            "max_abs_diff": diff.max().item() if diff.numel() else 0.0, "compared": n}
