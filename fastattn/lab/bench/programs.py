"""The fix where users run VoxCPM2: upstream's own CLI and a streaming service loop, plain against
``python -m fastattn run``, each run its own process (record ``wrapped_programs``).

Neither program seeds torch and a random-weight model never stops by itself, so the runs get what a user would add: a
``sitecustomize`` of their own that seeds torch (the wrapper must run it: if it did not, the bytes would differ), and a
checkpoint whose stop head ends generation at a chosen step, read off a probe of the same program (:func:`stop_rule`).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from fastattn.clock import rotated
from fastattn.models import build_voxcpm2, save_voxcpm2

from ..paths import repo_root
from .noise import machine_busy_s, others_busy
from .records import env_record, record
from .stats import ratio_ci, scaled_ci
from .stream import text_for

SERVICE = ("data", "programs", "stream_service.py")
VARIANTS = ("plain", "wrapped")
#: the probe: the CLI's own calls (seeded by the same sitecustomize), recording the stop head's input at every step
PROBE = """
import json, sys
from voxcpm.model import voxcpm2
rows, init, limit = [], voxcpm2.VoxCPM2Model.__init__, int(sys.argv[4])
class Enough(Exception):
    pass
def keep(module, args, out):
    rows.append(out.reshape(-1, out.shape[-1])[0].tolist())
    if len(rows) > limit:
        raise Enough
def hooked(self, *a, **k):
    init(self, *a, **k)
    self.stop_actn.register_forward_hook(keep)
voxcpm2.VoxCPM2Model.__init__ = hooked
from voxcpm import VoxCPM
model = VoxCPM(voxcpm_model_path=sys.argv[1], enable_denoiser=False, optimize=True)  # as `voxcpm design` builds it
warm, limit = len(rows), len(rows) + limit
try:
    model.generate(text=sys.argv[2], inference_timesteps=int(sys.argv[3]), retry_badcase=False)
except Enough:
    pass
json.dump({"warmup": rows[:warm], "steps": rows[warm:]}, open(sys.argv[5], "w"))
"""


def seeded_site(folder, seed: int = 0) -> Path:
    """A user's own start-up folder: a ``sitecustomize`` that seeds torch (put it on PYTHONPATH)."""
    site = Path(folder) / "user-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import torch\ntorch.manual_seed({int(seed)})\n")
    return site


def program_env(site: Path, threads: Optional[int] = None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    env.pop("FASTATTN_RUN", None)
    return {**env, "OMP_NUM_THREADS": str(threads)} if threads else env


def stop_rule(warmup: list, steps: list, lo: int, hi: int) -> dict:
    """``{unit, step, below, above}``: the first step in ``[lo, hi)`` where one unit of the stop head's input exceeds
    every earlier value of it (warm-up included) by 5%; a threshold between ``below`` and ``above`` stops there."""
    best = [max(col) for col in zip(*warmup)] if warmup else [float("-inf")] * len(steps[0])
    for i, row in enumerate(steps):
        if lo <= i < hi:
            for u, (v, b) in enumerate(zip(row, best)):
                if b > 0.05 and v > 1.05 * b:
                    return {"unit": u, "step": i, "below": b, "above": v}
        best = [max(b, v) for b, v in zip(best, row)]
    raise ValueError(f"no unit of the stop head's input sets a new high between steps {lo} and {hi}: "
                     "use another seed or text")


def set_stop(checkpoint: Path, rule: Optional[dict]) -> float:
    """Rewrite the checkpoint's stop head: stop logit = ``rule``'s unit, continue logit = a constant between its
    ``below`` and ``above`` (fed by another unit's bias alone), so it stops at the rule's step. ``None``: never
    stops (stop logit 0, continue 10). Returns the constant as the model computes it."""
    import torch
    from safetensors.torch import load_file, save_file

    path = checkpoint / "model.safetensors"
    sd = load_file(str(path))
    w, b, head = sd["stop_proj.weight"], sd["stop_proj.bias"], sd["stop_head.weight"]
    u = rule["unit"] if rule else 0
    v, target = (u + 1) % w.shape[0], (rule["below"] + rule["above"]) / 2 if rule else 10.0
    bias = torch.tensor([target], dtype=torch.float64)
    for _ in range(60):  # silu(bias) = target by Newton in float64, then rounded as the model holds it
        s = torch.sigmoid(bias)
        bias = bias - (bias * s - target) / (s * (1 + bias * (1 - s)))
    bias = bias.to(b.dtype)
    const = float(torch.nn.functional.silu(bias)[0])
    if rule and not rule["below"] < const < rule["above"]:
        raise ValueError(f"the stop threshold rounds to {const}, outside ({rule['below']}, {rule['above']})")
    w[v], b[v] = 0, bias[0]
    head.zero_()
    head[0, v] = 1
    if rule:
        head[1, u] = 1
    save_file(sd, str(path))
    return const


def probe(checkpoint: Path, text: str, timesteps: int, steps: int, env: dict, out: Path) -> dict:
    """The stop head's input at each warm-up step and at the first ``steps`` steps of the generation."""
    subprocess.run([sys.executable, "-c", PROBE, str(checkpoint), text, str(timesteps), str(steps), str(out)], env=env,
                   check=True, capture_output=True, text=True, timeout=3600)
    return json.loads(out.read_text())


def stopping_checkpoint(folder, text: str, *, preset: str = "tiny", steps: tuple = (300, 600), seed: int = 0,
                        timesteps: int = 10, dtype: str = "bfloat16", threads: Optional[int] = None) -> dict:
    """A random-weight checkpoint in voxcpm's layout whose generation of ``text`` (seeded by :func:`seeded_site`)
    ends by itself at a step in ``steps``: ``{checkpoint, site, unit, step, below, above, threshold}``."""
    folder = Path(folder)
    ckpt = save_voxcpm2(build_voxcpm2(preset, seed=seed, dtype=dtype), folder / f"{preset}-checkpoint")
    site = seeded_site(folder, seed)
    env = program_env(site, threads)
    set_stop(ckpt, None)  # the probe runs to voxcpm's length cap
    acts = probe(ckpt, text, timesteps, steps[1], env, folder / "probe.json")
    rule = stop_rule(acts["warmup"], acts["steps"], *steps)
    return {"checkpoint": ckpt, "site": site, **rule, "threshold": set_stop(ckpt, rule)}


def cli_command(checkpoint, text: str, out, timesteps: int = 10) -> list:
    """``voxcpm design`` as its README runs it, on a local checkpoint, without the denoiser."""
    return [str(Path(sys.executable).with_name("voxcpm")), "design", "--text", text, "--model-path", str(checkpoint),
            "--no-denoiser", "--inference-timesteps", str(timesteps), "--output", str(out)]


def service_command(checkpoint, text: str, out, timesteps: int = 10) -> list:
    return [sys.executable, str(repo_root().joinpath(*SERVICE)), "--model-path", str(checkpoint), "--text", text,
            "--timesteps", str(timesteps), "--out", str(out)]


def wrapped(command: list, mode: str = "exact") -> list:
    return [sys.executable, "-m", "fastattn", "run", "--mode", mode, "--", *command]


def run_program(command: list, env: dict, timeout: float = 3600) -> dict:
    """One process: exit code, wall and CPU seconds (its own and the machine's), and its stderr's fastattn lines."""
    before, machine = resource.getrusage(resource.RUSAGE_CHILDREN), machine_busy_s()
    start = time.perf_counter()
    p = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    end = machine_busy_s()
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"returncode": p.returncode, "wall_s": wall, "cpu_s": cpu,
            "machine_s": None if machine is None or end is None else end - machine,
            "fastattn_lines": [ln for ln in p.stderr.splitlines() if ln.startswith("fastattn")],
            "stderr_tail": p.stderr[-2000:] if p.returncode else ""}


def program_runs(preset: str = "full", *, steps: int = 60, rounds: int = 2, timesteps: int = 10, seed: int = 0,
                 folder=None) -> dict:
    """Upstream's CLI and the streaming service, plain and wrapped, in rotated order (A B, B A, ...), on a checkpoint
    of ``preset`` that stops after ``steps`` to 1.5x ``steps``, in ``folder`` with the outputs (default: a tempdir)."""
    if folder is None:
        with tempfile.TemporaryDirectory() as tmp:
            return program_runs(preset, steps=steps, rounds=rounds, timesteps=timesteps, seed=seed, folder=tmp)
    folder, text = Path(folder), text_for(steps * 3 // 2)
    made = stopping_checkpoint(folder, text, preset=preset, steps=(steps, steps * 3 // 2), seed=seed,
                               timesteps=timesteps)
    env, runs = program_env(made["site"]), []
    for r in range(rounds):
        for program in ("cli", "stream"):
            for variant in rotated(VARIANTS, r):
                out = folder / f"{program}-{variant}-{r}.{'wav' if program == 'cli' else 'bin'}"
                cmd = (cli_command if program == "cli" else service_command)(made["checkpoint"], text, out, timesteps)
                res = run_program(wrapped(cmd) if variant == "wrapped" else cmd, env)
                if res["returncode"]:
                    raise RuntimeError(f"{program} ({variant}) exited {res['returncode']}: {res['stderr_tail']}")
                stream = json.loads(Path(f"{out}.json").read_text()) if program == "stream" else {}
                runs.append({"program": program, "variant": variant, "round": r,
                             "digest": hashlib.sha256(out.read_bytes()).hexdigest()[:16], **res,
                             "chunk_ms": [s * 1e3 for s in stream.get("chunk_s", [])],
                             "first_chunk_s": stream.get("first_chunk_s")})
    return record("wrapped_programs", env=env_record("cpu", "bfloat16"),
                  params={"preset": preset, "text_chars": len(text), "timesteps": timesteps, "rounds": rounds,
                          "seed": seed, "stop_step": made["step"]},
                  rows=program_rows(runs), runs=runs)


def program_rows(runs: list) -> list:
    """Per program: plain and wrapped wall medians, their ratio, per-chunk medians with intervals, equal bytes."""
    rows = []
    for program in dict.fromkeys(r["program"] for r in runs):
        by = {v: [r for r in runs if r["program"] == program and r["variant"] == v] for v in VARIANTS}
        flags = {v: others_busy(*zip(*[(r["wall_s"], r["cpu_s"], r["machine_s"]) for r in by[v]])) for v in VARIANTS}
        wall = {v: [r["wall_s"] for r in by[v]] for v in VARIANTS}
        chunks = {v: [c for r in by[v] for c in r["chunk_ms"]] for v in VARIANTS}
        row = {"program": program, "runs": len(by["plain"]), "same_bytes": len({r["digest"] for r in by["plain"]
                                                                                + by["wrapped"]}) == 1,
               "patched_line": all(any("patched voxcpm" in ln for ln in r["fastattn_lines"]) for r in by["wrapped"]),
               "plain_wall_s": statistics.median(wall["plain"]), "wrapped_wall_s": statistics.median(wall["wrapped"]),
               "wall_ratio": statistics.median(wall["wrapped"]) / statistics.median(wall["plain"]),
               "wall_ratio_ci": ratio_ci(wall["wrapped"], wall["plain"]),
               "disturbed_runs": sum(map(sum, flags.values()))}
        if chunks["plain"]:
            row.update({f"{v}_chunk_ms": statistics.median(chunks[v]) for v in VARIANTS})
            row.update({f"{v}_chunk_ms_ci": scaled_ci(chunks[v], 1.0) for v in VARIANTS})
            row.update({"chunk_ratio": row["wrapped_chunk_ms"] / row["plain_chunk_ms"],
                        "chunk_ratio_ci": ratio_ci(chunks["wrapped"], chunks["plain"], paired=False),
                        "chunks": len(by["plain"][0]["chunk_ms"]) + 1, "chunk_samples": len(chunks["plain"])})
        rows.append(row)
    return rows


def wrapped_sentence(rec: dict) -> str:
    """A ``wrapped_programs`` record in one sentence, for a maintainer: the programs, their bytes, the chunk time."""
    from ..machine import machine_label
    from .metrics import Figure
    rows, p = {r["program"]: r for r in rec["rows"]}, rec["params"]
    cli, st = rows["cli"], rows["stream"]
    same = "byte-identical" if cli["same_bytes"] and st["same_bytes"] else "DIFFERENT"
    chunk = Figure(st["chunk_ratio"], st["chunk_ratio_ci"], st["chunk_samples"]).text()
    return (f"With the same computation patched in at start-up, upstream's `voxcpm design` and a streaming loop wrote "
            f"{same} audio, and chunks took {chunk} the time ({p['preset']} architecture, random weights, "
            f"{rec['env']['dtype']}, {machine_label(rec['env'])})")
