"""Notebook 01's readings: #293 diagnosed from the stream's per-component trends and the consumer matrix.

Pure functions of records (``stream_profile(components=True)``, ``consumer_matrix``); they measure nothing. Each
hypothesis for "streaming slows from ~0.3 s to 1-2 s per chunk after 400+ chunks" gets its measured effect on this
device and one of three readings: it ``RULES_OUT``, it ``REPRODUCES`` the shape, or it ``NEEDS`` the reporter's
machine (or a GPU) to decide.
"""

from __future__ import annotations

from typing import Optional

from ..bench.stats import fmt_ci

__all__ = ["diagnosis", "reply_293", "RULES_OUT", "REPRODUCES", "NEEDS", "NOT_MEASURED", "ASK"]

RULES_OUT, REPRODUCES, NEEDS, NOT_MEASURED = ("rules out", "reproduces the shape", "needs the reporter's machine",
                                              "not measured in this run")
RANK = {REPRODUCES: 0, NEEDS: 1, NOT_MEASURED: 2, RULES_OUT: 3}
#: what to ask the reporter, whatever this run found
ASK = ("device and OS (CPU model, or GPU and its memory)", "whether `optimize()` is on (the default `VoxCPM(...)` "
       "turns it on)", "torch and voxcpm versions", "what a \"chunk\" is in their code and what they do with each one "
       "(concatenate, encode, resample, send)", "the generator's time per chunk logged apart from the consumer's")


def _trend_line(t: dict) -> str:
    ci = t.get("ci")
    return (f"{t['verdict']}, {t['slope_ms_per_100']:+.2f} ms per 100 chunks (95% CI [{ci[0]:+.2f}, {ci[1]:+.2f}]) "
            f"on {t['level_ms']:.1f} ms" if ci else f"{t['verdict']} ({t.get('why', '')})")


def diagnosis(stream: dict, consumers: Optional[dict] = None, device: str = "cpu",
              prompts: Optional[dict] = None, contention: Optional[dict] = None,
              compiles: Optional[dict] = None) -> list:
    """Ranked rows ``{hypothesis, measured here, reading}``: what reproduces the shape first, what rules out last."""
    up = stream["trend"]["upstream"]
    comps = [c for c in ("base_lm", "residual_lm", "dit", "encoder", "vae", "other") if c in up]
    grows = [c for c in comps if up[c]["verdict"] == "grows"]
    unsure = [c for c in comps if up[c]["verdict"] == "inconclusive"]
    rows = [_attention_row(stream, up, comps)]
    if comps:
        detail = "; ".join(f"{c}: {_trend_line(up[c])}" for c in comps)
        rows.append({"hypothesis": "A part of the generator grows with the chunk index (LMs, DiT, encoder, VAE, "
                                   "fp32 VAE denormals)", "measured here": detail,
                     "reading": REPRODUCES if grows else (NEEDS if unsure else RULES_OUT)})
    else:
        rows.append({"hypothesis": "A part of the generator grows with the chunk index",
                     "measured here": "components were not timed (stream_profile(components=True))",
                     "reading": NOT_MEASURED})
    rows.append(_consumer_row(consumers, contention))
    gpu = str(device).startswith("cuda")
    rows += [
        {"hypothesis": "CUDA graphs recorded per new shape under optimize() (#209/#269)",
         "measured here": ("a GPU-only path: `python -m fastattn gpu-check` streams 600 chunks under optimize()"
                           if not gpu else "see gpu-check's stream_under_optimize record") + _compile_line(compiles),
         "reading": NEEDS},
        {"hypothesis": "Memory pressure on a small GPU (8 GB)", "measured here": "not reproducible on this device",
         "reading": NEEDS},
        _prompt_row(prompts),
    ]
    return sorted(rows, key=lambda r: RANK[r["reading"]])


def _compile_line(c: Optional[dict]) -> str:
    """The CPU counterpart (``bench.compile_counts``): graphs dynamo compiled per variant over the same steps."""
    if not c:
        return "; on CPU, `python -m fastattn bench compile-counts` counts recompiles per step"
    limit = c["params"].get("recompile_limit")
    return f"; on CPU over {c['params']['steps']} steps, graphs compiled: " + "; ".join(
        f"{r['variant']} {r['unique_graphs']}" for r in c["rows"]) + \
        (f" (dynamo stops recompiling a function at {limit} graphs and runs the rest eagerly)" if limit else "")


def _attention_row(stream: dict, up: dict, comps: list) -> dict:
    """The full-cache attention lives in the LM steps: where they were timed apart, their trends decide (a chunk
    that grows because its DiT grows says nothing about attention); else the whole chunk's trend."""
    hyp = "The full-cache attention (every step reads 8192 slots)"
    lms = [up[c] for c in ("base_lm", "residual_lm") if c in up]
    if comps and lms:
        words = {t["verdict"] for t in lms}
        reading = REPRODUCES if "grows" in words else (RULES_OUT if words <= {"flat", "shrinks"} else NEEDS)
        return {"hypothesis": hyp, "measured here": "the LM steps (where attention runs): " + "; ".join(
            f"{c}: {_trend_line(up[c])}" for c in ("base_lm", "residual_lm") if c in up), "reading": reading}
    reading = RULES_OUT if up["verdict"] in ("flat", "shrinks") else (REPRODUCES if up["verdict"] == "grows"
                                                                     else NEEDS)
    return {"hypothesis": hyp, "measured here": f"upstream's whole chunk: {stream['verdict']['upstream']}",
            "reading": reading}


def _prompt_row(prompts: Optional[dict]) -> dict:
    """Calls whose prompt grows: the time to each call's first step grows with the prefix (prefill, re-encoding);
    it reproduces the shape where some way's last call waits 3x its first call or more."""
    hyp = "A prompt that grows from call to call (merge_prompt_cache, output fed back as the prompt wav)"
    if not prompts:
        return {"hypothesis": hyp, "measured here": "calls with a growing prompt were not measured in this run",
                "reading": NOT_MEASURED}
    parts, hit = [], False
    for way in prompts["params"]["ways"]:
        ok = [r for r in prompts["rows"] if r["mode"] == "upstream" and r["way"] == way and r["error"] is None]
        if len(ok) < 2:
            continue
        grow = ok[-1]["first_ms"] / ok[0]["first_ms"]
        hit |= grow >= 3
        full = prompts["full_at"]["upstream"][way]
        parts.append(f"{way}: prefix {ok[0]['prefix']} -> {ok[-1]['prefix']}, first step {ok[0]['first_ms']:.0f} -> "
                     f"{ok[-1]['first_ms']:.0f} ms ({grow:.1f}x)" + (f", cache full at call {full}" if full else ""))
    return {"hypothesis": hyp, "measured here": "upstream, " + "; ".join(parts), "reading": REPRODUCES if hit
            else RULES_OUT}


def _contention_line(c: Optional[dict]) -> str:
    if not c:
        return ""
    ci = f" (95% CI {fmt_ci(c['ci'])})" if c.get("ci") else ""
    return (f"; run in a thread beside the generator ({c['params']['pattern']}, {c['params']['chunks']} chunks), "
            f"the generator's own chunks took {c['ratio']:.2f}x{ci}")


def _consumer_row(consumers: Optional[dict], contention: Optional[dict] = None) -> dict:
    hyp = "The caller reprocesses the whole clip every chunk (encode, resample, re-send)"
    if not consumers:
        return {"hypothesis": hyp, "measured here": "the consumer matrix was not run", "reading": NOT_MEASURED}
    beside = _contention_line(contention)
    hits = [(p, s) for p, s in consumers["summary"].items() if s["reproduces_293"]]
    cheapest = min(consumers["summary"].items(), key=lambda kv: kv[1]["us_per_ksample"])
    if hits:
        what = "; ".join(f"{p}: {s['ms_first']:.1f} ms at chunk 1, {s['ms_at_400']:.0f} ms at chunk 400 "
                         f"({s['us_per_ksample']:.1f} us per 1k samples so far)" for p, s in hits)
        return {"hypothesis": hyp, "measured here": what + beside, "reading": REPRODUCES}
    return {"hypothesis": hyp, "measured here": f"no pattern reaches +0.7 s by chunk 400 here (cheapest: "
            f"{cheapest[0]}, {cheapest[1]['us_per_ksample']:.2f} us per 1k samples){beside}", "reading": RULES_OUT}


def reply_293(rows: list) -> str:
    """A short reply for OpenBMB/VoxCPM #293 in markdown: what was measured, what it rules out, what it most likely
    is, and what to ask the reporter."""
    out = [r for r in rows if r["reading"] == RULES_OUT]
    hit = [r for r in rows if r["reading"] == REPRODUCES]
    lines = ["We timed a long `generate_streaming` run chunk by chunk, split into the base LM, residual LM, local DiT, "
             "feature encoder and streaming VAE, twice with the order alternated, chunks that other processes "
             "disturbed left out, and a trend from a robust slope with a bootstrap interval.", ""]
    if out:
        lines += ["Ruled out on this machine:"] + [f"- {r['hypothesis']}: {r['measured here']}" for r in out] + [""]
    if hit:
        lines += ["Reproduces the 0.3 s -> 1-2 s shape:"] + [f"- {r['hypothesis']}: {r['measured here']}"
                                                           for r in hit] + [""]
    lines += ["Could you tell us: " + "; ".join(ASK) + "?"]
    return "\n".join(lines)
