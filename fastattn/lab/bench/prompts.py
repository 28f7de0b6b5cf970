"""Calls whose prompt grows from call to call (a #293 hypothesis outside one ``generate_streaming`` call)."""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fastattn.devices import resolve_device

from .decode import Timers, instrumented
from .records import env_record, record

WAYS = ("fixed prompt cache", "merge_prompt_cache with each output", "output fed back as the prompt wav")
PROMPT_TEXT, TEXT = "A voice to keep. ", "Hello there, again. "


def _write_wav(path: Path, audio: np.ndarray, sr: int) -> str:
    import soundfile as sf
    sf.write(str(path), np.asarray(audio, dtype=np.float32).reshape(-1), sr)
    return str(path)


def _one_call(model, way: str, state: dict, steps: int, its: int) -> dict:
    """One timed call in ``way``; ``state`` carries the prompt (cache, or wav and text) to the next call."""
    timers, kw = Timers(model.device), dict(min_len=steps, max_len=steps, inference_timesteps=its)
    with instrumented(model, timers, attention=False):
        t0 = time.perf_counter()
        if way == WAYS[2]:
            audio = model.generate(TEXT, prompt_text=state["text"], prompt_wav_path=state["wav"], **kw)
        else:
            audio, _, feat = model.generate_with_prompt_cache(TEXT, state["cache"], **kw)
        wall = time.perf_counter() - t0
    marks = timers.marks if not timers.cuda else []
    n = len(timers.marks)
    if way == WAYS[1]:
        state["cache"] = model.merge_prompt_cache(state["cache"], TEXT, feat)
    elif way == WAYS[2]:
        state["clip"] = np.concatenate([state["clip"], audio.float().reshape(-1).numpy()])
        state["text"] += TEXT
        state["wav"] = _write_wav(Path(state["dir"]) / f"prompt-{state['calls']}.wav", state["clip"],
                                  model.sample_rate)
    state["calls"] += 1
    steps_s = timers.step_s()
    return {"prefix": model.base_lm.kv_cache.current_length - n, "wall_ms": wall * 1e3,
            "first_ms": (marks[0] - t0) * 1e3 if marks else None,
            "later_ms": statistics.median(steps_s) * 1e3 if steps_s else None}


def prompt_growth(preset: str = "tiny", *, calls: int = 24, steps: int = 6, modes: Sequence[str] = ("upstream",
                  "exact"), ways: Sequence[str] = WAYS, max_length: int = 512, device="cpu", seed: int = 0,
                  inference_timesteps: int = 2, prompt_patches: int = 40) -> dict:
    """Short calls looped each way of :data:`WAYS` per mode. Rows ``{mode, way, call, prefix, wall_ms, first_ms,
    later_ms, error}`` (what stopped the loop, e.g. a full cache); ``full_at[mode][way]``: that call, or None."""
    from fastattn.models import build_voxcpm2, silence_progress
    from fastattn.patch import patch_voxcpm
    device = resolve_device(device)
    model = build_voxcpm2(preset, seed=seed, device=str(device), dtype="float32", max_length=max_length)
    silence_progress()
    rows, full_at = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(seed)
        patch = model.patch_size * model.chunk_size * model.sample_rate // model._encode_sample_rate
        clip = (0.1 * rng.standard_normal(prompt_patches * patch)).astype(np.float32)
        wav = _write_wav(Path(tmp) / "prompt.wav", clip, model.sample_rate)
        for mode in modes:
            with patch_voxcpm(model, mode=mode) if mode != "upstream" else nullcontext():
                for way in ways:
                    torch.manual_seed(seed)
                    state = {"cache": model.build_prompt_cache(prompt_text=PROMPT_TEXT, prompt_wav_path=wav),
                             "wav": wav, "text": PROMPT_TEXT, "clip": clip, "dir": tmp, "calls": 0}
                    full_at.setdefault(mode, {})[way] = None
                    for call in range(calls):
                        try:
                            rows.append({"mode": mode, "way": way, "call": call,
                                         **_one_call(model, way, state, steps, inference_timesteps), "error": None})
                        except (ValueError, RuntimeError) as exc:
                            rows.append({"mode": mode, "way": way, "call": call, "prefix": None, "wall_ms": None,
                                         "first_ms": None, "later_ms": None, "error": str(exc).splitlines()[0]})
                            full_at[mode][way] = call
                            break
    params = {"preset": preset, "calls": calls, "steps": steps, "modes": list(modes), "ways": list(ways),
              "prompt_patches": prompt_patches,
              "max_length": max_length, "inference_timesteps": inference_timesteps, "seed": seed}
    return record("prompt_growth", env=env_record(device, "float32"), params=params, rows=rows, full_at=full_at)


def prompt_table(rec: dict) -> list:
    """One row per mode and way: prefix first -> last call, step median ms at the first and last call, the stop."""
    out = []
    for mode in rec["params"]["modes"]:
        for way in rec["params"]["ways"]:
            ok = [r for r in rec["rows"] if r["mode"] == mode and r["way"] == way and r["error"] is None]
            err = next((r["error"] for r in rec["rows"] if r["mode"] == mode and r["way"] == way and r["error"]), None)
            if ok:
                out.append({"mode": mode, "way": way, "calls": len(ok), "prefix first -> last":
                            f"{ok[0]['prefix']} -> {ok[-1]['prefix']}", "step ms, first call": ok[0]["later_ms"],
                            "step ms, last call": ok[-1]["later_ms"],
                            "stopped": f"call {rec['full_at'][mode][way]}: {err}" if err else "no"})
    return out
