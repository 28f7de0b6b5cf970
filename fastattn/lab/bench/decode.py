"""A whole VoxCPM2 ``generate()``, upstream vs patched, split into where its time goes."""

from __future__ import annotations

import functools
import statistics
import time
from contextlib import contextmanager, nullcontext
from typing import Callable, Optional

import torch

from fastattn.clock import elapsed_s, medians, rotated, stamp, sync
from fastattn.devices import resolve_device
from fastattn.models import build_voxcpm2, count_parameters, silence_progress
from fastattn.patch import cache_bytes, patch_voxcpm

from ..machine import cpu_flags, runtime_dtype
from .metrics import dtype_table, quiet_steps, time_shares  # noqa: F401 (re-exported)
from .noise import delta, disturbed_series, host_counters
from .records import env_record, record
from .rss_probe import peak, reset_peak, trim
from .stats import ratio_ci
from .timing import progress_bar


class Timers:
    """Per-component seconds within a decode, without extra syncs (CUDA events, else perf_counter)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.samples: dict = {}
        self.marks: list = []  # one per base-LM decode step, at its start: the loop's period is a step
        self.hosts: list = []  # the host counters at each mark (:func:`.noise.host_counters`)

    @property
    def cuda(self) -> bool:
        """Whether the stamps are CUDA events (else perf_counter)."""
        return self.device.type == "cuda"

    def mark(self, fn: Callable) -> Callable:
        def marked(*a, **k):
            self.marks.append(stamp(self.cuda))
            self.hosts.append(host_counters())
            return fn(*a, **k)
        return marked

    def step_disturbed(self) -> list:
        """Per step of :meth:`step_s`: whether other processes or preemption took it (:mod:`.noise`)."""
        return disturbed_series(self.step_s(), [delta(a, b) for a, b in zip(self.hosts, self.hosts[1:])])

    def step_s(self) -> list:
        """Seconds of each decode step but the last (one base-LM step's start to the next)."""
        sync(self.device)
        return [elapsed_s(a, b) for a, b in zip(self.marks, self.marks[1:])]

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*a, **k):
            start = stamp(self.cuda)
            out = fn(*a, **k)
            self.samples.setdefault(name, []).append((start, stamp(self.cuda)))
            return out
        return timed

    def totals_s(self) -> dict:
        """Seconds per component since the last call (which cleared the samples)."""
        sync(self.device)
        out = {n: sum(elapsed_s(a, b) for a, b in v) for n, v in self.samples.items()}
        self.samples = {}
        return out


def timer_overhead_us(n: int = 2000) -> float:
    """Microseconds :meth:`Timers.wrap` adds to one call on CPU (``n`` timed vs bare no-ops, interleaved)."""
    noop = lambda: None  # noqa: E731
    timed = Timers("cpu").wrap("x", noop)
    t = medians({"timed": lambda: [timed() for _ in range(n)], "bare": lambda: [noop() for _ in range(n)]},
                repeats=5, warmup=1)
    return (t["timed"] - t["bare"]) / n * 1e6


@contextmanager
def replaced(pairs):
    """Each ``(object, attribute, value)`` set in the object's own ``__dict__`` for a block; what was there restored."""
    saved = [(obj, attr, obj.__dict__.get(attr)) for obj, attr, _ in pairs]
    for obj, attr, value in pairs:
        obj.__dict__[attr] = value
    try:
        yield
    finally:
        for obj, attr, old in reversed(saved):
            if old is None:
                obj.__dict__.pop(attr, None)
            else:
                obj.__dict__[attr] = old


@contextmanager
def instrumented(model, timers: Timers, *, attention: bool = True, vae: bool = False):
    """Time ``base_lm``, ``residual_lm``, ``local_dit``, ``local_encoder``, optionally ``lm_attention`` (decode-step
    SDPA in the LMs) and ``vae`` (streaming decode per chunk) into ``timers``; restored on exit."""
    import torch.nn.functional as F
    pairs = [(model.base_lm, "forward_step", timers.mark(timers.wrap("base_lm", model.base_lm.forward_step))),
             (model.residual_lm, "forward_step", timers.wrap("residual_lm", model.residual_lm.forward_step)),
             (model.feat_decoder, "forward", timers.wrap("local_dit", model.feat_decoder.forward)),
             (model.feat_encoder, "forward", timers.wrap("local_encoder", model.feat_encoder.forward)),
             # the prefill encoder call is not a decode step
             (model, "_feat_encoder_raw", functools.partial(type(model.feat_encoder).forward, model.feat_encoder))]
    if vae:
        streaming_decode = model.audio_vae.streaming_decode

        @contextmanager
        def timed_streaming_decode(*a, **k):  # its decoder's decode_chunk timed as ``vae``
            with streaming_decode(*a, **k) as dec:
                dec.decode_chunk = timers.wrap("vae", dec.decode_chunk)
                yield dec
        pairs.append((model.audio_vae, "streaming_decode", timed_streaming_decode))
    sdpa = F.scaled_dot_product_attention
    timed_sdpa = timers.wrap("lm_attention", sdpa)

    def routed(q, *a, **k):  # decode-step calls (one query) inside the LMs; the DiT/encoder run Lq > 1
        return timed_sdpa(q, *a, **k) if q.dim() == 4 and q.shape[2] == 1 else sdpa(q, *a, **k)

    if attention:
        F.scaled_dot_product_attention = routed
    try:
        with replaced(pairs):
            yield
    finally:
        F.scaled_dot_product_attention = sdpa


def whole_decode(preset: str = "tiny", *, steps: int = 12, dtype="bfloat16", device="cpu", seed: int = 0,
                 text: str = "The quick brown fox jumps over the lazy dog.", inference_timesteps: int = 10,
                 repeats: int = 2, mode: str = "exact", model=None, progress: bool = True) -> dict:
    """A ``generate()`` of ``steps`` decode steps, upstream vs patched, alternating. Rows per run: ``wall_s``, per
    component ``*_s`` (``lm_attention_s`` is inside the LM figures; ``rest_s``: prefill, stop head, VAE...),
    ``step_seconds``, ``step_disturbed``. ``identical``: waveforms ``torch.equal``; ``patched_granularity``: None
    where the patched cache holds all slots (no exact window: the patched decode is upstream's computation)."""
    device = resolve_device(device)
    model = model or build_voxcpm2(preset, seed=seed, device=str(device), dtype=dtype)
    silence_progress()
    runs, wav, granularity = [], {}, None
    order = ["upstream", "patched"]
    for r in progress_bar(range(repeats), progress, "whole decode"):
        for variant in rotated(order, r):
            timers = Timers(device)
            with patch_voxcpm(model, mode=mode) if variant == "patched" else nullcontext():
                with instrumented(model, timers):
                    torch.manual_seed(seed)
                    sync(device)
                    t0 = time.perf_counter()
                    out = model.generate(text, min_len=steps, max_len=steps, inference_timesteps=inference_timesteps)
                    sync(device)
                    wall = time.perf_counter() - t0
                kv = cache_bytes(model)["total"]
                cache = model.base_lm.kv_cache
                n_steps = cache.current_length
                if variant == "patched":
                    granularity = getattr(cache, "granularity", None)
            parts = timers.totals_s()
            comp = {k: parts.get(k, 0.0) for k in ("base_lm", "residual_lm", "local_dit", "local_encoder")}
            runs.append({"variant": variant, "repeat": r, "wall_s": wall, "step_seconds": timers.step_s(),
                         "step_disturbed": timers.step_disturbed(),
                         **{f"{k}_s": v for k, v in comp.items()},
                         "lm_attention_s": parts.get("lm_attention", 0.0),
                         "rest_s": wall - sum(comp.values()), "kv_bytes": kv, "final_length": n_steps})
            wav.setdefault(variant, out)
    identical = bool(torch.equal(wav["upstream"], wav["patched"]))
    med = {v: statistics.median(x["wall_s"] for x in runs if x["variant"] == v) for v in order}
    params = {"preset": preset, "steps": steps, "dtype": dtype, "text": text, "mode": mode,
              "inference_timesteps": inference_timesteps, "repeats": repeats,
              "weights": getattr(model, "fastattn_info", {}).get("weights", "random")}
    return record("whole_decode", env=env_record(device, dtype), params=params, rows=runs, identical=identical,
                  median_wall_s=med, ratio=med["patched"] / med["upstream"], patched_granularity=granularity)


def steps_for(step_s: float, budget_s: float, *, steps: int, minimum: int = 3, repeats: int = 2) -> int:
    """Decode steps per ``generate`` that fit ``budget_s`` (2 x ``repeats`` runs), in ``[minimum, steps]``."""
    fit = int(budget_s / (2 * repeats * step_s)) - 1
    return max(minimum, min(steps, fit))


def dtype_decode(preset: str = "full", *, dtypes=("bfloat16", "float32"), steps: int = 12, device="cpu",
                 seed: int = 0, inference_timesteps: int = 10, repeats: int = 2, budget_s: Optional[float] = None,
                 min_steps: int = 3, progress: bool = False) -> dict:
    """:func:`whole_decode` once per dtype, each model built in turn; ``budget_s`` is split over the dtypes left.
    ``dtypes[d]``: ``build_s``, ``weights_bytes``, ``peak_bytes`` (over its decodes, the fp32 build transient left
    out), the ``decode`` record; ``step_s``: each dtype's median upstream step."""
    device = resolve_device(device)
    out, sizing, spent, measured = {}, {}, 0.0, 0.0
    for i, dtype in enumerate(dtypes):
        t0 = time.perf_counter()
        model = build_voxcpm2(preset, seed=seed, device=str(device), dtype=dtype)
        build_s = time.perf_counter() - t0
        silence_progress()
        reset = reset_peak(device)  # the run's peak, not the build's (voxcpm builds in fp32, then casts)
        n = steps
        if budget_s is not None:
            t1 = time.perf_counter()  # one step and its prefill: an upper bound of a step
            model.generate("Warm up.", min_len=1, max_len=1, inference_timesteps=inference_timesteps)
            warm_step = time.perf_counter() - t1
            left = (budget_s - spent - build_s) / (len(dtypes) - i)
            n = steps_for(warm_step, left, steps=steps, minimum=min_steps, repeats=repeats)
            sizing[dtype] = {"warm_step_s": warm_step, "budget_s": left, "steps": n}
        rec = whole_decode(preset, steps=n, dtype=dtype, device=device, seed=seed, repeats=repeats, model=model,
                           inference_timesteps=inference_timesteps, progress=progress)
        measured += sum(r["wall_s"] for r in rec["rows"])
        out[dtype] = {"build_s": build_s, "weights_bytes": sum(p.numel() * p.element_size() for p in
                                                               model.parameters()),
                      "parameters": count_parameters(model), "peak_bytes": peak(device),
                      "peak_since": "this dtype's decodes" if reset else "the process's start", "decode": rec}
        del model
        trim(device)  # hand the model's memory back: the next dtype's peak starts clean
        spent += time.perf_counter() - t0
    step_s = {d: statistics.median(quiet_steps(o["decode"], "upstream")[0]) for d, o in out.items()}
    params = {"preset": preset, "dtypes": list(dtypes), "steps": steps, "min_steps": min_steps,
              "inference_timesteps": inference_timesteps, "repeats": repeats, "budget_s": budget_s}
    return record("dtype_decode", env=env_record(device, dtypes[0]), params=params, rows=[], dtypes=out,
                  flags=cpu_flags() if device.type == "cpu" else {},
                  sizing=sizing, step_s=step_s, measured_s=measured,
                  build_s=statistics.mean(o["build_s"] for o in out.values()), spent_s=spent)


def whole_dtypes(device, dtype: str) -> tuple:
    """05's dtypes: voxcpm's own first (every ratio's base), float32, ``dtype``, and float16 on CUDA."""
    extra = ("float32", dtype) + (("float16",) if torch.device(device).type == "cuda" else ())
    return tuple(dict.fromkeys((runtime_dtype(device),) + extra))


def compiled_decode(preset: str = "full", *, steps: int = 8, repeats: int = 3, dtype="bfloat16", device="cpu",
                    seed: int = 0, inference_timesteps: int = 10, text: str = "The quick brown fox jumps over the lazy "
                    "dog.") -> dict:
    """Whole decodes eager against compiled (:func:`fastattn.optimize`: the parts voxcpm's ``optimize()`` compiles,
    which voxcpm itself compiles only on CUDA), upstream and patched, each pair interleaved: record
    ``compiled_decode`` (per variant: the ratio with its interval, compile plus first decode, the output's
    difference against eager)."""
    from fastattn.graphs import optimize

    device, out = resolve_device(device), {}
    silence_progress()
    for variant in ("upstream", "patched"):
        models = {k: build_voxcpm2(preset, seed=seed, device=str(device), dtype=dtype) for k in ("eager", "compiled")}
        with patch_voxcpm(models["eager"]) if variant == "patched" else nullcontext() as handle:
            if handle:
                handle.convert(models["compiled"])
            report = optimize(models["compiled"]).fastattn_compiled  # a revert deoptimizes: read it now

            def gen(m):
                return m.generate(text, min_len=steps, max_len=steps, inference_timesteps=inference_timesteps)
            t0 = time.perf_counter()
            torch.manual_seed(seed)
            first = gen(models["compiled"])
            compile_s = time.perf_counter() - t0
            walls, hosts, wav = {"eager": [], "compiled": []}, {"eager": [], "compiled": []}, {}
            for r in range(repeats):
                for k in rotated(walls, r):
                    torch.manual_seed(seed)
                    sync(device)
                    t1, h1 = time.perf_counter(), host_counters()
                    wav[k] = gen(models[k])
                    sync(device)
                    walls[k].append(time.perf_counter() - t1)
                    hosts[k].append(delta(h1, host_counters()))
        diff = (wav["compiled"].double() - wav["eager"].double()).abs()
        flags = {k: disturbed_series(walls[k], hosts[k]) for k in walls}
        quiet = [i for i in range(repeats) if not (flags["eager"][i] or flags["compiled"][i])]
        keep = quiet if len(quiet) >= 3 else range(repeats)  # the ratio over the rounds neither was disturbed in
        med = {k: statistics.median(v[i] for i in keep) for k, v in walls.items()}
        out[variant] = {"wall_s": walls, "disturbed_flags": flags, "rounds_used": len(keep), "median_s": med,
                        "ratio": med["compiled"] / med["eager"], "ratio_ci": ratio_ci(
                            [walls["compiled"][i] for i in keep], [walls["eager"][i] for i in keep]),
                        "compile_and_first_s": compile_s,
                        "first_identical_to_repeat": bool(torch.equal(first, wav["compiled"])),
                        "max_abs_diff": diff.max().item(),
                        "output_rms": wav["eager"].double().pow(2).mean().sqrt().item(),
                        "compiled": report["compiled"], "failed": report["failed"]}
        del models
    params = {"preset": preset, "steps": steps, "repeats": repeats, "dtype": dtype, "text": text,
              "inference_timesteps": inference_timesteps, "float64_reference": None}
    return record("compiled_decode", env=env_record(device, dtype), params=params, variants=out, rows=[
        {"variant": v, **{k: o[k] for k in ("ratio", "compile_and_first_s", "max_abs_diff", "output_rms")},
         "ratio_low": o["ratio_ci"] and o["ratio_ci"][0], "ratio_high": o["ratio_ci"] and o["ratio_ci"][1]}
        for v, o in out.items()])
