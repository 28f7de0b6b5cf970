"""Figures from records: pure functions returning matplotlib figures; they never run a benchmark or a model."""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

import matplotlib.pyplot as plt

from .bench import dtype_table
from .bench.metrics import default_key, kv_mb
from .bench.stats import fmt_ci
from .bench.stream import COMPONENTS, stream_trends
from .bench.targets import met_word
from .paths import load_published  # noqa: F401 - re-exported: 05 reads the seeds through plots
from .tables import fmt, html_table

COLORS = {"reference": "#c0392b", "upstream": "#c0392b", "exact": "#2471a3", "patched": "#2471a3",
          "fast": "#27ae60", "slice_fix": "#8e44ad", "gemm_floor": "#d68910", "floor": "#7f8c8d"}


def _rows(rec, **match):
    return [r for r in rec["rows"] if all(r.get(k) == v for k, v in match.items())]


def _spread(ax, rows, label, color):
    ax.errorbar([r["position"] for r in rows], [r["median_ms"] for r in rows],
                yerr=[[r["median_ms"] - r["p10_ms"] for r in rows], [r["p90_ms"] - r["median_ms"] for r in rows]],
                marker="o", ms=4, capsize=2, label=label, color=color)


def _finish(fig, ax, title: str, legend: Optional[int] = 8, grid: bool = True, loc: Optional[str] = None):
    """Title, a legend in ``legend`` points (None: no legend), the grid, tight layout."""
    ax.set_title(title, fontsize=9)
    if legend:
        ax.legend(fontsize=legend, loc=loc)
    if grid:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _samples(rec) -> str:
    ns = {r["n"] for r in rec.get("rows", []) if isinstance(r.get("n"), int)}
    if ns:
        return f"n={min(ns)}" if len(ns) == 1 else f"n={min(ns)}-{max(ns)}"
    reps = [r for r in rec.get("rows", []) if "repeat" in r]
    if reps:
        return f"n={len(reps) // max(1, len({r['variant'] for r in reps}))} per variant"
    return ""


def _title(rec, what: str) -> str:
    env, n = rec.get("env", {}), _samples(rec)
    return (f"{what}\n{env.get('device_name', '')} · torch {env.get('torch', '')} · {env.get('threads', '')} threads"
            + (f" · {n}" if n else ""))


def attention_sweep(rec: dict, *, ax=None, log: bool = True, show_floor: bool = True):
    """ms per attention call vs position for each mode, with the bandwidth floor."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4.2))
    for mode in rec["params"]["modes"]:
        _spread(ax, _rows(rec, mode=mode), mode, COLORS.get(mode))
    if show_floor:
        rows = _rows(rec, mode=rec["params"]["modes"][0])
        ax.plot([r["position"] for r in rows], [r["floor_ms"] for r in rows], ls="--", color=COLORS["floor"],
                label=f"floor: live K/V at {rec['bandwidth']['gb_per_s']:.1f} GB/s")
    ax.set(xlabel="position p (length p + 1)", ylabel="ms per call (median, p10-p90)")
    if log:
        ax.set_yscale("log")
    p = rec["params"]
    fits = any(r.get("floor_meaningful") is False for r in rec["rows"])  # the record says: within the LLC
    cold = (f", K/V rotated over {p['caches']} caches" + (" (within the last-level cache)" if fits else ", cold")
            if p.get("caches", 1) > 1 else "")
    return _finish(fig, ax, _title(rec, f"one decode attention call: capacity {p['capacity']}, {p['dtype']}, "
                                        f"{p['hq']}/{p['hkv']} heads, d {p['head_dim']}{cold}"))


def decode_step(rec: dict, *, ax=None):
    """Per-token decode-step time vs position, upstream vs patched (and the slice fix where it was timed)."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4))
    for v in ("upstream", "patched", "slice_fix"):
        if rows := _rows(rec, variant=v):
            _spread(ax, rows, v, COLORS[v])
    p = rec["params"]
    ax.set(xlabel="position p", ylabel=f"ms per token ({p['layers']} layers)", ylim=(0, None))
    return _finish(fig, ax, _title(rec, f"MiniCPM decode step, hidden {p['hidden']}, {p['heads']}/{p['kv_heads']} "
                                        f"heads, {p['dtype']}"))


PARTS = ("base_lm_s", "residual_lm_s", "local_dit_s", "local_encoder_s", "rest_s")


def breakdown(rec: dict, *, ax=None):
    """Stacked per-component time of a whole decode, per variant (median over repeats)."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4))
    variants = ["upstream", "patched"]
    bottoms = [0.0, 0.0]
    cmap = plt.get_cmap("tab10")
    for i, part in enumerate(PARTS):
        vals = [statistics.median(r[part] for r in _rows(rec, variant=v)) for v in variants]
        ax.bar(variants, vals, bottom=bottoms, label=part[:-2].replace("_", " "), color=cmap(i))
        bottoms = [b + x for b, x in zip(bottoms, vals)]
    att = [statistics.median(r["lm_attention_s"] for r in _rows(rec, variant=v)) for v in variants]
    for i, a in enumerate(att):
        ax.annotate(f"LM decode attention: {a:.2f} s", (i, bottoms[i]), ha="center", va="bottom", fontsize=8)
    p = rec["params"]
    ax.set_ylabel("seconds (median over repeats)")
    return _finish(fig, ax, _title(rec, f"whole decode: {p['preset']} preset, {p['dtype']}, {p['steps']} steps, "
                                        f"{p['inference_timesteps']} DiT steps"), grid=False, loc="upper right")


def step_split(rec: dict):
    """A ``step_split`` record: per component, its time (with its 95% interval) against its floor, step and prefill."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, phase in zip(axes, ("step", "prefill")):
        rows = _rows(rec, phase=phase)
        y = range(len(rows))
        ms = [r["time_s"] * 1e3 for r in rows]
        err = [[m - (r["time_ci"][0] * 1e3 if r["time_ci"] else m) for m, r in zip(ms, rows)],
               [(r["time_ci"][1] * 1e3 if r["time_ci"] else m) - m for m, r in zip(ms, rows)]]
        ax.barh(y, ms, xerr=err, color=COLORS["patched"], label="measured (median, 95% CI)", height=0.6)
        ax.barh(y, [r["floor_s"] * 1e3 for r in rows], color=COLORS["floor"], label="floor (bytes or FLOPs)",
                height=0.3)
        ax.set_yticks(list(y), [r["component"] for r in rows], fontsize=8)
        s = rec["phases"][phase]
        ax.set_xlabel(f"ms ({phase}: {s['wall_s'] * 1e3:.0f} ms measured, floor {s['floor_s'] * 1e3:.0f} ms, "
                      f"efficiency {s['efficiency']:.2f})", fontsize=8)
        ax.set_title(phase, fontsize=9)
        ax.legend(fontsize=7)
    p = rec["params"]
    fig.suptitle(_title(rec, f"a decode step against the machine: {p['preset']} preset, {p['dtype']}, {p['mode']}, "
                              f"{p['inference_timesteps']} DiT steps"), fontsize=9)
    fig.tight_layout()
    return fig


def dtype_decode(rec: dict, *, ax=None):
    """A ``dtype_decode`` record: median step per dtype and variant, its ratio to voxcpm's default with 95% interval."""
    rows = dtype_table(rec)
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 3.8))
    vals = [r["step s"] for r in rows]
    ax.bar([f"{r['dtype']}\n{r['variant']}" for r in rows], vals, color=[COLORS[r["variant"]] for r in rows])
    key = default_key(rows[0])
    for i, r in enumerate(rows):
        ci = "" if r["95% low"] is None else f"\n[{r['95% low']:.2f}, {r['95% high']:.2f}]"
        mem = f"\npeak {r['peak GB']:.1f} GB" if r["peak GB"] and r["variant"] == "upstream" else ""
        ax.annotate(f"{r[key]:.2f}x{ci}{mem}", (i, vals[i]), ha="center", va="bottom", fontsize=7)
    ax.set(ylabel="s per decode step (median)", ylim=(0, max(vals) * 1.45))
    p = rec["params"]
    return _finish(fig, ax, _title(rec, f"whole decode per dtype: {p['preset']} preset, {p['inference_timesteps']} DiT "
                                        f"steps; ratio to {key[2:]}"), legend=None, grid=False)


def memory(kv: dict, *, ax=None):
    """KV bytes of one request, upstream vs patched."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(6, 3.6))
    vals = list(kv_mb(kv))
    p = kv["params"]
    ax.bar([f"upstream ({p['max_length']} slots)", "patched (right-sized)"], vals,
           color=[COLORS["upstream"], COLORS["patched"]])
    for i, v in enumerate(vals):
        ax.annotate(f"{v:.1f} MB", (i, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("KV cache MB (both LMs)")
    return _finish(fig, ax, f"KV of one request: {p['preset']} preset, {p['dtype']}, prefill {p['prefill']} + "
                            f"{p['steps']} steps", legend=None, grid=False)


def published_vs_ours(published: Sequence[dict], ours: Optional[dict] = None, *, ax=None):
    """Seed 000's per-position ms/step (GPU) beside our decode-step sweep (this device): its "slice fix" beside our
    ``slice_fix`` (like for like), with our ``patched`` step dotted where the record has it."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4))
    for v, color in (("upstream", COLORS["upstream"]), ("slice fix", COLORS["slice_fix"])):
        rows = [r for r in published if r["variant"] == v]
        ax.plot([int(r["position"]) for r in rows], [float(r["ms_per_step"]) for r in rows], ls="-", marker="s",
                color=color, label=f"seed 000 ({rows[0]['platform']}): {v}")
    if ours is not None:
        for v, style in (("upstream", "--"), ("slice_fix", "--"), ("patched", ":")):
            rows = _rows(ours, variant=v)
            if rows:
                ax.plot([r["position"] for r in rows], [r["median_ms"] for r in rows], ls=style, marker="o",
                        color=COLORS[v], label=f"ours ({ours['env'].get('device_name', '')[:28]}, "
                                               f"{ours['params']['layers']} layers): {v}")
    ax.set(xlabel="position", ylabel="ms per decode step", yscale="log")
    return _finish(fig, ax, "published (different hardware and model depth) beside ours: the shape, not the level, "
                            "compares", legend=7)


def exactness(rows: Sequence[dict], *, ax=None):
    """|fast - reference| and |exact - reference| vs position, with bit-identity shown as markers."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8)) if ax is None else (ax.figure, ax)
    for dt in sorted({r["dtype"] for r in rows}):
        rr = [r for r in rows if r["dtype"] == dt]
        axes[0].semilogy([r["position"] for r in rr], [max(r["fast_max_abs"], 1e-12) for r in rr], ".", ms=2,
                         label=f"fast vs reference, {dt}")
        axes[0].semilogy([r["position"] for r in rr], [max(r["reference_vs_f64"], 1e-12) for r in rr], "-", lw=0.6,
                         label=f"reference vs float64, {dt}")
        axes[1].plot([r["position"] for r in rr], [r["exact_identical"] for r in rr], ".", ms=2,
                     label=f"exact == reference ({sum(r['exact_identical'] for r in rr)}/{len(rr)}), {dt}")
    for a, label in zip(axes, ("max |diff|", "bit-identical (1 = yes)")):
        a.set(xlabel="position", ylabel=label)
        a.legend(fontsize=7)
    axes[1].set_ylim(-0.1, 1.1)
    fig.tight_layout()
    return fig


def _backend_cell(v) -> str:
    v = f"{v:.2e}" if isinstance(v, float) else ", ".join(v) if isinstance(v, list) else v
    return str(v).replace("aten::_scaled_dot_product_", "sdpa::")


def backend_table(rows: Sequence[dict]):
    """A compact HTML table of backend_matrix rows (for notebooks)."""
    return html_table(rows, ["case", "dtype", "head_dim", "backend", "kernel", "helpers", "max_abs_err", "correct"],
                      text=_backend_cell)


def _choice_table(rows: list, cols: Optional[list], chosen) -> str:
    bold = lambda r, c, s: f"<td><b>{s} (chosen)</b></td>" if c == "candidate" and chosen(r) else f"<td>{s}</td>"  # noqa: E731
    return html_table(rows, cols, td=bold)


def fast_choice_table(rec: dict) -> str:
    """HTML table of a ``fast_choice`` record: every candidate per call class, the winner in bold."""
    cols = ["class", "candidate", "max_err", "reference_max_err", "accepted", "median_ms", "probe_only", "broken"]
    return _choice_table(rec["rows"], cols, lambda r: r["winner"])


def graph_choice_table(choice: dict) -> str:
    """HTML table of :func:`fastattn.fast.graph_choice`: each form's status, error, graphs, ms per probe position."""
    rows = [{"candidate": c["form"], "available": c["available"] or c["reason"], "max_err": c["max_err"],
             "upstream_err": c["reference_err"], "accepted": c["accepted"],
             "graphs (bound)": None if c["graphs"] is None else f"{c['graphs']} ({c['graph_bound']})",
             "deterministic": c["deterministic"],
             **{f"ms at {p}": (c.get("per_position_ms") or {}).get(p) for p in choice["probe_lengths"]}}
            for c in choice["candidates"]]
    return _choice_table(rows, None, lambda r: r["candidate"] == choice["winner"])  # every key of a row, in order


def _finish_chunks(fig, ax, title: str):
    ax.set(xlabel="chunk (one decode step each)", ylabel="ms per chunk", ylim=(0, None))
    return _finish(fig, ax, title)


def _rolling_median(y: list, window: int) -> list:
    return [statistics.median(y[max(0, i - window // 2):i + window // 2 + 1]) for i in range(len(y))]


def stream(rec: dict, *, ax=None, window: int = 25):
    """ms per streamed chunk vs chunk index for each variant: every chunk faint, a rolling median bold."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4))
    for v in rec["params"]["modes"]:
        rows = [r for r in _rows(rec, variant=v, repeat=0) if r["chunk"] > 0]
        x, y = [r["chunk"] for r in rows], [r["ms"] for r in rows]
        color = COLORS.get(v)
        ax.plot(x, y, lw=0.5, alpha=0.35, color=color)
        word = stream_trends(rec).get(v, {}).get("verdict") or rec["verdict"][v].split(" (")[0]
        ax.plot(x, _rolling_median(y, window), lw=2, color=color, label=f"{v}: {word}")
        bad = [r for r in rec["rows"] if r["variant"] == v and r.get("disturbed") and r["chunk"] > 0]
        if bad:  # chunks another process disturbed: shown, left out of the verdict
            ax.scatter([r["chunk"] for r in bad], [r["ms"] for r in bad], marker="x", s=12, color=color,
                       label=f"{v}: {len(bad)} disturbed chunks (all repeats)")
    p = rec["params"]
    return _finish_chunks(fig, ax, _title(rec, f"generate_streaming, {p['preset']} preset, {p['dtype']}, "
                                               f"{p['chunks']} chunks (repeat 0, rolling median of {window})"))


def stream_components(rec: dict, *, variant: str = "upstream", ax=None, window: int = 25):
    """A ``stream_profile(components=True)`` record: each component's rolling-median ms per chunk, with its trend."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4))
    rows = [r for r in _rows(rec, variant=variant, repeat=0) if r["chunk"] > 0 and not r["disturbed"]]
    cmap = plt.get_cmap("tab10")
    for i, c in enumerate(COMPONENTS):
        ax.plot([r["chunk"] for r in rows], _rolling_median([r["components"][c] for r in rows], window), lw=1.6,
                color=cmap(i), label=f"{c}: {rec['trend'][variant][c]['verdict']}")
    p = rec["params"]
    return _finish_chunks(fig, ax, _title(rec, f"where a chunk's time goes: {variant}, {p['preset']} preset, "
                                               f"{p['dtype']} (repeat 0, quiet chunks, rolling median of {window})"))


def consumers(rec: dict, *, ax=None):
    """A ``consumer_matrix`` record: each pattern's ms for the newest chunk vs chunk index, #293's 1-2 s as a band."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4))
    for name in rec["summary"]:
        rows = [r for r in rec["rows"] if r["pattern"] == name]
        ax.plot([r["chunk"] for r in rows], [max(r["ms"], 1e-4) for r in rows], marker="o", ms=3, label=name)
    ax.axhspan(1000, 2000, color="0.85", zorder=0, label="#293: 1-2 s per chunk after 400+")
    ax.set(yscale="log", xlabel="chunk index (clip length = index x one chunk)",
           ylabel="ms the consumer spends on that chunk")
    return _finish(fig, ax, _title(rec, f"the caller's side: reprocessing the whole clip every chunk "
                                        f"({rec['params']['chunk_samples']} samples per chunk)"))


def targets_table(targets: list) -> str:
    def row(t):
        ci = "" if t.get("ci_low") is None else fmt_ci((t["ci_low"], t["ci_high"]))
        met = met_word(t) or "n/a"
        return {"target": t["target"], "measured": fmt(t["measured"]), "95% CI": ci, "n": t.get("n") or "",
                "goal": t["goal"], "met": met.upper() if met == "no" else met, "note": t.get("note", "")}
    return html_table([row(t) for t in targets], ["target", "measured", "95% CI", "n", "goal", "met", "note"],
                      text=str)
