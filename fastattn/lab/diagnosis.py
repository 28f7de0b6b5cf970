"""Notebook 01's readings: #293 diagnosed from a stream record and the consumer matrix, and the reply to #293.

Pure functions of records; each hypothesis gets one reading: RULES_OUT, REPRODUCES, NEEDS or NOT_MEASURED."""

from __future__ import annotations

from typing import Optional

from .bench.stats import fmt_ci
from .bench.stream import COMPONENTS, stream_trends, stream_verdicts
from .bench.trend import describe
from .machine import machine_label

RULES_OUT, REPRODUCES, NEEDS, NOT_MEASURED = ("rules out", "reproduces the shape", "needs the reporter's machine",
                                              "not measured in this run")
RANK = {REPRODUCES: 0, NEEDS: 1, NOT_MEASURED: 2, RULES_OUT: 3}
#: what the post leaves open (it names voxcpm 2.0.2 and discusses optimize() and triton): English, Chinese
ASK = ("your GPU and its memory", "Windows or Linux", "whether the slowdown is within one call or across calls",
       "what your code does with each chunk")
ASK_ZH = ("GPU 型号和显存大小（`nvidia-smi` 是否显示显存被占满？）",
          "Windows 还是 Linux（没有 triton 时日志会显示 `torch.compile disabled`）",
          "变慢是发生在一次 `generate_streaming` 调用之内，还是跨多次调用",
          "每个 chunk 拿到后您的代码做了什么")
#: times the generator apart from the consumer, chunk by chunk (the reply offers it)
SNIPPET = """import time

t = time.perf_counter()
for i, chunk in enumerate(model.generate_streaming(text)):
    gen = time.perf_counter() - t
    t0 = time.perf_counter()
    consume(chunk)  # your code
    print(f"chunk {i}: generate {gen:.3f} s, consume {time.perf_counter() - t0:.3f} s", flush=True)
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
            **{f"stream, {v}: first / last sixth median ms": " / ".join(f"{x:.{int(x < 1000)}f}" for x in (s[0], s[-1]))
               for v, s in stream["sixths"].items()}}


def _trend_line(t: dict) -> str:
    ci = t.get("ci")
    return (f"{t['verdict']}, {t['slope_ms_per_100']:+.3g} ms per 100 chunks (95% CI [{ci[0]:+.3g}, {ci[1]:+.3g}]) "
            f"on {t['level_ms']:.4g} ms" if ci else f"{t['verdict']} ({t.get('why', '')})")


def _trends(up: dict, comps: list) -> str:
    return "; ".join(f"{c}: {_trend_line(up[c])}" for c in comps)


def _row(hypothesis: str, measured: str, reading: str, **brief) -> dict:
    """One hypothesis's row; ``brief``: its shorter reading for the reply, where it has one."""
    return {"hypothesis": hypothesis, "measured here": measured, **brief, "reading": reading}


def diagnosis(stream: dict, consumers: Optional[dict] = None, device: str = "cpu",
              prompts: Optional[dict] = None, contention: Optional[dict] = None,
              compiles: Optional[dict] = None) -> list:
    """Ranked rows ``{hypothesis, measured here, reading}``: what reproduces the shape first, what rules out last."""
    up = stream_trends(stream).get("upstream", {})  # components only where the chunk was split
    comps = [c for c in COMPONENTS if c in up]
    parts = "A part of the generator grows with the chunk index"
    rows = [_attention_row(stream, up),
            _row(f"{parts} (LMs, DiT, encoder, VAE, fp32 VAE denormals)", _trends(up, comps),
                 _reading({up[c]["verdict"] for c in comps}), brief=_none_grew(up, comps)) if comps else
            _row(parts, "components were not timed (stream_profile(components=True))", NOT_MEASURED),
            _consumer_row(consumers, contention),
            _row("CUDA graphs recorded per new shape under optimize() (#209/#269)",
                 ("see gpu-check's stream_under_optimize record" if str(device).startswith("cuda") else
                  "a GPU-only path: `python -m fastattn gpu-check` streams 600 chunks under optimize()")
                 + _compile_line(compiles), NEEDS),
            _row("Memory pressure or driver spill on a small GPU", f"not reproducible on this device; {VRAM_LEAD}",
                 NEEDS),
            _prompt_row(prompts)]
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
    hyp = "The full-cache attention (every step reads 8192 slots)"
    lms = [c for c in ("base_lm", "residual_lm") if c in up]
    if not lms:
        return _row(hyp, "upstream's whole chunk: " + (describe(up) if up else stream["verdict"]["upstream"]),
                    _reading({up.get("verdict") or stream["verdict"]["upstream"].split(" (")[0]}))
    return _row(hyp, "the LM steps (where attention runs): " + _trends(up, lms),
                _reading({up[c]["verdict"] for c in lms}), brief="the LM steps, where attention runs: " +
                _none_grew(up, lms))


def _reading(verdicts: set) -> str:
    """Trend verdicts read: any growth reproduces, all flat or shrinking rules out, anything else needs more."""
    return REPRODUCES if "grows" in verdicts else RULES_OUT if verdicts <= {"flat", "shrinks"} else NEEDS


def _prompt_row(prompts: Optional[dict]) -> dict:
    """A growing prompt delays each call's first step (prefill); it reproduces where a last call waits 3x its first."""
    hyp = "A prompt that grows from call to call (merge_prompt_cache, output fed back as the prompt wav)"
    if not prompts:
        return _row(hyp, "calls with a growing prompt were not measured in this run", NOT_MEASURED)
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
    return _row(hyp, "upstream, " + "; ".join(parts) + why, reading)


def _consumer_row(consumers: Optional[dict], contention: Optional[dict]) -> dict:
    hyp = "The caller reprocesses the whole clip every chunk (encode, resample, re-send)"
    if not consumers:
        return _row(hyp, "the consumer matrix was not run", NOT_MEASURED)
    beside = ""
    if contention:
        ci = f" (95% CI {fmt_ci(contention['ci'])})" if contention.get("ci") else ""
        beside = (f"; the same consumer run in a thread beside the generator, as a streaming server does "
                  f"({contention['params']['chunks']} chunks), made the generator's own chunks take "
                  f"{contention['ratio']:.2f}x as long{ci}")
    hits = _took(consumers, cost=True)
    if hits:
        return _row(hyp, hits + beside, REPRODUCES)
    cheapest = min(consumers["summary"].items(), key=lambda kv: kv[1]["us_per_ksample"])
    return _row(hyp, f"no pattern reaches +0.7 s by chunk 400 here (cheapest: {cheapest[0]}, "
                f"{_per_ksample(cheapest[1])}){beside}", RULES_OUT)


def _took(consumers: Optional[dict], cost: bool = False) -> str:
    """The consumer patterns that grow as #293's chunks do, in words ("" for none); ``cost``: with their cost."""
    return "; ".join(f"{p} took {s['ms_first']:.3g} ms at chunk 1 and {s['ms_at_400']:.4g} ms at chunk 400"
                     + (f" ({_per_ksample(s)})" if cost else "")
                     for p, s in ((consumers or {}).get("summary") or {}).items() if s["reproduces_293"])


def _per_ksample(s: dict) -> str:
    return f"{s['us_per_ksample']:.3g} µs per 1,000 samples of the clip so far"


#: the reply's cheapest tests, before any lead (each rules a GPU lead in or out): English, Chinese
TESTS = (("One run with `VoxCPM.from_pretrained(..., optimize=False)`: if the slowdown goes, suspect CUDA graphs "
          "recorded per new shape (#209, #269)",
          "用 `VoxCPM.from_pretrained(..., optimize=False)` 跑一次："
          "如果不再变慢，就要怀疑每遇到新形状就重新录制的 CUDA graph（#209、#269）"),
         ("`TORCH_LOGS=recompiles,cudagraphs`: a recompile or new CUDA graph per chunk shows in the log",
          "设置 `TORCH_LOGS=recompiles,cudagraphs`：如果每个 chunk 都重新编译或录制新的 CUDA graph，日志里会显示"),
         ("On a small GPU, `torch.cuda.empty_cache()` between calls: it cured a 2.3x -> 3.3x slowdown on an 8 GB "
          "GPU in a fork (#363/#366)",
          "显存较小的 GPU 上，在两次调用之间调用 `torch.cuda.empty_cache()`：一个 fork（#363/#366）在 8 GB 的 GPU 上"
          "用它消除了逐渐变慢（2.3 倍到 3.3 倍）"))
#: the GPU leads (by how their hypothesis starts), named in the reply's one line for them: English, Chinese
GPU_LEADS = {"CUDA graphs": ("CUDA graphs recorded per new shape under `optimize()` (#209, #269)",
                             "在 `optimize()` 下每遇到新形状就重新录制 CUDA graph（#209、#269）"),
             "Memory pressure": ("memory pressure on a small GPU", "小显存 GPU 上的显存压力")}
HYPOTHESES_ZH = {"CUDA graphs": GPU_LEADS["CUDA graphs"][1], "Memory pressure": GPU_LEADS["Memory pressure"][1],
                 "The caller": "每个 chunk 都重新编码或重新发送整段音频",
                 "A prompt": "提示音频或前缀在多次调用之间不断变长", "The full-cache": "对整个 8192 槽缓存做注意力",
                 "A part of": "生成器的某一部分随 chunk 序号变慢"}
#: a lead's shorter name in the English reply (else its hypothesis)
HYPOTHESES_EN = {"The caller": "Re-encoding or resending the whole clip every chunk"}
#: a lead this run could not decide and no GPU test decides, asked as a question: English, Chinese
QUESTIONS = {"A prompt": ("Does your prompt grow from call to call (`merge_prompt_cache` with each output, or output "
                          "fed back as the prompt)? Each prefill would then take longer.",
                          "您的提示是否在多次调用之间不断变长（每次用输出做 `merge_prompt_cache`，或把输出当作下一次的"
                          "提示音频）？那样每次调用的 prefill 都会更慢。")}
#: the ruled-out leads as the reply names them, in one line: English, Chinese
OUT_NAMES = {"The full-cache": ("the full-cache attention", "对整个缓存做注意力"),
             "A part of": ("any part of the generator growing along the stream", HYPOTHESES_ZH["A part of"])}
#: a sentence's end, a name's separator from its reading, "and", a list's separator: English, Chinese
_PUNCT = ((".", ": ", " and ", "; "), ("。", "：", " 和 ", "；"))


def fix_evidence(matrix: list) -> tuple:
    """Where ``fullgraph=True`` refused the slice to ``position + 1`` (the torch matrix's rows, CPU): the clause the
    reply's answer to the proposed fix ends with, (English, Chinese); ("", "") without rows."""
    no = [r["torch"] for r in matrix if r["slice"].get("compiles") is False]
    yes = [r["torch"] for r in matrix if r["slice"].get("compiles")]
    if not no:
        return "", ""
    span = (no[0], no[0]) if len(no) == 1 else (f"{no[0]} to {no[-1]}", f"{no[0]} 到 {no[-1]}")
    traced = (f" ({', '.join(yes)} traces it)", f"（{'、'.join(yes)} 能追踪）") if yes else ("", "")
    return (f"which `fullgraph=True` refused on CPU in torch {span[0]}{traced[0]}",
            f"我们在 CPU 上试过的 torch {span[1]} 在 `fullgraph=True` 下都拒绝了它{traced[1]}")


def measured_where(stream: dict, machine: Optional[str] = None) -> tuple:
    """What the stream record says was measured, and where (``machine``: its run's label, with the CPU features
    that pick the kernels), in a sentence: (English, Chinese)."""
    env, p = stream.get("env", {}), stream["params"]
    where = machine or (machine_label(env) if {"torch", "threads", "device_name"} <= set(env) else
                        f"{env.get('device', '?')} (torch {env.get('torch', '?')})")
    six = stream.get("sixths", {}).get("upstream")
    en = f"{p['chunks']} {p['preset']}-size chunks, {where}"
    scale = {"full": "完整"}.get(p["preset"], p["preset"])
    zh = f"在 {where} 上用{scale}规模的结构跑 {p['chunks']} 个 chunk"
    if six:
        en += f": upstream's chunk took {six[0] / 1e3:.2f} s in the first sixth and {six[-1] / 1e3:.2f} s in the last"
        zh += f"，开头六分之一每个 chunk {six[0] / 1e3:.2f} 秒，最后六分之一 {six[-1] / 1e3:.2f} 秒"
    if not stream_trends(stream).get("upstream", {}).get("dit"):
        en += " (each chunk timed whole, not split into parts)"
        zh += "（按整个 chunk 计时，未分部件）"
    return en, zh


def reply_293(rows: list, stream: Optional[dict] = None, fix: Optional[tuple] = None,
              machine: Optional[str] = None, consumers: Optional[dict] = None,
              contention: Optional[dict] = None) -> str:
    """The reply to OpenBMB/VoxCPM#293 (markdown, English then Chinese): the answer to the proposed fix (``fix``:
    :func:`fix_evidence`'s clause), the cheapest tests and a timing snippet, the leads ranked (what reproduced here
    first, the GPU leads the tests decide in one line, a lead no test decides as a question, what this run rules out
    in one line), the version's scope, the questions left open. ``consumers``, ``contention``: the records the caller
    lead quotes (else its row's)."""
    from .paths import data_dir

    where = measured_where(stream, machine) if stream else ("this run's stream", "本次运行的流式生成")
    fix = fix or ("", "")
    leads = sorted(rows, key=lambda r: (RANK[r["reading"]], not _named(r, GPU_LEADS), _question(r) is None))
    out = [r for r in leads if r["reading"] == RULES_OUT and not _named(r, GPU_LEADS)]
    shown = [r for r in leads if r not in out and not _named(r, GPU_LEADS)]  # the GPU leads are the tests' business
    callers = [str(i) for i, r in enumerate(shown, 1) if r["hypothesis"].startswith("The caller")]
    consumer = _consumer_said(consumers, contention)
    parts = {}
    for lang, name in ((0, "en"), (1, "zh")):
        end, _, and_, semi = _PUNCT[lang]
        lines = [_lead(r, lang, consumer) for r in shown]
        if out:
            names = [_named(r, OUT_NAMES, (r["hypothesis"],) * 2)[lang] for r in out]
            said = " and ".join(names)
            lines.append(f"{said[0].upper()}{said[1:]} {'is' if len(names) == 1 else 'are'} ruled out here (CPU, "
                         f"random weights). {where[0]}; {_out_brief(out).split('; the steepest')[0]}." if lang == 0 else
                         f"本机已排除（CPU、随机权重）：{'；'.join(names)}。{where[1]}。")
        parts[name] = dict(fix=fix[lang], leads="\n".join(f"{i}. {x}" for i, x in enumerate(lines, 1)),
                           tests="\n".join(f"{i}. {x[lang]}{end}" for i, x in enumerate(TESTS, 1)),
                           within=and_.join(callers) or "1", asks=semi.join((ASK, ASK_ZH)[lang]))
    parts["en"]["snippet"] = SNIPPET
    version = (stream or {}).get("env", {}).get("voxcpm", "2.0.3")
    return "\n\n---\n\n".join((data_dir() / "upstream-prs" / "reply-templates" / f"{lang}.md").read_text().format(
        version=version, **kw) for lang, kw in parts.items())


def _named(row: dict, names: dict, default=None):
    """The value in ``names`` whose key ``row``'s hypothesis starts with, else ``default``."""
    return next((v for k, v in names.items() if row["hypothesis"].startswith(k)), default)


def _question(row: dict) -> Optional[tuple]:
    """A lead neither this run nor a GPU test decides, asked as a question (None for any other)."""
    return _named(row, QUESTIONS) if row["reading"] == NEEDS else None


def _out_brief(out: list) -> str:
    """What rules the ruled-out leads out, once: the generator's parts where timed apart (they include the LM steps,
    where attention runs), else each row's own reading."""
    parts = next((r for r in out if r["hypothesis"].startswith("A part of")), None)
    return (parts.get("brief") or parts["measured here"]) if parts else "; ".join(
        r.get("brief", r["measured here"]) for r in out)


def _consumer_said(consumers: Optional[dict], contention: Optional[dict]) -> Optional[str]:
    """The caller lead's measurement in the reply's words: each consumer pattern that grows as #293's chunks do, and
    the one run beside the generator, labelled with the threads and model size it ran on; None without records."""
    said = _took(consumers)
    if not said:
        return None
    if contention:
        from fastattn.models import voxcpm2_config

        p, env = contention["params"], contention.get("env", {})
        layers = voxcpm2_config(p["preset"])["lm_config"]["num_hidden_layers"]
        ci = f" (95% CI {fmt_ci(contention['ci'])})" if contention.get("ci") else ""
        said += (f"; in a thread beside the generator ({env.get('threads', '?')} CPU threads, {layers} LM layers) it "
                 f"made the generator's chunks {contention['ratio']:.2f}x as long{ci}")
    return said


#: each reading as a lead of the reply says it: English, Chinese
SAID = {REPRODUCES: ("the shape reproduced here", "本机复现了这一形态"), RULES_OUT: ("ruled out here", "本机已排除"),
        NOT_MEASURED: ("not measured in this run", "本次未测"),
        NEEDS: ("needs your machine to decide", "需要您的机器或 GPU 才能判断")}


def _lead(row: dict, lang: int, consumer_said: Optional[str] = None) -> str:
    """One lead of the reply: a question, or the reading and (English) what was measured. A reproduced consumer
    says whose cost it measured: ours, not the reporter's."""
    if _question(row):
        return _question(row)[lang]
    end, sep = _PUNCT[lang][:2]
    name = _named(row, HYPOTHESES_ZH if lang else HYPOTHESES_EN, row["hypothesis"])
    said = SAID[row["reading"]][lang]
    caller = row["hypothesis"].startswith("The caller")
    if row["reading"] == REPRODUCES and caller:
        said = ("the shape reproduced here in our own consumer, not your slowdown" if lang == 0 else
                "本机用我们自己写的消费方复现了这一形态，但复现的不是您遇到的变慢")
    if lang or row["reading"] == NOT_MEASURED:
        return name + sep + said + end
    return f"{name}{sep}{said}: {consumer_said if caller and consumer_said else row['measured here']}{end}"
