"""Notebook 05's headline findings, read from its records."""

from __future__ import annotations

from ..bench.targets import _row

__all__ = ["headline"]


def headline(att: dict, dec: dict, whole: dict, targets: list, position: int = 256) -> dict:
    """The profiling notebook's findings, read from its records: ratios at ``position``, the whole-decode
    ratio and identity, the LMs' decode-attention share of wall time, and how many targets were met."""
    def at(rec, key, value):
        row = _row(rec["rows"], **{key: value, "position": position})
        return row["median_ms"] if row else float("nan")

    a, d16, d32 = att["float32"], dec["bfloat16"], dec["float32"]
    share = {v: sum(r["lm_attention_s"] for r in whole["rows"] if r["variant"] == v) /
             sum(r["wall_s"] for r in whole["rows"] if r["variant"] == v) for v in ("upstream", "patched")}
    p = whole["params"]
    return {
        f"attention fp32 at p={position}: exact / reference": at(a, "mode", "exact") / at(a, "mode", "reference"),
        f"attention fp32 at p={position}: fast / reference": at(a, "mode", "fast") / at(a, "mode", "reference"),
        f"decode step bf16 at p={position}: patched / upstream":
            at(d16, "variant", "patched") / at(d16, "variant", "upstream"),
        f"decode step fp32 at p={position}: patched / upstream":
            at(d32, "variant", "patched") / at(d32, "variant", "upstream"),
        f"whole decode ({p['preset']}, {p['dtype']}, {p['steps']} steps): patched / upstream wall": whole["ratio"],
        "whole decode output bit-identical": whole["identical"],
        "LM decode attention share of wall time (upstream, patched)":
            f"{share['upstream']:.2f}, {share['patched']:.2f}",
        "targets met": f"{sum(t['passed'] for t in targets)}/{len(targets)}",
    }
