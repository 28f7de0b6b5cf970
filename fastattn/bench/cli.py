"""``python -m fastattn bench ...`` and the committed reference set."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from ..backends import backend_matrix
from ..devices import dtype_of, resolve_device
from ..exactness import calibration_ladders
from ..models import PRESETS
from .attention import attention_sweep, dtype_costs
from .decode import dtype_decode, whole_decode
from .floor import bandwidth
from .lm import compiled_step_sweep, decode_step_sweep
from .memory import cache_growth, fill_cost, kv_memory, peak_rss, step_allocations
from .records import env_record, record, save_record
from .targets import check_targets


def reference_run(out, *, device="cpu", positions=(0, 16, 256, 512, 1024, 2048, 4096, 8000), repeats: int = 7,
                  whole_preset: str = "full", compiled_preset: str = "tiny") -> list[Path]:
    """The reference set this project commits under data/results/: every sweep (warm, and cache-cold over 36
    caches; attention calls 3x ``repeats``), bf16 vs fp32 costs, the whole decode of the ``full`` preset in
    bf16 (12 steps, 10 DiT steps, 3 repeats), memory (KV from the caches, peak RSS over 3 fresh processes
    each), the compiled step, the exactness ladder, and the targets judged."""
    out = Path(out)
    written = []
    bw = bandwidth(device)
    written.append(save_record(record("bandwidth", env=env_record(device), params={}, rows=[bw], **bw), out,
                               "bandwidth"))
    # one call is cheap, and a call's time depends on what ran before it (shuffled): 3x the repeats
    att = {dt: attention_sweep(positions, dtype=dt, device=device, repeats=3 * repeats, bw=bw)
           for dt in ("float32", "bfloat16")}
    cold = {dt: attention_sweep([p for p in positions if p >= 256], dtype=dt, device=device, repeats=3 * repeats, bw=bw,
                                caches=36) for dt in ("float32", "bfloat16")}  # one cache per layer of both LMs
    dec = {dt: decode_step_sweep(positions, preset="small", dtype=dt, device=device, repeats=repeats)
           for dt in ("bfloat16", "float32")}
    for dt in att:
        written.append(save_record(att[dt], out, f"attention_{dt}"))
        written.append(save_record(cold[dt], out, f"attention_{dt}_cold"))
        written.append(save_record(dec[dt], out, f"decode_step_{dt}"))
    written.append(save_record(dtype_costs(device), out, "dtype_costs"))
    written.append(save_record(record("backend_matrix", env=env_record(device), rows=backend_matrix(device),
                                      params={"capacity": 8192, "position": 256}), out, "backend_matrix"))
    ladder = calibration_ladders(device, capacity=8192)
    written.append(save_record(record("exactness_calibration", env=env_record(device), params={"capacity": 8192},
                                      rows=ladder), out, "exactness_calibration"))
    kv = kv_memory("full", prefill=100, steps=200, dtype="bfloat16", device=device)
    written.append(save_record(kv, out, "kv_memory_full"))
    written.append(save_record(fill_cost("full", device=device), out, "fill_cost_full"))
    growth = cache_growth("full", device=device)
    written.append(save_record(growth, out, "cache_growth_full"))
    written.append(save_record(step_allocations(device=device), out, "step_allocations"))
    written.append(save_record(peak_rss("small", steps=8, runs=3), out, "peak_rss_small"))
    mode = "reduce-overhead" if str(device).startswith("cuda") else None
    written.append(save_record(compiled_step_sweep(positions[:5], preset=compiled_preset, device=device, mode=mode,
                                                   repeats=repeats), out, f"compiled_step_{compiled_preset}"))
    whole = whole_decode(whole_preset, steps=12, dtype="bfloat16", device=device, inference_timesteps=10, repeats=3)
    written.append(save_record(whole, out, f"whole_decode_{whole_preset}"))
    dd = dtype_decode(whole_preset, steps=12, device=device)
    written.append(save_record(dd, out, f"dtype_decode_{whole_preset}"))
    targets = check_targets({"attention_fp32": att["float32"], "attention_bf16": att["bfloat16"],
                             "attention_fp32_cold": cold["float32"],
                             "decode_bf16": dec["bfloat16"], "decode_fp32": dec["float32"], "kv": kv,
                             "growth": growth, "whole": whole, "dtypes": dd})
    written.append(save_record(record("targets", env=env_record(device), params={}, rows=targets), out, "targets"))
    return written


def _ints(s: str) -> list[int]:
    import argparse
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None


def _check_args(args):
    device = resolve_device(args.device, name="--device")
    if args.dtype is not None:
        dtype_of(args.dtype, name="--dtype")
    if args.preset is not None and args.preset not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {args.preset!r}")
    for name in ("capacity", "steps", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name} must be a positive int, got {getattr(args, name)}")
    bad = [p for p in args.positions if not 0 <= p < args.capacity]
    if bad or not args.positions:
        raise ValueError(f"--positions must be a non-empty list of positions in [0, capacity={args.capacity}), "
                         f"got {args.positions}")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out}: exists and is not a folder")
    return device


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m fastattn bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["attention", "decode-step", "decode", "dtype", "compiled", "compile-counts",
                                     "forms", "memory", "bandwidth", "all", "reference"],
                    help="'reference' runs the committed reference set (full preset decode included: ~10 GB peak)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: both for sweeps, bf16 for decode)")
    ap.add_argument("--positions", type=_ints, default=[0, 16, 256, 512, 1024, 2048, 4096, 8000])
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--preset", default=None, help="model preset (decode-step: small; decode: tiny)")
    ap.add_argument("--steps", type=int, default=None,
                    help="decode steps (decode, dtype: 12; compile-counts: 500; forms: 2000 for the graph count)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="output folder (default: reports/bench-<UTC time>)")
    args = ap.parse_args(argv)
    try:  # every argument checked before anything is measured or written
        device = _check_args(args)
    except ValueError as exc:
        ap.error(str(exc))
    if args.what == "reference":
        out = Path(args.out) if args.out else Path("reports") / f"reference-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
        for p in reference_run(out, device=str(device), positions=args.positions, repeats=args.repeats):
            print(p)
        return 0
    out = Path(args.out) if args.out else Path("reports") / f"bench-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    dtypes = [args.dtype] if args.dtype else ["float32", "bfloat16"]
    written = []
    bw = bandwidth(device) if args.what in ("attention", "bandwidth", "all") else None
    if bw:
        written.append(save_record(record("bandwidth", env=env_record(device), params={}, rows=[bw], **bw), out))
    if args.what in ("attention", "all"):
        for dt in dtypes:
            written.append(save_record(attention_sweep(args.positions, capacity=args.capacity, dtype=dt, device=device,
                                                       repeats=args.repeats, bw=bw), out))
    if args.what in ("decode-step", "all"):
        for dt in dtypes:
            written.append(save_record(decode_step_sweep(args.positions, preset=args.preset or "small", dtype=dt,
                                                         device=device, repeats=args.repeats), out))
    if args.what in ("decode", "all"):
        written.append(save_record(whole_decode(args.preset or "tiny", steps=args.steps or 12,
                                                dtype=args.dtype or "bfloat16",
                                                device=str(device)), out))
    if args.what in ("dtype", "all"):  # the whole decode in voxcpm's dtype and float32, upstream and patched
        from .decode import whole_dtypes
        written.append(save_record(dtype_decode(args.preset or "tiny", dtypes=whole_dtypes(device, "bfloat16"),
                                                steps=args.steps or 12, device=device), out,
                                   f"dtype_decode_{args.preset or 'tiny'}"))
    if args.what == "compile-counts":  # #293's recompile hypothesis on CPU: about a minute, mostly compiling
        from .lm import compile_counts
        written.append(save_record(compile_counts(args.steps or 500, preset=args.preset or "tiny",
                                                  device=device), out, "compile_counts"))
    if args.what == "forms":  # the static-shape forms of a compiled decode (a compile per form and dtype)
        from .forms import form_sweep
        for dt in dtypes:
            written.append(save_record(form_sweep(args.positions, device=device, dtype=dt, capacity=args.capacity,
                                                  repeats=args.repeats, steps=args.steps or 2000), out,
                                       f"decode_forms_{dt}"))
    if args.what in ("compiled", "all"):
        written.append(save_record(compiled_step_sweep(args.positions, preset=args.preset or "tiny",
                                                       dtype=args.dtype or "float32", device=device,
                                                       repeats=args.repeats), out))
    if args.what in ("memory", "all"):
        kv = kv_memory("full", dtype=args.dtype or "bfloat16", device=device)
        written.append(save_record(kv, out, "kv_memory-full"))
        written.append(save_record(step_allocations(device=str(device)), out, "step_allocations"))
    for p in written:
        print(p)
    return 0
