"""``python -m fastattn gpu-check``: everything CUDA-side the workbook claims, produced in one command.

On a GPU box with the workbook installed it runs, in order: ``doctor``; the
backend matrix (bf16/fp16/fp32, torch's ``can_use_*`` reasons); the exactness
calibration ladder at capacity 8192 (Lq 1 and 5, bf16 and fp32); the attention
sweep (reference / exact / fast, fast's chosen implementation, CUDA-event
timing); the decode-step sweep; the whole decode of the full preset in bf16,
upstream vs patched, eager and under :func:`fastattn.optimize` (graph counts,
outputs compared); and a decode through the upstream diff under a
``fullgraph`` compile. Every step writes a record (JSON + CSV, each with its
environment); ``summary.md`` lists each step with its outcome or the reason it
was skipped. The folder is named by device and torch version, ready to commit
under ``data/results/``.

``--device cpu --quick`` runs the same sequence on CPU at small sizes, CUDA-only
steps reported as skipped with the reason, so the kit is tested on every CI run.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

from .graphs import cudagraph_recordings
from .paths import atomic_write_text

#: the text the kit's decodes read (whole decodes under optimize(), and the decode-attention kit)
KIT_TEXT = "The quick brown fox jumps over the lazy dog. " * 4

__all__ = ["gpu_check", "main", "select_device", "child_env", "stream_chunks", "upstream_optimized",
           "kit_decode"]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40]


def folder_name(device: torch.device) -> str:
    from .devices import device_name
    return f"{device.type}-{_slug(device_name(device))}-torch{torch.__version__.split('+')[0]}"


def _sizes(device: torch.device, quick: bool) -> dict:
    if quick and device.type == "cpu":
        return {"capacity": 1024, "positions": [0, 256, 768], "repeats": 2, "preset": "tiny", "steps": 6,
                "ladder_capacity": 1024, "dtypes": ("float32", "bfloat16")}
    if quick:
        return {"capacity": 8192, "positions": [0, 256, 4096], "repeats": 3, "preset": "small", "steps": 8,
                "ladder_capacity": 8192, "dtypes": ("bfloat16", "float32"), "stream_chunks": 600,
                "form_positions": [0, 1024, 4096, 8000], "form_dtypes": ("bfloat16",)}
    return {"capacity": 8192, "positions": [0, 256, 1024, 4096, 8000], "repeats": 7, "preset": "full", "steps": 12,
            "ladder_capacity": 8192, "dtypes": ("bfloat16", "float16", "float32"), "stream_chunks": 600,
            "form_positions": [0, 256, 1024, 2048, 4096, 6144, 8000], "form_dtypes": ("bfloat16", "float32")}


def _steps(device: torch.device, size: dict) -> list:
    """(name, function returning records, reason it cannot run here or None)."""
    from . import bench
    from .backends import backend_matrix
    from .bench.records import env_record, record
    from .doctor import doctor
    from .experiments.causality import calibration_ladders

    cuda_only = None if device.type == "cuda" else "CUDA graphs and upstream's reduce-overhead compile need CUDA"
    env = lambda: env_record(device)  # noqa: E731

    def matrix():
        rows = [r for dt in size["dtypes"] for r in backend_matrix(device, dtype=dt, capacity=size["capacity"],
                                                                 position=size["positions"][1])]
        for r in rows:
            r.pop("report", None)
        return [record("backend_matrix", env=env(), params={"dtypes": list(size["dtypes"])}, rows=rows)]

    def ladder():
        rows = calibration_ladders(device, capacity=size["ladder_capacity"], dtypes=("bfloat16", "float32"))
        return [record("exactness_calibration", env=env(), params={"capacity": size["ladder_capacity"]}, rows=rows)]

    return [
        ("doctor", lambda: [record("doctor", env=env(), params={}, rows=[doctor()])], None),
        ("backend_matrix", matrix, None),
        ("exactness_calibration", ladder, None),
        ("attention_sweep", lambda: [bench.attention_sweep(size["positions"], capacity=size["capacity"], dtype=dt,
                                                           device=device, repeats=size["repeats"], progress=False)
                                     for dt in ("bfloat16", "float32")], None),
        ("decode_step_sweep", lambda: [bench.decode_step_sweep(size["positions"], preset="small" if size["preset"] !=
                                                               "tiny" else "tiny", dtype="bfloat16", device=device,
                                                               repeats=size["repeats"], progress=False,
                                                               slice_fix=True)], None),
        ("whole_decode_eager", lambda: [bench.whole_decode(size["preset"], steps=size["steps"], dtype="bfloat16",
                                                           device=str(device), repeats=1, progress=False)], None),
        ("whole_decode_optimized", lambda: [_optimized_decode(device, size)], cuda_only),
        ("stream_under_optimize", lambda: [_stream_under_upstream_optimize(device, size)], cuda_only),
        ("upstream_diff_compiled", lambda: [_diff_compiled(device, size)], cuda_only),
        ("decode_forms", lambda: [bench.form_sweep(size["form_positions"], device=device, dtype=dt,
                                                   capacity=size["capacity"], repeats=size["repeats"], progress=False)
                                  for dt in size["form_dtypes"]],
         cuda_only and "the CUDA opt-in is chosen on CUDA (on CPU: notebook 04's graph_choice, tests/test_static.py)"),
        ("kit_decode", lambda: [kit_decode(device, preset=size["preset"], steps=size["steps"],
                                           chunks=size["stream_chunks"], repeats=3)], cuda_only),
    ]


def upstream_optimized(model) -> None:
    """voxcpm's own ``optimize()``, checked: it compiles only when ``model.device == "cuda"`` exactly and triton
    imports, and otherwise prints a warning and runs eagerly; an eager run must not pass for a compiled one."""
    model.optimize()
    if "forward_step" not in model.base_lm.__dict__:
        raise RuntimeError(f"voxcpm's optimize() did not compile (model.device={model.device!r}; it needs "
                           "exactly 'cuda' and triton)")


def _optimized_decode(device, size) -> dict:
    """Upstream under its own ``optimize()`` vs patched under :func:`fastattn.optimize` (CUDA graphs): outputs,
    dynamo's graphs, cudagraph skips with their reasons (a skipped LM step replays no graph), recordings."""
    from .bench.records import env_record, record
    from .graphs import graph_counts, optimize, reset_graph_counts
    from .models import build_voxcpm2
    from .patch import patch_voxcpm
    text, rows = KIT_TEXT, []
    outs = {}
    for variant in ("upstream", "patched"):
        model = build_voxcpm2(size["preset"], device="cuda", dtype="bfloat16")
        handle = patch_voxcpm(model) if variant == "patched" else None
        try:
            torch._dynamo.reset()
            reset_graph_counts()
            before = cudagraph_recordings(device) or 0
            if variant == "patched":
                optimize(model)
            else:
                upstream_optimized(model)
            torch.manual_seed(0)
            t0 = time.perf_counter()
            outs[variant] = model.generate(text, min_len=size["steps"], max_len=size["steps"], inference_timesteps=2)
            torch.cuda.synchronize()
            rec = cudagraph_recordings(device)
            rows.append({"variant": variant, "wall_s": time.perf_counter() - t0, **graph_counts(),
                         "cudagraph_recordings": None if rec is None else rec - before})
        finally:
            if handle is not None:
                handle.revert()
    return record("whole_decode_optimized", env=env_record(device, "bfloat16"), params=dict(size), rows=rows,
                  identical=bool(torch.equal(outs["upstream"], outs["patched"])))


def stream_chunks(model, chunks: int, *, text: str, seed: int = 0, device="cpu", inference_timesteps: int = 2,
                  recordings=cudagraph_recordings) -> list[dict]:
    """Every chunk of one ``generate_streaming`` run: its ms, and after it the compile counters
    (:func:`fastattn.graphs.graph_counts`) and CUDA graphs recorded so far: a stream that records a graph per
    new shape shows it chunk by chunk (#209/#269; #293's one GPU-only hypothesis)."""
    from .bench.stream import time_chunks
    from .graphs import graph_counts

    def counters():
        g = graph_counts()
        return {"unique_graphs": g["unique_graphs"], "cudagraph_skips": g["cudagraph_skips"],
                "cudagraph_recordings": recordings(device)}
    torch.manual_seed(seed)
    gen = model.generate_streaming(text, min_len=chunks, max_len=chunks, inference_timesteps=inference_timesteps)
    _, rows = time_chunks(gen, device, counters)
    return [{"chunk": i, **r} for i, r in enumerate(rows)]


def _stream_under_upstream_optimize(device, size) -> dict:
    """A long stream (>= 600 chunks, twice) under voxcpm's own ``optimize()``: per chunk ms, host counters,
    graphs and recordings; the trend of the per-chunk cost over both streams (quiet chunks only)."""
    from .bench.records import env_record, record
    from .bench.stream import sixths, text_for
    from .bench.trend import describe, trend
    from .graphs import reset_graph_counts
    from .models import build_voxcpm2
    chunks = size.get("stream_chunks", 600)
    model = build_voxcpm2(size["preset"], device="cuda", dtype="bfloat16")
    torch._dynamo.reset()
    reset_graph_counts()
    upstream_optimized(model)
    rows = [dict(r, repeat=k) for k in range(2)
            for r in stream_chunks(model, chunks, text=text_for(chunks), device=device)]
    t = trend([[(r["chunk"], r["ms"], r["disturbed"]) for r in rows if r["repeat"] == k] for k in range(2)])
    six = sixths([r["ms"] for r in rows if r["repeat"] == 0])
    return record("stream_under_optimize", env=env_record(device, "bfloat16"), params={**size, "chunks": chunks},
                  rows=rows, sixths=six, trend=t, verdict=describe(t),
                  graphs_recorded_after_first_sixth=_grew_after(rows, "cudagraph_recordings"),
                  graphs_compiled_after_first_sixth=_grew_after(rows, "unique_graphs"))


def _grew_after(rows: list, key: str) -> Optional[int]:
    """How much a per-chunk counter grew after the first sixth of a stream (None where it is unknown)."""
    start = rows[len(rows) // 6][key] if rows else None
    return None if start is None or rows[-1][key] is None else rows[-1][key] - start


_DIFF_SCRIPT = """
import sys, torch, fastattn, voxcpm
from fastattn.models import build_voxcpm2
assert voxcpm.__file__.startswith(sys.argv[1]), voxcpm.__file__
preset, steps, out = sys.argv[2], int(sys.argv[3]), sys.argv[4]
m = build_voxcpm2(preset, device="cuda", dtype="bfloat16")
m.optimize()
assert "forward_step" in m.base_lm.__dict__, "optimize() did not compile"
torch.manual_seed(0)
w = m.generate("hello world " * 8, min_len=steps, max_len=steps, inference_timesteps=2)
torch.save({"shape": list(w.shape)}, out)
"""


def _diff_compiled(device, size) -> dict:
    """The upstream diff applied to a copy of voxcpm, decoding under upstream's own fullgraph compile."""
    from .bench.records import env_record, record
    from .upstream import run_in_patched_copy
    try:
        rows = [{"returncode": 0, **run_in_patched_copy("right-sized", _DIFF_SCRIPT, size["preset"], size["steps"],
                                                         timeout=900, env=child_env(device))}]
    except RuntimeError as exc:
        rows = [{"returncode": 1, "stderr": str(exc)}]
    return record("upstream_diff_compiled", env=env_record(device, "bfloat16"), params=dict(size), rows=rows)


def child_env(device) -> dict:
    """What a child process needs to run on ``device`` as ``"cuda"`` (voxcpm's ``optimize()`` wants exactly that):
    ``CUDA_VISIBLE_DEVICES`` narrowed to this process's current GPU (or ``cuda:N``'s), read through any
    ``CUDA_VISIBLE_DEVICES`` already set; nothing off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    index = torch.cuda.current_device() if device.index is None else device.index
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and index >= len(visible):
        raise ValueError(f"device {device} is past CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}")
    return {"CUDA_VISIBLE_DEVICES": visible[index] if visible else str(index)}


_KIT_SCRIPT = """
import statistics, sys, time, torch, fastattn, voxcpm
from fastattn.gpucheck import KIT_TEXT, stream_chunks, upstream_optimized
from fastattn.graphs import reset_graph_counts
from fastattn.models import build_voxcpm2, silence_progress
assert voxcpm.__file__.startswith(sys.argv[1]), voxcpm.__file__
silence_progress()
preset, device, steps, chunks, repeats, compile_, out = (sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
                                                         int(sys.argv[6]), sys.argv[7] == "1", sys.argv[8])
text = KIT_TEXT
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
models, wavs, rows = {}, {}, []
for mode in ("masked", "live"):
    m = build_voxcpm2(preset, device=device, dtype="bfloat16")
    for lm in (m.base_lm, m.residual_lm):
        lm.config.decode_attention = mode
    if compile_:
        upstream_optimized(m)
    torch.manual_seed(0)
    wavs[mode] = m.generate(text, min_len=steps, max_len=steps, inference_timesteps=2).cpu()  # warm-up, compiles
    models[mode] = m
times = {mode: [] for mode in models}
for _ in range(repeats):  # whole decodes, the two modes alternated
    for mode, m in models.items():
        sync(); t0 = time.perf_counter()
        m.generate(text, min_len=steps, max_len=steps, inference_timesteps=2)
        sync(); times[mode].append(time.perf_counter() - t0)
for mode, m in models.items():
    reset_graph_counts()
    stream = stream_chunks(m, chunks, text=text * 8, device=device)
    rows.append({"mode": mode, "phase": "optimize()" if compile_ else "eager", "wall_s": statistics.median(times[mode]),
                 "wall_samples_s": times[mode], "chunks": chunks, "chunk_ms": [r["ms"] for r in stream],
                 "unique_graphs": stream[-1]["unique_graphs"], "cudagraph_skips": stream[-1]["cudagraph_skips"],
                 "cudagraph_recordings": None if stream[0]["cudagraph_recordings"] is None
                 else stream[-1]["cudagraph_recordings"] - stream[0]["cudagraph_recordings"]})
torch.save({"rows": rows, "wavs": wavs}, out)
"""


def kit_decode(device, *, preset: str = "small", steps: int = 12, chunks: int = 600, repeats: int = 3,
               compile: Optional[bool] = None) -> dict:
    """The ``decode-attention`` kit applied to a copy of voxcpm (a fresh process), bf16: a model per mode
    (``"masked"``, ``"live"``), each under upstream's own ``optimize()`` (``compile``, default on CUDA; its
    warm-up decode compiles), then ``repeats`` whole decodes of ``steps`` steps, the modes alternated, and a
    ``chunks``-chunk stream per mode counting dynamo graphs, cudagraph skips and CUDA graphs recorded after the
    first chunk. ``identical_off``: the mode-off warm-up decode equals upstream's decode here, made the same way
    (under ``optimize()`` when ``compile``: inductor's fusions may round differently from eager)."""
    from .bench.records import env_record, record
    from .upstream import run_in_patched_copy, upstream_decode
    device = select_device(device)
    compile = device.type == "cuda" if compile is None else compile
    try:
        res = run_in_patched_copy("decode-attention", _KIT_SCRIPT, preset, device, steps, chunks, repeats,
                                  "1" if compile else "0", timeout=3600, env=child_env(device))
    except RuntimeError as exc:
        return record("kit_decode", env=env_record(device, "bfloat16"), params={"preset": preset},
                      rows=[{"returncode": 1, "stderr": str(exc)}])
    _, ref = upstream_decode(preset, text=KIT_TEXT, steps=steps, dtype="bfloat16", seed=0, device=str(device),
                             prepare=upstream_optimized if compile else None)
    live, masked = res["wavs"]["live"], res["wavs"]["masked"]
    return record("kit_decode", env=env_record(device, "bfloat16"),
                  params={"preset": preset, "steps": steps, "chunks": chunks, "repeats": repeats, "compile": compile},
                  rows=res["rows"], identical_off=bool(torch.equal(ref, res["wavs"]["masked"])),
                  max_abs_diff_on=float((live.double() - masked.double()).abs().max()) if live.shape == masked.shape
                  else float("inf"))


def _failures(rec: dict) -> list[str]:
    """What a step's record says went wrong: outputs not bit-identical, a subprocess that failed."""
    out = [f"{rec['kind']}: not bit-identical to upstream"] if rec.get("identical") is False else []
    out += [f"{rec['kind']}: decode_attention off is not bit-identical to upstream"] \
        if rec.get("identical_off") is False else []
    out += [f"{rec['kind']}: exit status {r['returncode']}: {(r.get('stderr') or '').strip()[-160:]}"
            for r in rec.get("rows", []) if r.get("returncode") not in (None, 0)]
    return out


def select_device(device) -> torch.device:
    """The kit's device, resolved. ``cuda:N`` is made the current CUDA device and the kit then runs on
    ``"cuda"``: voxcpm's ``optimize()`` compiles only for exactly ``"cuda"``, and CUDA events, SDPA's
    eligibility checks and cudagraph trees all read the current device."""
    from .devices import resolve_device
    device = resolve_device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)
        return torch.device("cuda")
    return device


def gpu_check(device="cuda", *, quick: bool = False, out=None, log=print) -> Path:
    """Run the kit; return the folder holding its records and ``summary.md``."""
    from .bench.records import save_record
    asked = str(device)
    device = select_device(device)
    size = _sizes(device, quick)
    folder = Path(out) if out else Path("reports") / folder_name(device)
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"--out {folder}: exists and is not empty (a run never overwrites an earlier one)")
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"# fastattn gpu-check: {folder_name(device)}", "",
             f"device {asked} (current CUDA device {torch.cuda.current_device()})" if device.type == "cuda" else
             f"device {device}", f"quick={quick}, torch {torch.__version__}", "", "| step | outcome | seconds |",
             "|---|---|---|"]
    kept = {}  # step -> its records, for the sections after the table
    for name, fn, skip in _steps(device, size):
        if skip:
            lines.append(f"| {name} | skipped: {skip} | |")
            log(f"[gpu-check] {name}: skipped ({skip})")
            continue
        t0 = time.perf_counter()
        try:
            recs = kept[name] = fn()
            paths = [save_record(rec, folder, f"{name}-{i}" if i else name) for i, rec in enumerate(recs)]
            bad = [why for rec in recs for why in _failures(rec)]
            outcome = ("failed: " + "; ".join(bad) + " (records: " if bad else "ok: ") + \
                ", ".join(p.name for p in paths) + (")" if bad else "")
        except Exception as exc:  # noqa: BLE001 - one failing step is reported, the kit goes on
            outcome = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            (folder / f"{name}-error.txt").write_text(traceback.format_exc())
        lines.append(f"| {name} | {outcome} | {time.perf_counter() - t0:.1f} |")
        log(f"[gpu-check] {name}: {outcome.split(':')[0]} ({time.perf_counter() - t0:.1f} s)")
    lines += opt_in_section(kept.get("decode_forms"), kept.get("kit_decode"))
    atomic_write_text(folder / "summary.md", "\n".join(lines) + "\n")
    return folder


def opt_in_section(forms: Optional[list], kit: Optional[list]) -> list:
    """``summary.md``'s section on the CUDA opt-in: per dtype, the winning static-shape form and its margin
    (:func:`fastattn.experiments.decode_forms.form_verdict`), and the kit's decodes under ``optimize()``; where the
    steps did not run, that the choice is unmeasured."""
    from .experiments.decode_forms import form_lines, kit_lines
    out = ["", "## The CUDA opt-in: which decode form upstream should carry", ""]
    if not forms:
        out += ["Not measured in this run: the decode_forms step runs on CUDA only, and here it was skipped or "
                "stopped with an error (the table above says which). Until a GPU has run it, the CUDA choice is "
                "unmeasured.", ""]
    for rec in forms or []:
        out += [f"### {rec['params']['dtype']}, positions {rec['params']['positions']}", ""] + form_lines(rec) + [""]
    for rec in kit or []:
        if rec["rows"] and "mode" in rec["rows"][0]:
            out += ["### The decode-attention kit, whole decodes", ""] + kit_lines(rec)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastattn gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (the kit's own test)")
    ap.add_argument("--quick", action="store_true", help="small sizes: under 3 minutes on a modern GPU")
    ap.add_argument("--out", default=None, help="output folder (default: reports/<device>-<name>-torch<version>)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("[gpu-check] error: CUDA is not available on this machine; this kit validates the CUDA path "
              "(run it on a GPU box, or pass --device cpu --quick to test the kit itself)", file=sys.stderr)
        return 2
    try:
        folder = gpu_check(args.device, quick=args.quick, out=args.out)
    except ValueError as exc:
        print(f"[gpu-check] error: {exc}", file=sys.stderr)
        return 2
    print(f"[gpu-check] records and summary.md in {folder}")
    failed = "failed:" in (folder / "summary.md").read_text()
    return 1 if failed else 0
