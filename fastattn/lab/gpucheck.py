"""``python -m fastattn gpu-check``: everything CUDA-side the workbook claims, in named steps.

``--quick``: :data:`FIRST_CONTACT` only (about 7 min cold on one H200); ``--device cpu --quick`` tests the kit."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch

from fastattn.backends import backend_matrix, explain_sdpa
from fastattn.clock import interleaved, sync
from fastattn.devices import resolve_device
from fastattn.exactness import calibration_ladders
from fastattn.fast import sdpa_slice
from fastattn.graphs import cudagraph_recordings, graph_counts, optimize, reset_graph_counts
from fastattn.models import build_voxcpm2, silence_progress
from fastattn.patch import patch_voxcpm
from fastattn.static import check_form, decode_data, flex_available, fresh_positions, upstream_masked

from . import bench, runner
from .bench.forms import check_lines, form_lines, kit_lines, stack_sweep
from .bench.records import env_record, find_row, load_record, record
from .bench.stats import fmt_ci, quiet_ratio
from .bench.stream import sixths, text_for, time_chunks
from .bench.timing import stats_ms, time_interleaved
from .bench.trend import describe, trend
from .doctor import doctor
from .machine import compile_toolchain, device_name
from .paths import atomic_write_text
from .runner import Step
from .upstream import max_abs_diff, run_in_patched_copy, upstream_decode

#: the text the kit's decodes read
KIT_TEXT = "The quick brown fox jumps over the lazy dog. " * 4
#: the first-contact set (``--quick``), in run order
FIRST_CONTACT = ("environment", "forms_check", "static_inputs", "optimize_counters", "eager_slices")
#: ``--quick``'s budget: a first look on a shared GPU box gets a job slot of about ten minutes
QUICK_BUDGET_S = 480
#: what a patched-copy child runs: a function of this module, its arguments from argv
_LAUNCH = "import sys; from fastattn.lab import gpucheck; gpucheck.{}(*sys.argv[1:])"


def folder_name(device: torch.device) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")[:40]
    return f"{device.type}-{slug}-torch{torch.__version__.split('+')[0]}"


def _sizes(device: torch.device, quick: bool) -> dict:
    if device.type == "cpu" and quick:
        return dict(capacity=1024, positions=[0, 256, 768], repeats=2, preset="tiny", steps=6, dtypes=("float32",
                    "bfloat16"), stream_chunks=6, form_positions=[0, 500, 1000], form_dtypes=("bfloat16",),
                    geometry=dict(hq=4, hkv=2, head_dim=32), form_steps=50, layers=2, stack_positions=[100, 1000],
                    slice_calls=20, slice_position=700, counter_steps=6, calibrate=False)  # 12 s here: a rehearsal
    first = dict(calibrate=True, capacity=8192, geometry=dict(hq=16, hkv=2, head_dim=128), form_steps=200, layers=28,
                 stack_positions=[512, 8000], slice_calls=50, slice_position=3000, counter_steps=30)
    if quick:
        return dict(first, positions=[0, 256, 4096], repeats=3, preset="small", steps=8, dtypes=("bfloat16",),
                    stream_chunks=100, form_positions=[0, 1024, 4096, 8000], form_dtypes=("bfloat16",))
    return dict(first, positions=[0, 256, 1024, 4096, 8000], repeats=7, preset="full", steps=12, dtypes=(
        "bfloat16", "float16", "float32"), stream_chunks=600, form_positions=[0, 256, 1024, 2048, 4096, 6144, 8000],
        form_dtypes=("bfloat16", "float32"))


def _steps(device: torch.device, size: dict) -> list:
    """Every step in run order; CUDA estimates (s) are cold-cache upper ends on one H200."""
    gpu, rec = device.type == "cuda", partial(_record, device, dtype=None)
    no_cc = compile_toolchain(device)  # a compile step's reason to skip; eager steps still run
    cuda_and_cc = no_cc if gpu else "CUDA graphs and upstream's reduce-overhead compile need CUDA"
    cap, small = size["capacity"], "small" if size["preset"] != "tiny" else "tiny"
    timed = dict(device=device, repeats=size["repeats"], progress=False)
    table = [  # name, () -> its records, estimate on CUDA and elsewhere (s), why it cannot run here
        ("environment", lambda: _environment(device, size), 30, 15, None),
        ("forms_check", lambda: _forms_check(device, size), 100, 40, no_cc),
        ("static_inputs", lambda: _static_inputs(device, size), 90, 30, no_cc),
        ("optimize_counters", lambda: _optimize_counters(device, size), 150, 0, cuda_and_cc),
        ("eager_slices", lambda: _eager_slices(device, size), 10, 5, None),
        ("exactness_calibration", lambda: [rec("exactness_calibration", {"capacity": cap}, calibration_ladders(
            device, capacity=cap, dtypes=("bfloat16", "float32")))], 30, 30, None),
        # caches: rotated over that many caches (36: every layer of both LMs)
        ("attention_sweep", lambda: [bench.attention_sweep(size["positions"], capacity=cap, dtype=dt, **timed,
                                                           caches=36 if gpu else 1)
                                     for dt in ("bfloat16", "float32")], 60, 60, None),
        ("decode_step_sweep", lambda: [bench.decode_step_sweep(size["positions"], preset=small, dtype="bfloat16",
                                                               slice_fix=True, **timed)], 60, 60, None),
        ("whole_decode_eager", lambda: [bench.whole_decode(size["preset"], steps=size["steps"], dtype="bfloat16",
                                                            device=str(device), repeats=1, progress=False)],
         60, 60, None),
        ("step_split", lambda: [bench.step_split(size["preset"], steps=min(size["steps"], 6), repeats=3,
                                                 device=str(device))], 90, 60, None),
        ("whole_decode_optimized", lambda: [_optimized_decode(device, size)], 480, 0, cuda_and_cc),
        ("stream_under_optimize", lambda: [_stream_under_upstream_optimize(device, size)], 360, 0, cuda_and_cc),
        ("upstream_diff_compiled", lambda: [_diff_compiled(device, size)], 300, 0, cuda_and_cc),
        ("decode_forms", lambda: [bench.form_sweep(size["form_positions"], dtype=dt, capacity=cap,
                                                   layers=size["layers"], **timed) for dt in size["form_dtypes"]],
         600, 0, no_cc if gpu else "the CUDA opt-in is chosen on CUDA (on CPU: notebook 04's graph_choice)"),
        ("kit_decode", lambda: [kit_decode(device, preset=size["preset"], steps=size["steps"],
                                           chunks=size["stream_chunks"], repeats=3)], 900, 0, cuda_and_cc),
        ("kit_decode_eager", lambda: [kit_decode(device, preset="small", steps=size["steps"], chunks=20, repeats=3,
                                                 compile=False)], 200, 0,
         None if gpu else "eager live against masked matters where cuDNN plans per key length (CUDA)"),
    ]
    return [Step(name, fn, cuda_s if gpu else cpu_s, skip) for name, fn, cuda_s, cpu_s, skip in table]


def _record(device, kind: str, params: dict, rows: list, dtype="bfloat16", **extra) -> dict:
    return record(kind, env=env_record(device, dtype), params=params, rows=rows, **extra)


# --------------------------------------------------------------------------- the first-contact steps
def _environment(device, size) -> list:
    """Records of doctor and the backend matrix, with SDPA's refusal reasons."""
    rows = [r for dt in size["dtypes"] for r in backend_matrix(device, dtype=dt, capacity=size["capacity"],
                                                             position=size["positions"][1])]
    for r in rows:
        r["refused"] = {b: e["reason"] for b, e in r.pop("report", {}).get("eligibility", {}).items()
                        if not e["eligible"]}
    return [_record(device, "doctor", {}, [doctor(calibrate=size["calibrate"])], dtype=None),
            _record(device, "backend_matrix", {"dtypes": list(size["dtypes"])}, rows, dtype=None)]


def _forms_check(device, size) -> list:
    """flex, masked and slice at the capacity, bf16, through :func:`check_form` (``reduce-overhead`` on CUDA)."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    rows = [check_form(n, device, torch.bfloat16, capacity=size["capacity"], steps=size["form_steps"],
                       compile_mode=mode, **size["geometry"]) for n in ("flex_decode", "upstream_masked", "slice_live")]
    return [_record(device, "form_checks", {"capacity": size["capacity"], "compile_mode": mode, **size["geometry"]},
                    rows)]


def _static_inputs(device, size) -> list:
    """One compiled form, q/K/V static or not, ``layers`` calls or one per replay (:func:`stack_sweep`)."""
    form, layers = "upstream_masked" if flex_available(device) else "flex_decode", size["layers"]
    variants = {"static, 1 call per replay": (form, True, True, 1),
                f"static, {layers} calls per replay": (form, True, True, layers),
                f"not static, {layers} calls per replay": (form, True, False, layers)}
    mode = "reduce-overhead" if device.type == "cuda" else None
    torch._dynamo.reset()
    rows = stack_sweep(variants, size["stack_positions"], device=device, dtype=torch.bfloat16,
                       capacity=size["capacity"], bucket=256, repeats=7, warmup=2, seed=0, mode=mode,
                       **size["geometry"])
    return [_record(device, "static_inputs", {"form": form, "compile_mode": mode, "layers": layers,
                                              "capacity": size["capacity"], **size["geometry"]}, rows,
                    cudagraph_recordings=cudagraph_recordings(device) if mode else None)]


def counted_decode(model, prepare: Optional[Callable], steps: int, device, text: str = KIT_TEXT) -> tuple:
    """A seed-0 decode counted from before ``prepare(model)``: (CPU waveform, {wall_s, graph counts})."""
    reset_graph_counts()
    before = cudagraph_recordings(device) or 0  # None: no tree yet (or no CUDA)
    if prepare is not None:
        prepare(model)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    wav = model.generate(text, min_len=steps, max_len=steps, inference_timesteps=2)
    sync(device)
    after = cudagraph_recordings(device)
    return wav.cpu(), {"wall_s": time.perf_counter() - t0, **graph_counts(),
                       "cudagraph_recordings": None if after is None else after - before}


def _optimize_counters(device, size) -> list:
    """The small preset under voxcpm's ``optimize()``: does upstream replay CUDA graphs?"""
    model = build_voxcpm2("small", device="cuda", dtype="bfloat16")
    torch._dynamo.reset()
    _, row = counted_decode(model, upstream_optimized, size["counter_steps"], device)
    return [_record(device, "optimize_counters", {"preset": "small", "steps": size["counter_steps"]},
                    [dict(row, variant="upstream optimize()")])]


def _eager_slices(device, size) -> list:
    """Eager slices at fresh key counts (SDPA's pick, no cuDNN) vs one repeated count and the masked call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    n, p, cap = size["slice_calls"], size["slice_position"], size["capacity"]
    q, k, v = decode_data(device, torch.bfloat16, capacity=cap, seed=0, **size["geometry"])
    walk = fresh_positions(p, n + 2, cap, device=device, dtype=torch.bfloat16)  # 2 warm-up calls, n timed: all new
    pos = [torch.tensor([i], device=device) for i in walk]
    sliced = lambda i: sdpa_slice(q, k[:, :, :i + 1], v[:, :, :i + 1])  # noqa: E731

    def without_cudnn(i):  # SDPA limited to flash, efficient and math: the kit's eager ``live`` on CUDA
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return sliced(i)
    # a lazy map's __next__: each call runs on the walk's next key count (C-level wrappers alike, partial too)
    fns = {"slice, fresh length per call": map(sliced, walk).__next__, "slice, one length": partial(sliced, p),
           "slice, fresh length, cuDNN left out": map(without_cudnn, walk).__next__,
           "masked, whole cache": map(lambda t: upstream_masked(q, k, v, t), pos).__next__}
    host = {}
    times = time_interleaved(fns, repeats=n, warmup=2, device=device, host=host)
    rows = [{"variant": name, "position": p, **stats_ms(t, host[name])} for name, t in times.items()]
    chosen = explain_sdpa(q, k[:, :, :p + 1], v[:, :, :p + 1], enable_gqa=True).backend
    return [_record(device, "eager_slices", {"position": p, "calls": n, "capacity": cap, **size["geometry"]}, rows,
                    slice_backend=chosen)]


# --------------------------------------------------------------------------- the full run's own steps
def upstream_optimized(model) -> None:
    """voxcpm's ``optimize()``; RuntimeError where it ran eager (it needs ``device == 'cuda'`` and triton)."""
    model.optimize()
    if "forward_step" not in model.base_lm.__dict__:
        raise RuntimeError(f"voxcpm's optimize() did not compile (model.device={model.device!r}; it needs "
                           "exactly 'cuda' and triton)")


def _optimized_decode(device, size) -> dict:
    """Upstream under ``optimize()`` vs patched under :func:`fastattn.optimize`: outputs and graph counts."""
    rows, outs = [], {}
    for variant, patch, prepare in (("upstream", nullcontext, upstream_optimized), ("patched", patch_voxcpm, optimize)):
        model = build_voxcpm2(size["preset"], device="cuda", dtype="bfloat16")
        with patch(model):  # reverted after the decode, even a failed one
            torch._dynamo.reset()
            outs[variant], row = counted_decode(model, prepare, size["steps"], device)
        rows.append(dict(row, variant=variant))
    return _record(device, "whole_decode_optimized", dict(size), rows,
                   identical=bool(torch.equal(outs["upstream"], outs["patched"])))


def stream_chunks(model, chunks: int, *, text: str, seed: int = 0, device="cpu", inference_timesteps: int = 2,
                  recordings=cudagraph_recordings) -> list[dict]:
    """Per chunk of one ``generate_streaming`` run: its ms and the compile and CUDA-graph counters so far."""

    def counters():
        g = graph_counts()
        return {"unique_graphs": g["unique_graphs"], "cudagraph_skips": g["cudagraph_skips"],
                "cudagraph_recordings": recordings(device)}
    torch.manual_seed(seed)
    gen = model.generate_streaming(text, min_len=chunks, max_len=chunks, inference_timesteps=inference_timesteps)
    _, rows = time_chunks(gen, device, counters)
    return [{"chunk": i, **r} for i, r in enumerate(rows)]


def _stream_under_upstream_optimize(device, size) -> dict:
    """A long stream, twice, under voxcpm's own ``optimize()``: per chunk ms and counters; the per-chunk trend."""
    chunks = size["stream_chunks"]
    model = build_voxcpm2(size["preset"], device="cuda", dtype="bfloat16")
    torch._dynamo.reset()
    reset_graph_counts()
    upstream_optimized(model)
    runs = [stream_chunks(model, chunks, text=text_for(chunks), device=device) for _ in range(2)]
    rows = [dict(r, repeat=k) for k, run in enumerate(runs) for r in run]
    t = trend([[(r["chunk"], r["ms"], r["disturbed"]) for r in run] for run in runs])
    return _record(device, "stream_under_optimize", {**size, "chunks": chunks}, rows,
                   sixths=sixths([r["ms"] for r in runs[0]]), trend=t, verdict=describe(t),
                   graphs_recorded_after_first_sixth=_grew_after(rows, "cudagraph_recordings"),
                   graphs_compiled_after_first_sixth=_grew_after(rows, "unique_graphs"))


def _grew_after(rows: list, key: str) -> Optional[int]:
    """How much a per-chunk counter grew after a stream's first sixth (None: unknown)."""
    start = rows[len(rows) // 6][key] if rows else None
    return None if start is None or rows[-1][key] is None else rows[-1][key] - start


def _in_copy(root: str) -> None:
    import voxcpm
    if not voxcpm.__file__.startswith(root):
        raise RuntimeError(f"the child imported {voxcpm.__file__}, not the patched copy under {root}")


def diff_child(root: str, preset: str, steps: str, out: str) -> None:
    """:func:`_diff_compiled`'s child (the right-sized kit's copy): a decode under upstream's ``optimize()``."""
    _in_copy(root)
    model = build_voxcpm2(preset, device="cuda", dtype="bfloat16")
    w, _ = counted_decode(model, upstream_optimized, int(steps), "cuda", text="hello world " * 8)
    torch.save({"shape": list(w.shape)}, out)


def _diff_compiled(device, size) -> dict:
    """The upstream diff applied to a copy of voxcpm, decoding under upstream's own fullgraph compile."""
    try:
        rows = [{"returncode": 0, **run_in_patched_copy("right-sized", _LAUNCH.format("diff_child"), size["preset"],
                                                         size["steps"], timeout=900, env=child_env(device))}]
    except Exception as exc:  # noqa: BLE001 - no patch tool, a failing child: a reported failure, never a lost step
        rows = [{"returncode": 1, "stderr": f"{type(exc).__name__}: {exc}"}]
    return _record(device, "upstream_diff_compiled", dict(size), rows)


def child_env(device) -> dict:
    """A child's env to run ``device`` as ``"cuda"``: ``CUDA_VISIBLE_DEVICES`` narrowed to that GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    index = torch.cuda.current_device() if device.index is None else device.index
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and index >= len(visible):
        raise ValueError(f"device {device} is past CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}")
    return {"CUDA_VISIBLE_DEVICES": visible[index] if visible else str(index)}


def kit_child(root, preset, device, steps, chunks, repeats, compile_, out) -> None:
    """:func:`kit_decode`'s child: per mode a model (compiled if ``compile_ == "1"``), decodes and a stream."""
    _in_copy(root)
    silence_progress()
    steps, chunks, repeats, compiled = int(steps), int(chunks), int(repeats), compile_ == "1"
    models, wavs, warm = {}, {}, {}
    for mode in ("masked", "live"):
        models[mode] = m = build_voxcpm2(preset, device=device, dtype="bfloat16")
        for lm in (m.base_lm, m.residual_lm):
            lm.set_decode_attention(mode)
        wavs[mode], warm[mode] = counted_decode(m, upstream_optimized if compiled else None, steps, device)
    times = interleaved({mode: lambda m=m: m.generate(KIT_TEXT, min_len=steps, max_len=steps, inference_timesteps=2)
                         for mode, m in models.items()}, repeats=repeats, warmup=0, device=device)
    rows = []
    for mode, m in models.items():
        reset_graph_counts()
        stream, end = stream_chunks(m, chunks, text=KIT_TEXT * 8, device=device), graph_counts()
        rec = [stream[0]["cudagraph_recordings"], stream[-1]["cudagraph_recordings"]]
        rows.append({"mode": mode, "phase": "optimize()" if compiled else "eager",
                     "wall_s": statistics.median(times[mode]), "wall_samples_s": times[mode], "chunks": chunks,
                     "chunk_ms": [r["ms"] for r in stream], "compile_counts": warm[mode],
                     **{k: warm[mode][k] + end[k] for k in ("unique_graphs", "cudagraph_skips")},
                     "cudagraph_skip_reasons": sorted({*warm[mode]["cudagraph_skip_reasons"],
                                                       *end["cudagraph_skip_reasons"]}),
                     "cudagraph_recordings": None if None in rec else rec[1] - rec[0]})
    torch.save({"rows": rows, "wavs": wavs}, out)


def kit_decode(device, *, preset: str = "small", steps: int = 12, chunks: int = 600, repeats: int = 3,
               compile: Optional[bool] = None) -> dict:
    """The ``decode-attention`` kit's record (bf16, fresh process); ``identical_off``: off equals upstream."""
    device = select_device(device)
    compile = device.type == "cuda" if compile is None else compile
    rec = partial(_record, device, "kit_decode")
    try:
        res = run_in_patched_copy("decode-attention", _LAUNCH.format("kit_child"), preset, device, steps, chunks,
                                  repeats, "1" if compile else "0", timeout=3600, env=child_env(device))
    except Exception as exc:  # noqa: BLE001 - no patch tool, a failing child: a reported failure, never a lost step
        return rec({"preset": preset}, [{"returncode": 1, "stderr": f"{type(exc).__name__}: {exc}"}])
    _, ref = upstream_decode(preset, text=KIT_TEXT, steps=steps, dtype="bfloat16", seed=0, device=str(device),
                             prepare=upstream_optimized if compile else None)
    live, masked = res["wavs"]["live"], res["wavs"]["masked"]
    return rec({"preset": preset, "steps": steps, "chunks": chunks, "repeats": repeats, "compile": compile},
               res["rows"], identical_off=bool(torch.equal(ref, masked)), max_abs_diff_on=max_abs_diff(live, masked))


# --------------------------------------------------------------------------- the runner
def select_device(device) -> torch.device:
    """The resolved device; ``cuda:N`` is made current and returned as ``cuda`` (what ``optimize()`` needs)."""
    device = resolve_device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)
        return torch.device("cuda")
    return device


def plan(device: torch.device, quick: bool, only=None, skip=None) -> list:
    """The steps to run: :data:`FIRST_CONTACT` with ``quick``, else every step; ``only`` and ``skip`` name steps."""
    return runner.select(_steps(device, _sizes(device, quick)), only, skip, FIRST_CONTACT if quick else None)


def gpu_check(device="cuda", *, quick: bool = False, out=None, log=print, only=None, skip=None,
              budget: Optional[float] = None, resume: bool = False) -> Path:
    """Run :func:`plan`'s steps; return their folder (records, ``steps.jsonl``, ``summary.md``). ``budget`` in s."""
    asked, device = str(device), select_device(device)
    steps = plan(device, quick, only, skip)
    budget = (QUICK_BUDGET_S if quick else None) if budget is None else (budget or None)
    folder = runner.open_folder(Path(out) if out else Path("reports") / folder_name(device), resume)
    done = {n for n, e in runner.log_entries(folder).items() if e["status"] == "ok"}
    todo = [s for s in steps if not s.skip and s.name not in done]
    line = (f"plan: {', '.join(f'{s.name} ~{s.estimate_s:.0f} s' for s in todo) or 'nothing to run'}; estimate "
            f"{sum(s.estimate_s for s in todo):.0f} s cold; budget {'none' if budget is None else f'{budget:.0f} s'}")
    head = [f"# fastattn gpu-check: {folder_name(device)}", "", f"device {asked}" + (
        f" (current CUDA device {torch.cuda.current_device()})" if device.type == "cuda" else ""),
        f"quick={quick}, torch {torch.__version__}; {line}"]
    log(f"[gpu-check] {line}")
    write = lambda: atomic_write_text(folder / "summary.md", "\n".join(summary_lines(folder, steps, head)) + "\n")  # noqa: E731
    write()
    runner.run_steps(steps, folder, budget=budget, resume=True, log=log, tag="gpu-check", after=write,
                     failures=_failures)
    return folder


def _failures(rec: dict) -> list[str]:
    """What a step's record says went wrong: outputs not bit-identical, a subprocess that failed."""
    out = [f"{rec['kind']}: {what}" for key, what in (("identical", "not bit-identical to upstream"), (
        "identical_off", "decode_attention off is not bit-identical to upstream")) if rec.get(key) is False]
    return out + [f"{rec['kind']}: exit status {r['returncode']}: {(r.get('stderr') or '').strip()[-160:]}"
                  for r in rec.get("rows", []) if r.get("returncode") not in (None, 0)]


def summary_lines(folder: Path, steps: list, head: list) -> list:
    """``summary.md``'s lines: each step's outcome, the first-contact answers, the CUDA opt-in section."""
    entries, kept = runner.log_entries(folder), {}
    lines = [*head, "", "| step | outcome | seconds |", "|---|---|---|"]
    earlier = [(n, None) for n in entries if n not in {s.name for s in steps}]  # an earlier call's (--resume)
    for name, skip in [(s.name, s.skip) for s in steps] + earlier:
        e = entries.get(name)
        if e is None:
            lines.append(f"| {name} | {'skipped: ' + skip if skip else 'not run (not reached, or killed)'} | |")
            continue
        kept[name] = recs = [load_record(folder / f) for f in e.get("files", [])]
        files = ", ".join(e.get("files", []))
        bad = "; ".join([why for r in recs for why in _failures(r)] or [e.get("why") or ""])
        what = f"ok: {files}" if e["status"] == "ok" else (
            f"{e['status']}: {bad}" + (f" (records: {files})" if files else ""))
        lines.append(f"| {name} | {what} | {e['seconds']:.1f} |")
    lines += first_contact_lines({k: v for k, v in kept.items() if k in FIRST_CONTACT})
    kits = kept.get("kit_decode", []) + kept.get("kit_decode_eager", [])
    return lines + opt_in_section(kept.get("decode_forms"), kits)


def _ratio_line(rows: list, num: str, den: str) -> str:
    r, ci, _, _ = quiet_ratio(find_row(rows, variant=num), find_row(rows, variant=den))
    return f"{num} / {den}: {r:.2f}x {fmt_ci(ci)}"


def first_contact_lines(kept: dict) -> list:
    """What the first-contact records answer, a line each (only for the steps that wrote records)."""
    out = ["", "## First contact", ""] if kept else []
    for rec in kept.get("forms_check", []):
        out += check_lines(rec["rows"])
    for rec in kept.get("static_inputs", []):
        n = rec["params"]["layers"]
        for p in sorted({r["position"] for r in rec["rows"]}):
            rows = [r for r in rec["rows"] if r["position"] == p]
            per = ", ".join(f"{r['variant']}: {r['per_layer_ms'] * 1e3:.1f} us/layer, host {r['host_ms_per_call']:.3f}"
                            " ms/call" for r in rows)
            out.append(f"- static inputs, {rec['params']['form']} at position {p}: {per}; "
                       + _ratio_line(rows, f"not static, {n} calls per replay", f"static, {n} calls per replay"))
    for rec in kept.get("optimize_counters", []):
        r = rec["rows"][0]
        out.append(f"- upstream's optimize(), {rec['params']['steps']} steps counted from before its compile: "
                   f"{r['unique_graphs']} dynamo graph(s), {r['cudagraph_skips']} cudagraph skip(s)"
                   f"{' (' + '; '.join(r['cudagraph_skip_reasons']) + ')' if r['cudagraph_skip_reasons'] else ''}, "
                   f"{'unknown' if r['cudagraph_recordings'] is None else r['cudagraph_recordings']} CUDA graph(s) "
                   "recorded")
    for rec in kept.get("eager_slices", []):
        rows, fresh, masked = rec["rows"], "slice, fresh length per call", "masked, whole cache"
        pairs = [(fresh, "slice, one length"), (fresh, masked), ("slice, fresh length, cuDNN left out", masked)]
        out.append(f"- eager slices at position {rec['params']['position']} (SDPA picks {rec['slice_backend']}): "
                   + "; ".join(_ratio_line(rows, a, b) for a, b in pairs if find_row(rows, variant=a))
                   + (HOST_BOUND if str(rec["env"].get("device", "")).startswith("cuda") else ""))
        out.append(plan_cost_line(rows))
    return out


#: the layers of one VoxCPM2 decode step (base LM 28 + residual LM 8): they share a step's key count, so one plan
STEP_LAYERS = 36


def plan_cost_line(rows: list) -> str:
    """A new key count's cost beside the kernel (fresh minus repeated median), whole and per layer."""
    by = {r["variant"]: r["median_ms"] for r in rows}
    fresh, same = by.get("slice, fresh length per call"), by.get("slice, one length")
    if fresh is None or same is None:
        return "  - plan cost per new key count: not measured"
    plan = max(fresh - same, 0.0)
    return (f"  - plan cost per new key count: {plan:.3g} ms (fresh {fresh:.3g} - repeated {same:.3g}); a step's "
            f"{STEP_LAYERS} layers share one, {plan / STEP_LAYERS:.3g} ms per layer beside the kernel's {same:.3g} ms")


#: what a single eager call's time is on a GPU: launches, not bytes (a ratio of them decides no kernel verdict)
HOST_BOUND = (" (single eager calls on CUDA: host-dispatch bound, one cache's K/V held in L2; the per-step figures "
              "are decode_step_sweep's)")


def opt_in_section(forms: Optional[list], kit: Optional[list]) -> list:
    """The CUDA opt-in section: per dtype the winning form and its margin, the kit's decodes."""
    out = ["", "## The CUDA opt-in: which decode form upstream should carry", ""]
    if not forms:
        out += ["Not measured in this run: the decode_forms step runs on CUDA only, and here it was skipped or "
                "stopped with an error (the table above says which). Until a GPU has run it, the CUDA choice is "
                "unmeasured.", ""]
    for rec in forms or []:
        out += [f"### {rec['params']['dtype']}, positions {rec['params']['positions']}", ""] + form_lines(rec) + [""]
    for rec in kit or []:
        if rec["rows"] and "mode" in rec["rows"][0]:
            out += [f"### The decode-attention kit, whole decodes ({rec['rows'][0]['phase']})", ""] + kit_lines(rec)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastattn gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (the kit's own test)")
    ap.add_argument("--quick", action="store_true", help=f"the first contact: {', '.join(FIRST_CONTACT)} (a budget of "
                    f"{QUICK_BUDGET_S} s; the plan line gives each step's cold estimate)")
    runner.add_arguments(ap, "output folder (default: reports/<device>-<name>-torch<version>)")
    args = ap.parse_args(argv)
    try:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("CUDA is not available on this machine; this kit validates the CUDA path (run it on a "
                             "GPU box, or pass --device cpu --quick to test the kit itself)")
        folder = gpu_check(args.device, quick=args.quick, out=args.out, only=args.only, skip=args.skip,
                           budget=args.budget, resume=args.resume)
    except ValueError as exc:
        print(f"[gpu-check] error: {exc}", file=sys.stderr)
        return 2
    print(f"[gpu-check] records and summary.md in {folder}")
    return 1 if "| failed:" in (folder / "summary.md").read_text() else 0
