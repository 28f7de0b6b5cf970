"""Notebook 02's experiment: the seed's claims about SDPA's kernels, checked one by one on this device."""

from __future__ import annotations

import torch

from ..claims import math_fallback_verdict, matrix_claims, runtime_rows


def check_claims(rows: list, device="cpu") -> list[dict]:
    """``[{claim, shows, verdict}]``: the ledger's kernel claims on this device's matrix rows (one rule for 02 and the
    ledger), then fastattn's window and the ``is_causal`` trap, in voxcpm's dtype on ``device``."""
    mine = runtime_rows(rows, device)
    by = lambda case: next((r for r in mine if r["case"].startswith(case)), None)
    up, exact, causal = by("upstream"), by("exact"), by("is_causal")
    out = [{"claim": r["claim"], "shows": r["evidence"], "verdict": r["verdict"]}
           for r in matrix_claims({"rows": rows, "env": {"device": str(device)}})]
    out.append({"claim": "(fastattn) A window rounded up to a bucket, mask kept inside it, runs the same kernel",
                "shows": f"{mine[0]['dtype']} exact call ran {exact['kernel']} over {exact['keys']} keys",
                "verdict": "holds" if exact["kernel"] == up["kernel"] else "differs: " + str(exact["kernel"])})
    out.append(_window_claim(device))
    out.append({"claim": "is_causal=True is a safe way to drop the mask for a one-query decode step",
                "shows": f"max |error| vs the correct decode attention: {causal['max_abs_err']:.2f}",
                "verdict": "does not hold: top-left alignment attends to key 0 only" if not causal["correct"]
                else "holds (unexpected)"})
    return out


def findings(rows: list, device, upstream_report, sliced_report, causal_equals_row0: bool, fast_rec: dict) -> dict:
    """02's findings from its reports and matrix, in voxcpm's dtype on ``device``."""
    mine = runtime_rows(rows, device)
    up = next(r for r in mine if r["case"].startswith("upstream") and r["head_dim"] == upstream_report.call["q"][3])
    no_gqa = next((r for r in mine if r["case"].startswith("bool mask, no enable_gqa")), None)
    causal = next(r for r in mine if r["case"].startswith("is_causal"))
    verdict, why = math_fallback_verdict(up, no_gqa)
    return {
        "dtype of these findings (voxcpm's on this device)": mine[0]["dtype"],
        "dispatcher's choice for upstream's masked call": upstream_report.backend,
        "kernel op that ran for upstream's masked call": upstream_report.kernel,
        "helper ops of upstream's masked call": ", ".join(o for o in upstream_report.ops
                                                          if o != upstream_report.kernel),
        "kernel op that ran for the sliced call": sliced_report.kernel,
        "bool mask forces the math kernel here": verdict == "holds",
        "why (the matrix's rows)": why,
        "is_causal=True with one query equals value row 0": causal_equals_row0,
        "max |is_causal - correct (float64)|, the matrix's draw": causal["max_abs_err"],
        **{f"fast's implementation here, {r['class']}": r["candidate"] for r in fast_rec["rows"] if r["winner"]},
    }


def key_findings(items: dict) -> list:
    return ["kernel op that ran for upstream's masked call", "kernel op that ran for the sliced call",
            "bool mask forces the math kernel here"] + [k for k in items if k.startswith("fast's implementation "
                                                                                      "here, float32")]


def _window_claim(device) -> dict:
    """Is a 256-slot bucketed window with the mask kept bit-identical to the full-cache call (this device)?"""
    from fastattn.exactness import calibrate_exact

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
