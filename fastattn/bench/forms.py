"""The static-shape decode forms (:mod:`fastattn.static`) timed as a decode runs them: a stack of ``layers`` calls per
replay, static inputs, a fresh position per call. :func:`form_sweep` writes the ``decode_forms`` record that
:func:`fastattn.experiments.decode_forms.form_verdict` reads; :func:`stack_sweep` times any set of variants."""

from __future__ import annotations

import statistics

import torch

from ..devices import dtype_name, dtype_of, resolve_device
from ..static import FORMS, check_form, compile_form, form_caller, fresh_calls, layer_stack, stack_data
from .records import env_record, record
from .timing import progress_bar, stats_ms, time_interleaved

__all__ = ["form_sweep", "stack_sweep"]


@torch.no_grad()
def stack_sweep(variants: dict, positions, *, device, dtype, capacity: int, hq: int, hkv: int, head_dim: int,
                bucket: int, repeats: int, warmup: int, seed: int, mode, progress: bool = False) -> list:
    """Rows per variant and position. ``variants`` is {name: (form, compiled, static, layers)}: a stack of ``layers``
    calls of the form (:func:`fastattn.static.layer_stack`), one call per sample (on CUDA one replay), all variants
    interleaved at fresh positions; ``static`` marks q/K/V static (variants with and without marks get their own
    tensors). Each row: bench's stats (ms per stack), ``per_layer_ms`` and ``host_ms_per_call`` (the call's host
    time until it returns, no sync: a replay's harness overhead on CUDA)."""
    data = {s: stack_data(device, dtype, hq, hkv, head_dim, capacity, seed, max(v[3] for v in variants.values()))
            for s in {v[2] for v in variants.values()}}
    hosts = {n: [] for n in variants}
    calls = {}
    for n, (form, comp, static, layers) in variants.items():
        q, caches = data[static]
        fn = compile_form(FORMS[form], "inductor", mode, layers) if comp else layer_stack(FORMS[form].fn, layers, n)
        calls[n] = form_caller(form, fn, q, caches[:layers], bucket, static=static, host=hosts[n])
    rows = []
    for p in progress_bar(positions, progress, f"forms {dtype_name(dtype)}"):
        for h in hosts.values():
            h.clear()
        counters = {}
        times = time_interleaved(fresh_calls(calls, p, capacity, warmup + repeats, bucket), repeats=repeats,
                                 warmup=warmup, device=device, seed=seed + p, host=counters)
        for n, (form, comp, static, layers) in variants.items():
            st = stats_ms(times[n], counters.get(n))
            rows.append({"variant": n, "form": form, "compiled": comp, "static": static, "layers": layers,
                         "position": p, **st, "per_layer_ms": st["median_ms"] / layers,
                         "host_ms_per_call": statistics.median(hosts[n][warmup:]) * 1e3})
    return rows


def form_sweep(positions, *, device="cpu", dtype="bfloat16", capacity: int = 8192, hq: int = 16, hkv: int = 2,
               head_dim: int = 128, bucket: int = 256, repeats: int = 7, warmup: int = 2, steps: int = 600,
               compiled=(False, True), forms=None, seed: int = 0, progress: bool = True, layers: int = 28) -> dict:
    """Every form at each position (``0 <= p < capacity``), eager and compiled, as stacks of ``layers`` (VoxCPM2's
    base LM has 28) with static inputs (:func:`stack_sweep`). ``checks``: :func:`fastattn.static.check_form` of
    each form (on CUDA under ``reduce-overhead``, as upstream's ``optimize()``); a form that fails it is timed
    eagerly only."""
    device, dt = resolve_device(device), dtype_of(dtype)
    names = list(forms or FORMS)
    bad = [n for n in names if n not in FORMS]
    if bad or not all(0 <= p < capacity for p in positions):
        raise ValueError(f"forms must be among {sorted(FORMS)} and positions in [0, capacity={capacity}); got "
                         f"forms {bad}, positions {list(positions)}")
    mode = "reduce-overhead" if device.type == "cuda" else None
    checks = [check_form(n, device, dt, hq=hq, hkv=hkv, head_dim=head_dim, capacity=capacity, bucket=bucket,
                         steps=steps, compile_mode=mode, seed=seed) for n in names]
    usable = [c["form"] for c in checks if c["available"]]
    variants = {f"{n} {'compiled' if c else 'eager'}": (n, c, c, layers) for c in compiled
                for n in (usable if c else names)}
    rows = stack_sweep(variants, positions, device=device, dtype=dt, capacity=capacity, hq=hq, hkv=hkv,
                       head_dim=head_dim, bucket=bucket, repeats=repeats, warmup=warmup, seed=seed, mode=mode,
                       progress=progress)
    params = {"positions": list(positions), "capacity": capacity, "dtype": dtype_name(dt), "hq": hq, "hkv": hkv,
              "head_dim": head_dim, "bucket": bucket, "repeats": repeats, "warmup": warmup, "steps": steps,
              "compile_mode": mode, "forms": names, "layers": layers, "static_inputs": True,
              "key_counts": "fresh per call, walking from each position within its bucket"}
    return record("decode_forms", env=env_record(device, dt), params=params, rows=rows, checks=checks)
