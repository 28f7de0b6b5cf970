"""The static-shape decode forms side by side (:mod:`fastattn.static`): per-step time at positions across the
cache, eager and compiled, with each form's error against float64 and its graph count, for the CUDA opt-in.

:func:`form_sweep` writes one ``decode_forms`` record; :func:`fastattn.experiments.decode_forms.form_verdict`
reads it (a winner only where the intervals separate it). On CUDA the compiled forms run under
``mode="reduce-overhead"`` (CUDA graphs, as upstream's ``optimize()``) and the record counts the CUDA graphs
each recorded over its calls.
"""

from __future__ import annotations

import torch

from ..devices import dtype_name, dtype_of, resolve_device
from ..static import FORMS, check_form, compile_form, decode_data, form_caller, fresh_calls
from .records import env_record, record
from .timing import progress_bar, stats_ms, time_interleaved

__all__ = ["form_sweep"]


@torch.no_grad()
def form_sweep(positions, *, device="cpu", dtype="bfloat16", capacity: int = 8192, hq: int = 16, hkv: int = 2,
               head_dim: int = 128, bucket: int = 256, repeats: int = 7, warmup: int = 2, steps: int = 600,
               compiled=(False, True), forms=None, seed: int = 0, progress: bool = True) -> dict:
    """Per-step ms of every form at each position (``0 <= p < capacity``), eager and compiled, the forms
    interleaved call by call at each position (bench's timer: shuffled order, CUDA events on CUDA, host
    disturbance flags), each call at a key count no earlier call used, walking away from ``p`` as a decode
    does (:func:`fastattn.static.fresh_calls`: cuDNN's per-length plans are paid here as in a decode).

    ``checks`` holds :func:`fastattn.static.check_form` for each form compiled (error against float64 over the
    dense sweep, graphs over ``steps`` consecutive positions, determinism, the reason where it cannot compile;
    on CUDA the CUDA graphs it recorded). A form that fails to compile or run is timed eagerly only."""
    device = resolve_device(device)
    dt = dtype_of(dtype)
    names = list(forms or FORMS)
    bad = [n for n in names if n not in FORMS]
    if bad or not all(0 <= p < capacity for p in positions):
        raise ValueError(f"forms must be among {sorted(FORMS)} and positions in [0, capacity={capacity}); got "
                         f"forms {bad}, positions {list(positions)}")
    mode = "reduce-overhead" if device.type == "cuda" else None
    checks = [check_form(n, device, dt, hq=hq, hkv=hkv, head_dim=head_dim, capacity=capacity, bucket=bucket,
                         steps=steps, compile_mode=mode, seed=seed) for n in names]
    usable = [c["form"] for c in checks if c["available"]]
    q, kc, vc = decode_data(device, dt, hq, hkv, head_dim, capacity, seed)
    rows = []
    for comp in compiled:
        torch._dynamo.reset()
        calls = {n: form_caller(n, compile_form(FORMS[n], "inductor", mode) if comp else FORMS[n].fn, q, kc, vc,
                                bucket) for n in (usable if comp else names)}
        for p in progress_bar(positions, progress, f"forms {'compiled' if comp else 'eager'} {dtype_name(dt)}"):
            host = {}
            times = time_interleaved(fresh_calls(calls, p, capacity), repeats=repeats, warmup=warmup, device=device,
                                     seed=seed + p, host=host)
            rows += [{"form": n, "compiled": comp, "position": p, **stats_ms(t, host.get(n))}
                     for n, t in times.items()]
    params = {"positions": list(positions), "capacity": capacity, "dtype": dtype_name(dt), "hq": hq, "hkv": hkv,
              "head_dim": head_dim, "bucket": bucket, "repeats": repeats, "warmup": warmup, "steps": steps,
              "compile_mode": mode, "forms": names, "key_counts": "fresh per call, walking from each position"}
    return record("decode_forms", env=env_record(device, dt), params=params, rows=rows, checks=checks)
