"""Notebook 01's readings: #293 diagnosed from a stream record and the consumer matrix, and the reply to #293.

Pure functions of records; each hypothesis gets one reading: RULES_OUT, REPRODUCES, NEEDS or NOT_MEASURED."""

from __future__ import annotations

from typing import Optional

from fastattn.devices import machine_label

from .bench.stats import fmt_ci
from .bench.stream import stream_trends, stream_verdicts
from .bench.trend import describe

RULES_OUT, REPRODUCES, NEEDS, NOT_MEASURED = ("rules out", "reproduces the shape", "needs the reporter's machine",
                                              "not measured in this run")
RANK = {REPRODUCES: 0, NEEDS: 1, NOT_MEASURED: 2, RULES_OUT: 3}
#: what the post leaves open (it names voxcpm 2.0.2 and discusses optimize() and triton): English, Chinese
ASK = ("which GPU, and how much memory it has (`nvidia-smi` over a long stream shows whether it fills)",
       "Windows or Linux (on Windows without triton the log says `torch.compile disabled`)",
       "whether the slowdown is inside one `generate_streaming` call or across successive calls",
       "what your code does with each chunk (play it, append it, re-encode or resend the whole clip)")
ASK_ZH = ("使用的 GPU 型号和显存大小（长时间流式生成时用 `nvidia-smi` 观察显存是否被占满）",
          "Windows 还是 Linux（Windows 上没有 triton 时日志会显示 `torch.compile disabled`）",
          "变慢是发生在一次 `generate_streaming` 调用之内，还是跨多次调用",
          "每个 chunk 拿到后做了什么（播放、追加，还是重新编码或重新发送整段音频）")
#: times the generator apart from the consumer, chunk by chunk (the reply offers it)
SNIPPET = """import time

chunks = model.generate_streaming(text)  # model = voxcpm.VoxCPM.from_pretrained(...)
t = time.perf_counter()
for i, chunk in enumerate(chunks):
    gen_s = time.perf_counter() - t      # time voxcpm took to produce this chunk
    t0 = time.perf_counter()
    consume(chunk)                       # whatever your app does with it
    use_s = time.perf_counter() - t0
    print(f"chunk {i}: generate {gen_s:.3f} s, consume {use_s:.3f} s", flush=True)
    t = time.perf_counter()"""
#: a public measurement the GPU lead cites (the VoxCPM fork in PRs #363/#366)
VRAM_LEAD = ("a fork measured a progressive 2.3x -> 3.3x slowdown on an 8 GB Windows GPU (driver memory spill), "
             "cured by `torch.cuda.empty_cache()` between requests (#363/#366)")


def diagnosis_findings(rows: list) -> dict:
    """01's findings of #293 from :func:`diagnosis`'s rows: what reproduces its shape, what this run rules out."""
    said = lambda reading, none: "; ".join(r["hypothesis"] for r in rows if r["reading"] == reading) or none
    return {"#293: what reproduces its shape here": said(REPRODUCES, "nothing on this device"),
            "#293: ruled out here": said(RULES_OUT, "nothing")}


def stream_findings(stream: dict) -> dict:
    """01's findings of a ``stream_profile`` record: each variant's trend (today's rule), first and last sixth."""
    n = stream["params"]["chunks"]
    return {**{f"stream, {v}: per-chunk cost along {n} chunks": line for v, line in stream_verdicts(stream).items()},
            **{f"stream, {v}: first / last sixth median ms": f"{s[0]:.1f} / {s[-1]:.1f}"
               for v, s in stream["sixths"].items()}}


def _trend_line(t: dict) -> str:
    ci = t.get("ci")
    return (f"{t['verdict']}, {t['slope_ms_per_100']:+.3g} ms per 100 chunks (95% CI [{ci[0]:+.3g}, {ci[1]:+.3g}]) "
            f"on {t['level_ms']:.4g} ms" if ci else f"{t['verdict']} ({t.get('why', '')})")


def _trends(up: dict, comps: list) -> str:
    return "; ".join(f"{c}: {_trend_line(up[c])}" for c in comps)


def diagnosis(stream: dict, consumers: Optional[dict] = None, device: str = "cpu",
              prompts: Optional[dict] = None, contention: Optional[dict] = None,
              compiles: Optional[dict] = None) -> list:
    """Ranked rows ``{hypothesis, measured here, reading}``: what reproduces the shape first, what rules out last."""
    up = stream_trends(stream).get("upstream", {})  # components only where the chunk was split
    comps = [c for c in ("base_lm", "residual_lm", "dit", "encoder", "vae", "other") if c in up]
    rows = [_attention_row(stream, up)]
    if comps:
        rows.append({"hypothesis": "A part of the generator grows with the chunk index (LMs, DiT, encoder, VAE, "
                                   "fp32 VAE denormals)", "measured here": _trends(up, comps),
                     "brief": _none_grew(up, comps), "reading": _reading({up[c]["verdict"] for c in comps})})
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
        {"hypothesis": "Memory pressure or driver spill on a small GPU", "measured here": "not reproducible on "
         f"this device; {VRAM_LEAD}", "reading": NEEDS},
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


def _none_grew(up: dict, comps: list) -> str:
    ci = {c: up[c]["ci"][1] for c in comps if up[c].get("ci")}
    if not ci or any(up[c]["verdict"] != "flat" for c in comps):
        return _trends(up, comps)
    top = max(ci, key=ci.get)
    return (f"{len(comps)} parts timed apart, each flat; the steepest upper 95% bound is {ci[top]:+.3g} ms per "
            f"100 chunks ({top}, on {up[top]['level_ms']:.4g} ms)")


def _attention_row(stream: dict, up: dict) -> dict:
    """The LM steps' trends where timed apart (attention runs there; a growing DiT says nothing), else the chunk's."""
    lms = [c for c in ("base_lm", "residual_lm") if c in up]
    words = {up[c]["verdict"] for c in lms} or {up.get("verdict") or stream["verdict"]["upstream"].split(" (")[0]}
    row = {"hypothesis": "The full-cache attention (every step reads 8192 slots)"}
    if lms:
        row.update({"measured here": "the LM steps (where attention runs): " + _trends(up, lms),
                    "brief": "the LM steps, where attention runs: " + _none_grew(up, lms)})
    else:
        row["measured here"] = "upstream's whole chunk: " + (describe(up) if up else stream["verdict"]["upstream"])
    row["reading"] = _reading(words)
    return row


def _reading(verdicts: set) -> str:
    """Trend verdicts read: any growth reproduces, all flat or shrinking rules out, anything else needs more."""
    return REPRODUCES if "grows" in verdicts else RULES_OUT if verdicts <= {"flat", "shrinks"} else NEEDS


def _prompt_row(prompts: Optional[dict]) -> dict:
    """A growing prompt delays each call's first step (prefill); it reproduces where a last call waits 3x its first."""
    hyp = "A prompt that grows from call to call (merge_prompt_cache, output fed back as the prompt wav)"
    if not prompts:
        return {"hypothesis": hyp, "measured here": "calls with a growing prompt were not measured in this run",
                "reading": NOT_MEASURED}
    parts, hit, cut = [], False, False
    for way in prompts["params"]["ways"]:
        ok = [r for r in prompts["rows"] if r["mode"] == "upstream" and r["way"] == way and r["error"] is None]
        if len(ok) < 2:
            continue
        grow = ok[-1]["first_ms"] / ok[0]["first_ms"]
        hit |= grow >= 3
        full = prompts["full_at"]["upstream"][way]
        cut |= bool(full) and 1.5 <= grow < 3  # it was growing when the cache filled: where it would stop is unseen
        parts.append(f"{way}: prefix {ok[0]['prefix']} -> {ok[-1]['prefix']}, first step {ok[0]['first_ms']:.0f} -> "
                     f"{ok[-1]['first_ms']:.0f} ms ({grow:.1f}x)" + (f", cache full at call {full}" if full else ""))
    reading = REPRODUCES if hit else NEEDS if cut else RULES_OUT
    why = "; a growth was cut off by the cache filling, so this run cannot rule it out" if reading == NEEDS else ""
    return {"hypothesis": hyp, "measured here": "upstream, " + "; ".join(parts) + why, "reading": reading}


def _consumer_row(consumers: Optional[dict], contention: Optional[dict]) -> dict:
    hyp = "The caller reprocesses the whole clip every chunk (encode, resample, re-send)"
    if not consumers:
        return {"hypothesis": hyp, "measured here": "the consumer matrix was not run", "reading": NOT_MEASURED}
    beside = ""
    if contention:
        ci = f" (95% CI {fmt_ci(contention['ci'])})" if contention.get("ci") else ""
        beside = (f"; the same consumer run in a thread beside the generator, as a streaming server does "
                  f"({contention['params']['chunks']} chunks), made the generator's own chunks take "
                  f"{contention['ratio']:.2f}x as long{ci}")
    hits = [(p, s) for p, s in consumers["summary"].items() if s["reproduces_293"]]
    cheapest = min(consumers["summary"].items(), key=lambda kv: kv[1]["us_per_ksample"])
    if hits:
        what = "; ".join(f"{p} took {s['ms_first']:.3g} ms at chunk 1 and {s['ms_at_400']:.4g} ms at chunk 400 "
                         f"({_per_ksample(s)})" for p, s in hits)
        return {"hypothesis": hyp, "measured here": what + beside, "reading": REPRODUCES}
    return {"hypothesis": hyp, "measured here": f"no pattern reaches +0.7 s by chunk 400 here (cheapest: "
            f"{cheapest[0]}, {_per_ksample(cheapest[1])}){beside}", "reading": RULES_OUT}


def _per_ksample(s: dict) -> str:
    return f"{s['us_per_ksample']:.3g} µs per 1,000 samples of the clip so far"


#: the GPU leads (by how their hypothesis starts): why they fit the post, in English and Chinese
GPU_LEADS = {"CUDA graphs": ("under `optimize()` every input shape not seen before compiles and records another "
                             "CUDA graph (#209, #269 report \"observed N distinct sizes\"); a length that changes "
                             "every chunk would record one per chunk",
                             "在 `optimize()` 下每遇到新形状就重新编译并录制 CUDA graph（#209/#269 报告过 "
                             "\"observed N distinct sizes\"）；如果某个长度每个 chunk 都变，就会每个 chunk 录制一次"),
             "Memory pressure": (VRAM_LEAD, "小显存 GPU 上的显存压力或驱动把显存换出到内存：一个 fork（#363/#366）在 "
                                 "8 GB 的 Windows GPU 上测到逐渐变慢 2.3 倍到 3.3 倍，每次请求后调用 "
                                 "`torch.cuda.empty_cache()` 后消失")}
HYPOTHESES_ZH = {"CUDA graphs": "CUDA graph 重新录制", "Memory pressure": "显存压力",
                 "The caller": "调用方每个 chunk 都重新处理整段音频（编码、重采样、重新发送）",
                 "A prompt": "提示音频或前缀在多次调用之间不断变长", "The full-cache": "对整个 8192 槽缓存做注意力",
                 "A part of": "生成器的某一部分随 chunk 序号变慢"}


def measured_where(stream: dict, machine: Optional[str] = None) -> tuple:
    """What the stream record says was measured, and where (``machine``: its run's label, with the CPU features
    that pick the kernels): (English, Chinese)."""
    env, p = stream.get("env", {}), stream["params"]
    where = machine or (machine_label(env) if {"torch", "threads", "device_name"} <= set(env) else
                        f"{env.get('device', '?')} (torch {env.get('torch', '?')})")
    split = bool(stream_trends(stream).get("upstream", {}).get("dit"))
    six = stream.get("sixths", {}).get("upstream")
    en = (f"{p['chunks']} chunks of `generate_streaming`, the {p['preset']} VoxCPM2 architecture with "
          f"{p.get('weights', 'random')} weights, {p['dtype']}, inference_timesteps={p['inference_timesteps']}, "
          f"{p.get('repeats', 1)} run{'s' * (p.get('repeats', 1) != 1)}, on a {where}, each chunk timed "
          + ("in its parts (LMs, DiT, encoder, VAE)" if split else "whole (not split into parts)"))
    scale = {"full": "完整", "small": "small", "tiny": "tiny"}.get(p["preset"], p["preset"])
    zh = (f"在 {where} 上，用{scale}规模的 VoxCPM2 结构和随机权重"
          f"（{p['dtype']}，inference_timesteps={p['inference_timesteps']}）跑了 {p.get('repeats', 1)} 次 "
          f"`generate_streaming`，每次 {p['chunks']} 个 chunk，" + ("分部件计时" if split else "按整个 chunk 计时"
                                                                  "（未分部件）"))
    if six:
        en += f": upstream's chunk took {six[0] / 1e3:.2f} s in the first sixth and {six[-1] / 1e3:.2f} s in the last"
        zh += f"：开头六分之一每个 chunk {six[0] / 1e3:.2f} 秒，最后六分之一 {six[-1] / 1e3:.2f} 秒"
    return en, zh


def reply_293(rows: list, stream: Optional[dict] = None, fix: Optional[tuple] = None,
              machine: Optional[str] = None) -> str:
    """The reply to OpenBMB/VoxCPM#293 (markdown, English then Chinese): the fix's fate (``fix``: (en, zh) evidence
    under ``optimize()``), where it was measured, the leads ranked, a timing snippet, the questions left open."""
    from .paths import data_dir

    where = measured_where(stream, machine) if stream else ("this run's stream", "本次运行的流式生成")
    fix = fix or ("", "")
    leads = sorted(rows, key=lambda r: (RANK[r["reading"]], not _gpu(r)))  # what reproduced here first
    zh = lambda r: next(v for k, v in HYPOTHESES_ZH.items() if r["hypothesis"].startswith(k))
    parts = {"en": dict(fix=" " + fix[0] if fix[0] else "", where=where[0], snippet=SNIPPET, asks="; ".join(ASK),
                        leads="\n".join(f"{i}. {r['hypothesis']}: {_lead(r, 0)}." for i, r in enumerate(leads, 1))),
             "zh": dict(fix=fix[1], where=where[1], asks="；".join(ASK_ZH),
                        leads="\n".join(f"{i}. {zh(r)}：{_lead(r, 1)}。" for i, r in enumerate(leads, 1)))}
    version = (stream or {}).get("env", {}).get("voxcpm", "2.0.3")
    return "\n\n---\n\n".join((data_dir() / "upstream-prs" / "reply-templates" / f"{lang}.md").read_text().format(
        version=version, **kw) for lang, kw in parts.items())


def _gpu(row: dict) -> Optional[str]:
    return next((k for k in GPU_LEADS if row["hypothesis"].startswith(k)), None)


#: each reading as a lead of the reply says it: English, Chinese
SAID = {REPRODUCES: ("reproduced here", "本机复现了这一形态"), RULES_OUT: ("ruled out here", "本机已排除"),
        NOT_MEASURED: ("not measured in this run", "本次未测"),
        NEEDS: ("needs your machine to decide", "需要您的机器或 GPU 才能判断")}


def _lead(row: dict, lang: int) -> str:
    """Why a lead fits the post (a GPU lead), else its reading; in English with what was measured, if anything."""
    if _gpu(row):
        return GPU_LEADS[_gpu(row)][lang]
    said = SAID[row["reading"]][lang]
    if lang or row["reading"] == NOT_MEASURED:
        return said
    shown = row.get("brief", row["measured here"]) if row["reading"] == RULES_OUT else row["measured here"]
    return f"{said}: {shown}"
