"""One decode step, and the request's prefill (the first chunk's wait), split into voxcpm's components: the bytes and
FLOPs each reads (its modules' own parameters, counted as they are called), its time, and its floor on this machine.

A component's floor is the larger of its bytes at the streaming rate measured for its own GEMV/GEMM shapes and its
FLOPs at the best GEMM rate measured here (a small square GEMM's or those shapes'); efficiency is floor / time. The
step is a base-LM step's start to the next one's (the DiT, the local encoder and the chunk's VAE decode fall between),
the prefill is ``generate``'s start to the first base-LM step."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from fastattn.clock import elapsed_s, medians, stamp, sync
from fastattn.devices import resolve_device
from fastattn.models import build_voxcpm2, silence_progress
from fastattn.patch import patch_voxcpm

from .decode import Timers, replaced
from .floor import llc_bytes
from .records import env_record, record
from .stats import quiet, scaled_ci
from .stream import text_for

#: voxcpm's own names: its two LMs, the local encoder (LocEnc), the local DiT (UnifiedCFM's estimator passes), the
#: AudioVAE's decode of the chunk, and the small projections and stop head between them
COMPONENTS = ("base_lm", "residual_lm", "feat_encoder", "feat_decoder", "audio_vae", "projections")
PROJECTIONS = ("fsq_layer", "enc_to_lm_proj", "lm_to_dit_proj", "res_to_dit_proj", "fusion_concat_proj", "stop_proj",
               "stop_head")
PHASES = ("prefill", "step")


def component_of(name: str):
    top = name.split(".")[0]
    return "projections" if top in PROJECTIONS else top if top in COMPONENTS else None


def _own_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))


def _flops(module, x, out) -> int:
    """Multiply-adds x 2 of one Linear or Conv call (what the weights do; activations, norms and attention left out)."""
    if not isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
        return 0
    if isinstance(module, torch.nn.Linear):
        return 2 * x.numel() * module.out_features
    if isinstance(module, torch.nn.ConvTranspose1d):
        return 2 * x.numel() * module.out_channels // module.groups * module.kernel_size[0]
    return 2 * out.numel() * module.in_channels // module.groups * module.kernel_size[0]


class Counts:
    """Bytes, FLOPs and GEMV shapes per (window, component): window -1 is the prefill, ``k`` the k-th step."""

    def __init__(self):
        self.window, self.bytes, self.flops = -1, defaultdict(int), defaultdict(int)
        self.shapes = defaultdict(int)  # (phase, component, out, in, rows, dtype) -> bytes read through that shape
        self.dtypes = {}  # component -> the dtype of its weights (its FLOPs run at that dtype's peak)

    def hook(self, component: str):
        def count(module, args, out):
            x, b = args[0] if args and isinstance(args[0], torch.Tensor) else None, _own_bytes(module)
            self.bytes[self.window, component] += b
            self.flops[self.window, component] += 0 if x is None else _flops(module, x, out)
            self.dtypes.setdefault(component, next(module.parameters(recurse=False)).dtype)
            if isinstance(module, torch.nn.Linear) and x is not None:
                shape = (module.out_features, module.in_features, x.numel() // module.in_features)
                self.shapes[(PHASES[self.window >= 0], component, *shape, module.weight.dtype)] += b
        return count

    def per_window(self, kind: str, windows) -> dict:
        table = getattr(self, kind)
        return {c: statistics.fmean(table[w, c] for w in windows) for c in COMPONENTS}


@contextmanager
def counting(model, counts: Counts):
    """Hooks on every module of ``model`` with weights of its own (an embedding table reads one row: left out), by
    component; each base-LM step opens the next window."""
    hooks = [m.register_forward_hook(counts.hook(component_of(name))) for name, m in model.named_modules()
             if _own_bytes(m) and not isinstance(m, torch.nn.Embedding) and component_of(name)]  # a table: one row
    step = model.base_lm.forward_step

    def next_window(*a, **k):
        counts.window += 1
        return step(*a, **k)
    try:
        with replaced([(model.base_lm, "forward_step", next_window)]):
            yield counts
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def timed_components(model, timers: Timers):
    """Each component's calls timed into ``timers`` (the base LM's step marks the windows), prefill calls included."""
    calls = [("base_lm", "forward"), ("residual_lm", "forward_step"), ("residual_lm", "forward"),
             ("feat_encoder", "forward"), ("feat_decoder", "forward"), *((p, "forward") for p in PROJECTIONS)]
    wrap = [(getattr(model, m), attr, timers.wrap(component_of(m), getattr(getattr(model, m), attr)))
            for m, attr in calls]
    wrap += [(model.base_lm, "forward_step", timers.mark(timers.wrap("base_lm", model.base_lm.forward_step))),
             (model, "_feat_encoder_raw", timers.wrap("feat_encoder", model.feat_encoder.forward))]
    streaming_decode = model.audio_vae.streaming_decode

    @contextmanager
    def timed_decode(*a, **k):
        with streaming_decode(*a, **k) as dec:
            dec.decode_chunk = timers.wrap("audio_vae", dec.decode_chunk)
            yield dec
    with replaced([*wrap, (model.audio_vae, "streaming_decode", timed_decode)]):
        yield timers


def window_times(timers: Timers, start) -> list:
    """Per window (prefill first, then each whole step): ``{"wall_s", component: seconds}`` from the stamps."""
    sync(timers.device)
    bounds = [0.0] + [elapsed_s(start, m) for m in timers.marks]
    rows = [{"wall_s": b - a, **dict.fromkeys(COMPONENTS, 0.0)} for a, b in zip(bounds, bounds[1:])]
    for name, pairs in timers.samples.items():
        for a, b in pairs:
            at = elapsed_s(start, a)
            w = next((i for i in range(len(rows)) if at < bounds[i + 1]), None)
            if w is not None:
                rows[w][name] += elapsed_s(a, b)
    return rows


def stream_rate(out_f: int, in_f: int, rows: int, dtype, device, repeats: int = 5) -> tuple:
    """``(GB/s, GFLOP/s)`` of ``F.linear`` at this shape over distinct weights twice the last-level cache (the weights
    stream; at most 256 of them: a shape that small is call overhead, not bytes, at any rate)."""
    w_bytes = out_f * in_f * torch.tensor([], dtype=dtype).element_size()
    n = min(256, max(4, math.ceil(2 * llc_bytes(device) / w_bytes)))
    ws = [torch.randn(out_f, in_f, device=device).to(dtype) for _ in range(n)]
    x = torch.randn(rows, in_f, device=device).to(dtype)
    t = medians({"gemv": lambda: [F.linear(x, w) for w in ws]}, repeats=repeats, warmup=1, device=device)["gemv"]
    return n * w_bytes / t / 1e9, n * 2 * rows * in_f * out_f / t / 1e9


def gemm_peak(dtype, device, n: int = 256) -> float:
    """GFLOP/s of an ``n``-cube GEMM in ``dtype`` (small: without bf16 instructions a bf16 GEMM crawls)."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / medians({"gemm": lambda: a @ b}, repeats=5, warmup=1, device=device)["gemm"] / 1e9


def floors(counts: Counts, windows: dict, device) -> dict:
    """Per phase and component: bytes, FLOPs, streaming GB/s at its own shapes in that phase, and the floor (s)."""
    by_shape = {t: stream_rate(*t, device) for t in {s[2:] for s in counts.shapes}}  # (out, in, rows, dtype): once
    measured = {s: by_shape[s[2:]] for s in counts.shapes}
    rates = {s: gb_s for s, (gb_s, _) in measured.items()}
    # the compute ceiling per dtype: the best GFLOP/s seen, a square GEMM's or the model's own shapes'
    peak = {dt: max([gemm_peak(dt, device)] + [f for s, (_, f) in measured.items() if s[5] == dt])
            for dt in set(counts.dtypes.values())}
    top = max(rates.values())
    out = {"peak_gflops": {str(dt): p for dt, p in peak.items()},
           "rates_gb_s": {"/".join(map(str, k)): v for k, v in rates.items()}}
    for phase, ws in windows.items():
        nbytes, flops = counts.per_window("bytes", ws), counts.per_window("flops", ws)
        for c in COMPONENTS:
            mine = {s: b for s, b in counts.shapes.items() if s[:2] == (phase, c)}
            gb_s = sum(mine.values()) / sum(b / rates[s] for s, b in mine.items()) if mine else top
            t_bytes, t_flops = nbytes[c] / gb_s / 1e9, flops[c] / peak[counts.dtypes[c]] / 1e9
            out[phase, c] = {"bytes": nbytes[c], "flops": flops[c], "gb_per_s": gb_s, "dtype": str(counts.dtypes[c]),
                             "floor_s": max(t_bytes, t_flops), "bound": "bytes" if t_bytes >= t_flops else "flops"}
    return out


def _drain(model, text: str, steps: int, timesteps: int) -> int:
    return sum(1 for _ in model.generate_streaming(text, min_len=steps, max_len=steps, inference_timesteps=timesteps))


def _phase(name: str, windows: list, flags: list, floor: dict) -> tuple:
    """(rows per component, the phase's totals) over its windows, less the disturbed ones."""
    keep = quiet(windows, flags)
    wall = [w["wall_s"] for w in keep]
    rows = []
    for c in COMPONENTS:
        t = [w[c] for w in keep]
        med, f = statistics.median(t), floor[name, c]
        rows.append({"phase": name, "component": c, **f, "time_s": med, "time_ci": scaled_ci(t, 1.0),
                     "efficiency": f["floor_s"] / med if med > 0 else None, "n": len(t)})
    covered = [sum(w[c] for c in COMPONENTS) / w["wall_s"] for w in keep]
    totals = {"wall_s": statistics.median(wall), "wall_ci": scaled_ci(wall, 1.0), "n": len(wall),
              "disturbed": sum(flags), "dropped": len(windows) - len(keep), "coverage": statistics.median(covered),
              "rest_s": statistics.median(w["wall_s"] - sum(w[c] for c in COMPONENTS) for w in keep),
              "floor_s": sum(r["floor_s"] for r in rows)}
    return rows, {**totals, "efficiency": totals["floor_s"] / totals["wall_s"]}


def lever(rows: list) -> dict:
    """The step's biggest remaining lever: the component with the most time above its floor, and that headroom."""
    top = max((r for r in rows if r["phase"] == "step"), key=lambda r: r["time_s"] - r["floor_s"])
    return {"component": top["component"], "headroom_s": top["time_s"] - top["floor_s"], "time_s": top["time_s"],
            "floor_s": top["floor_s"], "bound": top["bound"]}


def step_split(preset: str = "tiny", *, steps: int = 8, repeats: int = 3, dtype="bfloat16", device="cpu",
               mode: str = "exact", inference_timesteps: int = 10, seed: int = 0, model=None) -> dict:
    """Record ``step_split``: a patched (``mode``) model streams ``steps`` chunks ``repeats`` times; rows per phase
    and component (bytes, FLOPs, GB/s, floor, time with its interval, efficiency), each phase's totals, the lever."""
    device = resolve_device(device)
    model = model or build_voxcpm2(preset, seed=seed, device=str(device), dtype=dtype)
    silence_progress()
    text, counts, passes = text_for(steps), Counts(), Counter()  # DiT passes per window
    hook = model.feat_decoder.estimator.register_forward_hook(lambda *_: passes.update([counts.window]))
    with patch_voxcpm(model, mode=mode):
        with counting(model, counts):  # 3 steps: the prefill's window, two whole steps, a tail
            torch.manual_seed(seed)
            _drain(model, text, 3, inference_timesteps)
        hook.remove()
        runs = []
        for _ in range(repeats):
            timers = Timers(device)
            with timed_components(model, timers):
                torch.manual_seed(seed)
                start = stamp(timers.cuda)
                _drain(model, text, steps, inference_timesteps)
            runs.append((window_times(timers, start), [False] + timers.step_disturbed()))
    floor = floors(counts, {"prefill": [-1], "step": [0, 1]}, device)
    rows, phases = [], {}
    for name, part in zip(PHASES, (slice(0, 1), slice(1, None))):  # the prefill's window, then the steps'
        windows, flags = ([x for run in runs for x in run[k][part]] for k in (0, 1))
        got, phases[name] = _phase(name, windows, flags, floor)
        rows += got
    params = {"preset": preset, "steps": steps, "repeats": repeats, "dtype": dtype, "mode": mode,
              "inference_timesteps": inference_timesteps, "seed": seed, "text_chars": len(text)}
    return record("step_split", env=env_record(device, dtype), params=params, rows=rows, phases=phases,
                  lever=lever(rows), dit_passes_per_step=statistics.fmean(passes[w] for w in (0, 1)),
                  peak_gflops=floor["peak_gflops"], rates_gb_s=floor["rates_gb_s"])
