"""Notebook 02's experiment: the seed's claims about SDPA's kernels, checked one by one on this device."""

from __future__ import annotations

import torch

__all__ = ["check_claims"]


def check_claims(rows: list, device="cpu") -> list[dict]:
    """Seed 000's claims, checked one by one against ``backend_matrix`` rows from this device.

    Returns ``[{claim, shows, verdict}]`` with verdict "holds", "does not hold" or "holds only on CUDA"...
    """
    dev = torch.device(device).type
    by = lambda case, dt: next((r for r in rows if r["case"].startswith(case) and r["dtype"] == dt), None)
    dts = [d for d in ("bfloat16", "float16", "float32") if by("upstream", d)]
    dt = dts[0]
    up, fast, exact = by("upstream", dt), by("fast", dt), by("exact", dt)
    causal = by("is_causal", dt)
    out = []
    math_op = "aten::_scaled_dot_product_attention_math"
    fell_back = up["kernel"] == math_op
    out.append({"claim": "A bool attn_mask makes SDPA fall back to the math kernel",
                "shows": f"{dt} upstream call ran {up['kernel']} (dispatcher: {up['backend']})",
                "verdict": "holds" if fell_back else f"does not hold on {dev}: a fused kernel takes the mask but "
                                                     f"still reads all {up['keys']} keys"})
    flash_ok = fast["kernel"] is not None and "flash" in fast["kernel"]
    out.append({"claim": "Slicing the cache to position+1 (no mask) lets SDPA use flash attention",
                "shows": f"{dt} sliced call ran {fast['kernel']}",
                "verdict": "holds" if flash_ok else "does not hold"})
    out.append({"claim": "The sliced result differs from upstream only by rounding (~1e-6)",
                "shows": f"fast vs float64: {fast['max_abs_err']:.2e}; upstream vs float64: {up['max_abs_err']:.2e}",
                "verdict": "holds" if fast["correct"] else "does not hold"})
    out.append({"claim": "(fastattn) A window rounded up to a bucket, mask kept inside it, runs the same kernel",
                "shows": f"{dt} exact call ran {exact['kernel']} over {exact['keys']} keys",
                "verdict": "holds" if exact["kernel"] == up["kernel"] else "differs: " + str(exact["kernel"])})
    out.append(_window_claim(device))
    out.append({"claim": "is_causal=True is a safe way to drop the mask for a one-query decode step",
                "shows": f"max |error| vs the correct decode attention: {causal['max_abs_err']:.2f}",
                "verdict": "does not hold: top-left alignment attends to key 0 only" if not causal["correct"]
                else "holds (unexpected)"})
    return out


def _window_claim(device) -> dict:
    """Is a 256-slot bucketed window with the mask kept bit-identical to the full-cache call (this device)?"""
    from ..exactness import calibrate_exact

    rows = {}
    for lq in (1, 5):
        cal = calibrate_exact(device, torch.float32, hq=16, hkv=2, head_dim=128, capacity=2048, lq=lq)
        rows[lq] = (next(r for r in cal["ladder"] if r["candidate"] == 256), cal)
    shows = "; ".join(f"Lq={lq}: " + ("identical" if r["bit_identical"] else
                                     f"differs at length {r['first_diff_length']} (max {r['max_abs_diff']:.1e})")
                      + f" over {r['lengths_checked']} lengths x {r['draws']} draws" for lq, (r, _) in rows.items())
    cal = rows[1][1]
    why = (f"exact only by construction for multiples of the {cal['key_block']}-key block of {cal['kernel']}"
           if cal["key_block"] else f"{cal['kernel']}: no window is exact by construction")
    holds = all(r["bit_identical"] for r, _ in rows.values())
    return {"claim": "(fastattn, first round) A window rounded up to a 256-slot bucket, mask kept inside it, "
                     "is bit-identical to the full-cache call",
            "shows": f"fp32, capacity 2048: {shows}; default exact granularity here: {cal['bucket']}",
            "verdict": ("holds on this device's kernel build, but not by construction: " if holds else
                        "does not hold: ") + why}
