"""The symptom users report, measured: time per streamed chunk over a long ``generate_streaming`` run.

OpenBMB/VoxCPM issue #293: streaming starts at ~0.3 s per chunk and slows to 1-2 s
after 400+ chunks. :func:`stream_profile` times every chunk of the same stream
(same text, seed and length) for upstream and the patched modes, alternately and
repeated, and says from the data whether the cost per chunk grows along the stream.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from ..devices import resolve_device
from .records import env_record, record
from .timing import _progress, _sync

VARIANTS = ("upstream", "exact", "fast")
SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank. "


def _text_for(chunks: int) -> str:
    """A text long enough that voxcpm's length cap (about 6 tokens of audio per text token) allows ``chunks``."""
    return SENTENCE * max(1, -(-(chunks // 5 + 10) // len(SENTENCE)))


def _one_stream(model, variant: str, text: str, chunks: int, seed: int, inference_timesteps: int, device):
    from ..patch import patch_voxcpm

    handle = patch_voxcpm(model, mode=variant) if variant != "upstream" else None
    try:
        torch.manual_seed(seed)
        gen = model.generate_streaming(text, min_len=chunks, max_len=chunks, inference_timesteps=inference_timesteps)
        out, ms, pos = [], [], []
        _sync(device)
        t0 = time.perf_counter()
        for chunk in gen:
            _sync(device)
            t1 = time.perf_counter()
            out.append(chunk)
            ms.append((t1 - t0) * 1e3)
            pos.append(model.base_lm.kv_cache.current_length - 1)
            t0 = time.perf_counter()
    finally:
        if handle is not None:
            handle.revert()
    return out, ms, pos


def sixths(values: Sequence[float]) -> list:
    """Medians of each sixth of a sequence (the first chunk, which includes the prefill, left out)."""
    v = list(values)[1:]
    n = len(v)
    return [statistics.median(v[i * n // 6:(i + 1) * n // 6]) for i in range(6) if v[i * n // 6:(i + 1) * n // 6]]


def verdict(sixth_medians: Sequence[float], *, tolerance: float = 0.2) -> str:
    """"decays" when the last sixth is more than ``tolerance`` slower than the first, "speeds up" when faster,
    else "flat", with the change in percent."""
    first, last = sixth_medians[0], sixth_medians[-1]
    change = last / first - 1
    word = "decays" if change > tolerance else "speeds up" if change < -tolerance else "flat"
    return f"{word} ({change:+.0%} from the first to the last sixth)"


def stream_profile(preset: str, chunks: int, *, dtype="bfloat16", device="cpu",
                   modes: Sequence[str] = VARIANTS, seed: int = 0, inference_timesteps: int = 2,
                   progress: bool = True, repeats: int = 1, model=None) -> dict:
    """Every chunk of a ``generate_streaming`` run timed per variant (the same text, seed and length;
    variants run alternately, ``repeats`` times each), with whether each variant's stream equals upstream's.

    Returns ``{"kind": "stream_profile", "env", "params", "rows": [{"variant", "repeat", "chunk",
    "position", "ms"}, ...], "identical": {variant: bool}, "sixths": {variant: [median ms]},
    "verdict": {variant: str}}``. The first chunk carries the prefill and is left out of the sixths.
    """
    from ..models import build_voxcpm2, silence_progress

    bad = [m for m in modes if m not in VARIANTS]
    if bad or not modes:
        raise ValueError(f"modes must be a non-empty selection of {VARIANTS}, got {list(modes)}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 7:
        raise ValueError(f"chunks must be an int >= 7 (six sixths and a first chunk), got {chunks!r}")
    device = resolve_device(device)
    model = model or build_voxcpm2(preset, seed=seed, device=str(device), dtype=dtype)
    silence_progress()
    text = _text_for(chunks)
    rows, streams = [], {}
    order = list(modes)
    for r in _progress(range(repeats), progress, "stream profile"):
        for variant in order[r % len(order):] + order[:r % len(order)]:
            out, ms, pos = _one_stream(model, variant, text, chunks, seed, inference_timesteps, device)
            streams.setdefault(variant, out)
            rows += [{"variant": variant, "repeat": r, "chunk": i, "position": p, "ms": t}
                     for i, (t, p) in enumerate(zip(ms, pos))]
    ref = streams.get("upstream")
    identical = {v: (ref is not None and len(s) == len(ref) and all(torch.equal(a, b) for a, b in zip(s, ref)))
                 for v, s in streams.items()}
    per = {v: [statistics.median(x["ms"] for x in rows if x["variant"] == v and x["chunk"] == i)
               for i in range(chunks) if any(x["variant"] == v and x["chunk"] == i for x in rows)] for v in modes}
    six = {v: sixths(per[v]) for v in modes}
    params = {"preset": preset, "chunks": chunks, "dtype": dtype, "modes": list(modes), "seed": seed,
              "inference_timesteps": inference_timesteps, "repeats": repeats, "text_chars": len(text),
              "weights": getattr(model, "fastattn_info", {}).get("weights", "random")}
    return record("stream_profile", env=env_record(device, dtype), params=params, rows=rows, identical=identical,
                  sixths=six, verdict={v: verdict(six[v]) for v in modes})
