"""``python -m fastattn bench WHAT ...``: the sweeps as named steps of the one runner (``--only/--skip/--resume``)."""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from fastattn.core import check_positive_int
from fastattn.devices import dtype_of, resolve_device
from fastattn.models import PRESETS

from ..runner import Step, add_arguments, open_folder, run_steps, select
from .attention import attention_sweep
from .decode import compiled_decode, dtype_decode, whole_decode, whole_dtypes
from .floor import bandwidth
from .forms import form_sweep
from .lm import compile_counts, compiled_step_sweep, decode_step_sweep
from .memory import kv_memory, step_allocations
from .programs import program_runs
from .records import env_record, record
from .split import step_split
from .vae import vae_stream

POSITIONS = (0, 16, 256, 512, 1024, 2048, 4096, 8000)
#: the compiled step compiles a graph per position; the forms sweep spans the cache
COMPILED_POSITIONS, FORM_POSITIONS = POSITIONS[:5], (0, 256, 1024, 2048, 4096, 6144, 8000)
#: what ``all`` runs (asked for by name: compile-counts, forms and compiled-decode compile, programs runs upstream's CLI
#: and a service on the full model; vae streams the full-width AudioVAE)
ALL = ("bandwidth", "attention", "decode-step", "decode", "dtype", "compiled", "memory")
#: a job that reads another's figure: the attention sweeps' floor is the bandwidth
NEEDS = {"attention": ("bandwidth",)}


def jobs(device, *, dtypes=("float32", "bfloat16"), positions=None, capacity: int = 8192, preset=None,
         steps=None, repeats: int = 7, progress: bool = True) -> list:
    """Every bench job as a :class:`runner.Step` named as the CLI names it; ``None`` sizes are each job's own."""
    dev, bw, model = str(device), {}, preset or "tiny"  # model: the preset of the jobs that build a whole model
    pos = lambda default: list(positions or default)  # noqa: E731

    def band():
        bw.update(bandwidth(device))
        return [record("bandwidth", env=env_record(device), params={}, rows=[dict(bw)], **bw)]
    table = {
        "bandwidth": band,
        "attention": lambda: [attention_sweep(pos(POSITIONS), capacity=capacity, dtype=dt, device=device,
                                              repeats=repeats, bw=bw or None, progress=progress) for dt in dtypes],
        "decode-step": lambda: [decode_step_sweep(pos(POSITIONS), preset=preset or "small", dtype=dt, device=device,
                                                  repeats=repeats, progress=progress) for dt in dtypes],
        "decode": lambda: [whole_decode(model, steps=steps or 12, dtype=_one(dtypes, "bfloat16"),
                                        device=dev, progress=progress)],
        "dtype": lambda: [dtype_decode(model, dtypes=whole_dtypes(device, "bfloat16"), steps=steps or 12,
                                       device=device)],
        "compiled": lambda: [compiled_step_sweep(pos(COMPILED_POSITIONS), preset=model, device=device,
                                                 dtype=_one(dtypes, "float32"), repeats=repeats, progress=progress)],
        "compile-counts": lambda: [compile_counts(steps or 500, preset=model, device=device)],
        "forms": lambda: [form_sweep(pos(FORM_POSITIONS), device=device, dtype=dt, capacity=capacity,
                                     repeats=repeats, steps=steps or 600, progress=progress) for dt in dtypes],
        "memory": lambda: [kv_memory("full", dtype=_one(dtypes, "bfloat16"), device=device),
                           step_allocations(device=dev)],
        "programs": lambda: [program_runs(preset or "full", steps=steps or 60, timesteps=10)],  # two rounds: A B, B A
        "split": lambda: [step_split(model, steps=steps or 6, repeats=3, dtype=_one(dtypes, "bfloat16"), device=dev)],
        "compiled-decode": lambda: [compiled_decode(preset or "full", steps=steps or 8, repeats=3,
                                                    dtype=_one(dtypes, "bfloat16"), device=dev)],
        "vae": lambda: [vae_stream(preset or "full", chunks=steps or 8, repeats=repeats, device=dev)],
    }
    names = {"decode": lambda r: [f"whole_decode_{model}"], "dtype": lambda r: [f"dtype_decode_{model}"],
             "compiled": lambda r: [f"compiled_step_{model}"],
             "forms": lambda r: [f"decode_forms_{x['params']['dtype']}" for x in r],
             "memory": lambda r: ["kv_memory_full", "step_allocations"], "split": lambda r: [f"step_split_{model}"],
             "compiled-decode": lambda r: [f"compiled_decode_{preset or 'full'}"],
             "vae": lambda r: [f"vae_stream_{preset or 'full'}"]}
    return [Step(name, fn, 0.0, None, names.get(name)) for name, fn in table.items()]


def _one(dtypes, default: str) -> str:
    return dtypes[0] if len(dtypes) == 1 else default


def run(what: list, out, device, *, budget: Optional[float] = None, resume: bool = False, log=print,
        **sizes) -> dict:
    """The jobs named by ``what`` into ``out`` through the runner; returns {job: its log entry}."""
    return run_steps(select(jobs(device, **sizes), what), open_folder(out, resume), budget=budget, resume=resume,
                     log=log, tag="bench")


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastattn bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=[s.name for s in jobs("cpu")] + ["all"], help=f"all: {', '.join(ALL)}")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: both for sweeps, bf16 for decode)")
    ap.add_argument("--positions", type=_ints, default=None, help=f"default {','.join(map(str, POSITIONS))} "
                    f"(compiled: the first five; forms: {','.join(map(str, FORM_POSITIONS))})")
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--preset", default=None, help="model preset (decode-step: small; decode: tiny)")
    ap.add_argument("--steps", type=int, default=None,
                    help="decode steps (decode, dtype: 12; compile-counts: 500; forms: 600 for the graph count; "
                    "vae: 8 chunks a stream)")
    ap.add_argument("--repeats", type=int, default=7)
    add_arguments(ap, "output folder (default: reports/bench-<UTC time>)")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else Path("reports") / f"bench-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    what = [w for w in args.only or (ALL if args.what == "all" else [*NEEDS.get(args.what, ()), args.what])
            if w not in (args.skip or ())]
    try:  # every argument checked before anything is measured or written
        if not what:  # an empty selection is not "everything"
            raise ValueError(f"--skip {','.join(args.skip)} leaves nothing to run")
        device = resolve_device(args.device, name="--device")
        if args.dtype is not None:
            dtype_of(args.dtype, name="--dtype")
        if args.preset is not None and args.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {args.preset!r}")
        for name in ("capacity", "steps", "repeats"):
            if getattr(args, name) is not None:
                check_positive_int(getattr(args, name), f"--{name}")
        if args.positions == [] or any(not 0 <= p < args.capacity for p in args.positions or ()):
            raise ValueError(f"--positions must be a non-empty list of positions in [0, capacity={args.capacity}), "
                             f"got {args.positions}")
        if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
            raise ValueError(f"--out {args.out}: exists and is not a folder")
        entries = run(what, out, device, budget=args.budget or None, resume=args.resume,
                      dtypes=(args.dtype,) if args.dtype else ("float32", "bfloat16"), positions=args.positions,
                      capacity=args.capacity, preset=args.preset, steps=args.steps, repeats=args.repeats)
    except ValueError as exc:
        ap.error(str(exc))
    for e in entries.values():
        print(*(out / f for f in e.get("files", [])), sep="\n")
    return 1 if any(e["status"] != "ok" for e in entries.values()) else 0
