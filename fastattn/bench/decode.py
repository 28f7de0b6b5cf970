"""A whole VoxCPM2 ``generate()``, upstream vs patched, split into where its time goes."""

from __future__ import annotations

import functools
import statistics
import time
from contextlib import contextmanager
from typing import Callable

import torch

from ..devices import resolve_device
from .records import env_record, record
from .timing import progress_bar, sync_device


class _Timers:
    """Per-component times within a decode, without extra syncs (CUDA events; perf_counter on CPU)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.samples: dict = {}

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*a, **k):
            if self.cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = fn(*a, **k)
                e.record()
                self.samples.setdefault(name, []).append((s, e))
            else:
                t0 = time.perf_counter()
                out = fn(*a, **k)
                self.samples.setdefault(name, []).append(time.perf_counter() - t0)
            return out
        return timed

    def totals_s(self) -> dict:
        if self.cuda:
            torch.cuda.synchronize()
            return {n: sum(s.elapsed_time(e) for s, e in v) / 1e3 for n, v in self.samples.items()}
        return {n: sum(v) for n, v in self.samples.items()}


@contextmanager
def _instrumented(model, timers: _Timers):
    """Time base LM step, residual LM step, local DiT, local encoder and decode-step attention."""
    import torch.nn.functional as F
    saved = []

    def put(obj, attr, name):
        saved.append((obj, attr, obj.__dict__.get(attr)))
        setattr(obj, attr, timers.wrap(name, getattr(obj, attr)))

    put(model.base_lm, "forward_step", "base_lm")
    put(model.residual_lm, "forward_step", "residual_lm")
    put(model.feat_decoder, "forward", "local_dit")
    put(model.feat_encoder, "forward", "local_encoder")
    raw = model.__dict__.get("_feat_encoder_raw")  # the prefill encoder call is not a decode step
    model.__dict__["_feat_encoder_raw"] = functools.partial(type(model.feat_encoder).forward, model.feat_encoder)
    sdpa = F.scaled_dot_product_attention
    timed_sdpa = timers.wrap("lm_attention", sdpa)

    def routed(q, *a, **k):  # decode-step calls (one query) inside the LMs; the DiT/encoder run Lq > 1
        return timed_sdpa(q, *a, **k) if q.dim() == 4 and q.shape[2] == 1 else sdpa(q, *a, **k)

    F.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
        model.__dict__.pop("_feat_encoder_raw", None)
        if raw is not None:
            model.__dict__["_feat_encoder_raw"] = raw
        for obj, attr, old in reversed(saved):
            if old is None:
                obj.__dict__.pop(attr, None)
            else:
                obj.__dict__[attr] = old


def whole_decode(preset: str = "tiny", *, steps: int = 12, dtype="bfloat16", device="cpu", seed: int = 0,
                 text: str = "The quick brown fox jumps over the lazy dog.", inference_timesteps: int = 10,
                 repeats: int = 2, mode: str = "exact", model=None, progress: bool = True) -> dict:
    """A VoxCPM2 ``generate()`` of ``steps`` decode steps, upstream vs patched, alternating, ``repeats`` each.

    Each run is split into base LM, residual LM, local DiT, local encoder, the
    decode-step attention inside the LMs (``lm_attention``, part of the two LM
    figures) and the rest (prefill, projections, stop head, VAE decode).
    ``identical`` says whether the patched waveform is ``torch.equal`` to upstream's;
    ``patched_granularity`` is the patched base-LM cache's window granularity, None where it holds all
    ``max_length`` slots (no exact window on the device: the patched decode is upstream's computation).
    """
    from ..models import build_voxcpm2, silence_progress
    from ..patch import cache_bytes, patch_voxcpm
    device = resolve_device(device)
    model = model or build_voxcpm2(preset, seed=seed, device=str(device), dtype=dtype)
    silence_progress()
    runs, wav, granularity = [], {}, None
    order = ["upstream", "patched"]
    for r in progress_bar(range(repeats), progress, "whole decode"):
        for variant in (order if r % 2 == 0 else order[::-1]):
            timers = _Timers(device)
            handle = patch_voxcpm(model, mode=mode) if variant == "patched" else None
            try:
                with _instrumented(model, timers):
                    torch.manual_seed(seed)
                    sync_device(device)
                    t0 = time.perf_counter()
                    out = model.generate(text, min_len=steps, max_len=steps, inference_timesteps=inference_timesteps)
                    sync_device(device)
                    wall = time.perf_counter() - t0
                kv = cache_bytes(model)["total"]
                cache = model.base_lm.kv_cache
                n_steps = cache.current_length
                if variant == "patched":
                    granularity = getattr(cache, "granularity", None)
            finally:
                if handle is not None:
                    handle.revert()
            parts = timers.totals_s()
            comp = {k: parts.get(k, 0.0) for k in ("base_lm", "residual_lm", "local_dit", "local_encoder")}
            runs.append({"variant": variant, "repeat": r, "wall_s": wall, **{f"{k}_s": v for k, v in comp.items()},
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


def patched_is_upstream(whole: dict) -> bool:
    """Whether a ``whole_decode`` record's patched decode was upstream's computation (its cache held every slot:
    no exact window on the device). Records from before the field say nothing: False."""
    return "patched_granularity" in whole and whole["patched_granularity"] is None


def time_shares(whole: dict, variant: str = "upstream") -> dict:
    """Median share of ``variant``'s wall time per component of a ``whole_decode`` record (``lm_attention``,
    ``local_dit``, ...): Amdahl's inputs, computed in one place."""
    rows = [r for r in whole["rows"] if r["variant"] == variant]
    wall = statistics.median(r["wall_s"] for r in rows)
    keys = [k[:-2] for k in rows[0] if k.endswith("_s") and k != "wall_s"]
    return {k: statistics.median(r[f"{k}_s"] for r in rows) / wall for k in keys}

