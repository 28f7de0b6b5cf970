"""The caller's side of a stream (#293): consumers that reprocess the whole clip every chunk, alone and beside it."""

from __future__ import annotations

import base64
import functools
import io
import statistics
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np
import torch

from fastattn.clock import medians, rotated
from fastattn.models import build_voxcpm2, silence_progress

from .records import env_record, record
from .stats import ratio_ci
from .stream import text_for, time_chunks
from .trend import resistant_slope

CHUNK_SAMPLES = 7680  # one VoxCPM2 chunk: a 4-frame patch, 160 ms at 48 kHz
SAMPLE_RATE = 48000
AT = (1, 25, 50, 100, 200, 400, 600)


def _wav_b64(clip: np.ndarray, sr: int) -> bytes:
    import wave
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes((np.clip(clip, -1, 1) * 32767).astype("<i2").tobytes())
    return base64.b64encode(buf.getvalue())


def _encode(fmt: str, subtype: Optional[str], prev, clip, chunk, sr) -> bytes:
    """Encode the whole clip in chunk-sized blocks (libsndfile 1.2's Vorbis encoder crashes on one huge write)."""
    import soundfile as sf
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", sr, 1, format=fmt, subtype=subtype) as f:
        for i in range(0, len(clip), CHUNK_SAMPLES):
            f.write(clip[i:i + CHUNK_SAMPLES])
    return buf.getvalue()


#: lossy codecs tried through libsndfile: name -> (format, subtype)
CODECS = {"MP3": ("MP3", "MPEG_LAYER_III"), "OGG Vorbis": ("OGG", "VORBIS")}


def codec_pattern(name: str) -> str:
    """The pattern name of encoding the whole clip with codec ``name`` (:data:`CODECS`)."""
    return f"encode the whole clip to {name} (libsndfile)"


def patterns() -> tuple:
    """``({name: fn(prev, clip, chunk, sr)}, {name: why skipped})``: each pattern's work as ``chunk`` arrives."""
    import librosa
    out = {
        "append, concatenate once": None,  # timed apart: an append per chunk, one concatenation at the end
        "concatenate every chunk": lambda prev, clip, chunk, sr: np.concatenate([prev, chunk]),
        "WAV + base64 of the whole clip": lambda prev, clip, chunk, sr: _wav_b64(clip, sr),
        "resample the whole clip to 16 kHz (librosa)": lambda prev, clip, chunk, sr: librosa.resample(
            clip, orig_sr=sr, target_sr=16000),
    }
    skipped = {}
    try:
        import soundfile as sf
        have = sf.available_formats()
        for name, (fmt, sub) in CODECS.items():
            if fmt in have:
                out[codec_pattern(name)] = functools.partial(_encode, fmt, sub)
            else:
                skipped[f"encode to {name}"] = f"this libsndfile has no {fmt} writer"
    except (ImportError, OSError) as exc:
        skipped["lossy codecs"] = f"soundfile unavailable ({exc})"
    return out, skipped


def stream_audio(preset: str = "small", chunks: int = 30, *, device="cpu", dtype="bfloat16", seed: int = 0) -> list:
    """The chunks (1-D float32 arrays) of one ``generate_streaming`` run of a freshly built random-weight model."""
    model = build_voxcpm2(preset, seed=seed, device=str(device), dtype=dtype)
    silence_progress()
    torch.manual_seed(seed)
    gen = model.generate_streaming(text_for(chunks), min_len=chunks, max_len=chunks, inference_timesteps=2)
    return [c.float().reshape(-1).numpy() for c in gen]


def _time(fn, repeats: int) -> float:
    """Median ms of ``fn`` over ``repeats`` calls, no warm-up (a pattern's first call is part of its cost)."""
    return medians({"fn": fn}, repeats=repeats, warmup=0)["fn"] * 1e3


def consumer_matrix(chunks: Optional[Sequence] = None, *, at: Sequence[int] = AT, sr: int = SAMPLE_RATE,
                    chunk_samples: int = CHUNK_SAMPLES, repeats: int = 3, seed: int = 0) -> dict:
    """Each pattern's ms for the chunk that makes the clip ``k`` chunks long, ``k`` in ``at`` (``chunks`` cycled;
    None: noise). Rows ``{pattern, chunk, samples, ms}``; ``summary[pattern]``: :func:`_fit` of them."""
    rng = np.random.default_rng(seed)
    base = [np.asarray(c, dtype=np.float32).reshape(-1) for c in chunks] if chunks is not None else \
        [(0.1 * rng.standard_normal(chunk_samples)).astype(np.float32)]
    fns, skipped = patterns()
    rows = []
    for k in at:
        parts = [base[i % len(base)] for i in range(k)]
        prev, chunk = np.concatenate(parts[:-1] or [np.zeros(0, np.float32)]), parts[-1]
        clip = np.concatenate([prev, chunk])
        for name, fn in fns.items():
            ms = _pattern_ms(fn, prev, clip, chunk, parts, sr, repeats)
            rows.append({"pattern": name, "chunk": k, "samples": len(clip), "ms": ms})
    summary = {name: _fit([r for r in rows if r["pattern"] == name], chunk_samples) for name in fns}
    params = {"at": list(at), "sr": sr, "chunk_samples": chunk_samples, "repeats": repeats,
              "real_chunks": None if chunks is None else len(base)}
    return record("consumer_matrix", env=env_record("cpu"), params=params, rows=rows, summary=summary,
                  skipped=skipped)


def _pattern_ms(fn, prev, clip, chunk, parts: list, sr: int, repeats: int) -> float:
    """One pattern's ms for the newest chunk; appending (``fn`` None) adds its final concatenation spread out."""
    if fn is None:
        return _time(lambda: parts.append(chunk) or parts.pop(), repeats) + \
            _time(lambda: np.concatenate(parts), repeats) / len(parts)
    return _time(lambda: fn(prev, clip, chunk, sr), repeats)


def _fit(rows: list, chunk_samples: int) -> dict:
    x, y = [r["samples"] for r in rows], [r["ms"] for r in rows]
    slope = (resistant_slope(x, y) if len(rows) >= 6 else float(np.polyfit(x, y, 1)[0])) or 0.0  # ms per sample
    first = rows[0]["ms"]
    at400 = next((r["ms"] for r in rows if r["chunk"] == 400), None)
    per_chunk = slope * chunk_samples
    chunk_1s = int((1000 - first) / per_chunk) + 1 if per_chunk > 0 and (1000 - first) / per_chunk < 1e5 else None
    return {"us_per_ksample": slope * 1e6, "ms_first": first, "ms_at_400": at400, "chunk_at_1s": chunk_1s,
            "reproduces_293": bool(at400 is not None and first < 100 and at400 - first >= 700)}


def consumer_table(rec: dict) -> list:
    """A ``consumer_matrix`` record's summary, one row per pattern (and skipped one)."""
    return [{"pattern": p, "us per 1k samples so far": s["us_per_ksample"], "ms, first chunk": s["ms_first"],
             "ms at chunk 400": s["ms_at_400"], "1 s per chunk at chunk": s["chunk_at_1s"] or "never (<1e5)",
             "reproduces 0.3 -> 1-2 s at 400": s["reproduces_293"]} for p, s in rec["summary"].items()] + \
        [{"pattern": f"{p}: skipped", "us per 1k samples so far": None, "ms, first chunk": None,
          "ms at chunk 400": None, "1 s per chunk at chunk": why, "reproduces 0.3 -> 1-2 s at 400": None}
         for p, why in rec["skipped"].items()]


MP3 = codec_pattern("MP3")


def consumer_contention(preset: str = "small", chunks: int = 60, *, pattern: str = MP3, repeats: int = 2,
                        device="cpu", dtype="bfloat16", seed: int = 0) -> dict:
    """The generator's ms per chunk alone and beside a thread running ``pattern``, alternated (a missing codec runs a
    whole-clip pattern, ``params.asked`` keeps the name); ``ratio``: beside / alone, chunk 0 dropped."""
    fns, _ = patterns()
    known = {n for n, f in fns.items() if f is not None} | {codec_pattern(n) for n in CODECS}
    if pattern not in known:
        raise ValueError(f"pattern must be one of {sorted(known)}, got {pattern!r}")
    asked = pattern
    if fns.get(pattern) is None:  # a codec this libsndfile lacks
        pattern = next(n for n, f in fns.items() if f is not None and "whole clip" in n)
    model = build_voxcpm2(preset, seed=seed, device=str(device), dtype=dtype)
    silence_progress()
    warm = min(chunks, 8)
    for _ in model.generate_streaming(text_for(warm), min_len=warm, max_len=warm, inference_timesteps=2):
        pass  # untimed: the first stream after a build pays one-off costs that would bias "alone"
    rows, consumer_ms = [], []
    for r in range(repeats):
        for beside in rotated((False, True), r):
            torch.manual_seed(seed)
            gen = model.generate_streaming(text_for(chunks), min_len=chunks, max_len=chunks, inference_timesteps=2)
            rows += [{"repeat": r, "beside": beside, "chunk": i, "ms": ms} for i, ms in
                     enumerate(_timed_beside(gen, fns[pattern] if beside else None, model.sample_rate, consumer_ms))]
    alone, with_ = ([x["ms"] for x in rows if x["beside"] is b and x["chunk"] > 0] for b in (False, True))
    ci = ratio_ci(with_, alone, paired=False)
    params = {"preset": preset, "chunks": chunks, "pattern": pattern, "asked": asked, "repeats": repeats,
              "dtype": dtype}
    return record("consumer_contention", env=env_record(device, dtype), params=params, rows=rows,
                  consumer_ms=consumer_ms, ratio=statistics.median(with_) / statistics.median(alone),
                  ci=list(ci) if ci else None)


def _timed_beside(gen, fn, sr: int, consumer_ms: list) -> list:
    """ms of every chunk ``gen`` yields; with ``fn``, a thread runs it on the growing clip as chunks arrive."""
    clip, jobs = [np.zeros(0, np.float32)], []

    def consume(chunk):
        prev, clip[0] = clip[0], np.concatenate([clip[0], chunk])
        consumer_ms.append(_time(lambda: fn(prev, clip[0], chunk, sr), 1))

    with ThreadPoolExecutor(1) as pool:  # its exit waits for the consumer, also where the generator raised
        feed = (lambda chunk: jobs.append(pool.submit(consume, chunk.float().reshape(-1).numpy()))) if fn else None
        _, rows = time_chunks(gen, "cpu", on_chunk=feed)
    failed = next((job.exception() for job in jobs if job.exception()), None)
    if failed:
        raise RuntimeError(f"the consumer thread failed: {failed!r}") from failed
    return [r["ms"] for r in rows]
