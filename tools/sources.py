"""What the generators read: the reference run and its records by role, each machine by name, and each compiled
form in a maintainer's words. ``tools.readme`` and ``tools.prs`` both read this module; neither imports the other's
names back."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from fastattn.lab.bench.records import load_run
from fastattn.lab.bench.targets import run_targets, target_records
from fastattn.lab.machine import machine_label

REFERENCE = "cpu-xeon-amx-2threads-torch2.13.0"
OTHER = "cpu-epyc-avx512-2threads-torch2.13.0"

def records(ref: Path) -> dict:
    """The reference run's records by role (None where the run lacks one)."""
    run = load_run(ref)
    found = target_records(run)
    stored = run.get("targets")  # its env names the machine; its rows are judged again by this code
    return {"run": run, "targets": stored and {**stored, "rows": run_targets(run) or stored["rows"]},
            "stream": run.get("stream_profile"), "whole": found["whole"], "kv": found["kv"],
            "matrix": run.get("backend_matrix"), "ladder": run.get("exactness_calibration"),
            "att32": found["attention_fp32"], "cold": found["attention_fp32_cold"], "costs": run.get("dtype_costs"),
            "rss": run.get("peak_rss"), "growth": found["growth"], "comp": run.get("compiled_step"),
            "dec32": found["decode_fp32"], "dtypes": found["dtypes"],
            "forms": run.get("decode_forms", dtype="bfloat16")}


def machine_name(env: dict, folder: Optional[Path] = None) -> str:
    """The machine named by what decides its kernels (the CPU features a record of ``folder`` holds)."""
    return load_run(folder).machine(env) if folder else machine_label(env)


def machines_with(results: Path, kind: str, **params) -> list:
    """``[(folder, record)]``: each machine folder under ``results`` with a record of ``kind``."""
    out = [(f, load_run(f).get(kind, **params)) for f in sorted(p for p in results.iterdir() if p.is_dir())]
    return [(f, r) for f, r in out if r is not None]


FORM_WORDS = {"flex_decode": "FlexAttention with an in-graph block mask",
              "slice_live": "SDPA over the slice (`.item()` + `torch._check`)",
              "bucketed_window": "the masked call over a bucketed window", "upstream_masked": "today's masked call"}


def form_words(form: str) -> str:
    return FORM_WORDS.get(form, form)
