"""The headless runner (``python -m fastattn workbook``) and the helpers every notebook calls.

It runs ``notebooks/NN_*.ipynb`` with papermill into a new ``reports/<UTC time>-<device>/``."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence

from fastattn.devices import DTYPES, resolve_device
from fastattn.models import PRESETS, silence_progress

from . import budget
from .bench import cli as bench_cli
from .bench import env_record, record, save_record
from .budget import BUDGET_S, SCALABLE, notebook_budget, unplannable
from .doctor import doctor
from .paths import atomic_write_text, data_dir, notebooks, reports_dir, without_machine_paths
from .report import write_report
from .tables import fmt, html_table, md_text

__all__ = ["check_params", "time_left", "provenance", "save_figure", "save", "save_rows", "table",
           "findings", "run_workbook", "notebooks", "PRESETS", "DTYPE_NAMES"]

DTYPE_NAMES = tuple(DTYPES)


# --------------------------------------------------------------------------- notebook helpers
def check_params(**params) -> dict:
    """Validate a notebook's parameters, returned resolved; a ValueError names a bad one, unknown ones pass.
    ``budget_s`` starts :func:`time_left`'s clock."""
    p = dict(params)
    if "device" in p:
        try:
            p["device"] = str(resolve_device(p["device"]))  # the device name a notebook runs on, auto resolved
        except ValueError as exc:
            raise ValueError(f"parameter device={p['device']!r}: {exc}") from None
    for name, allowed in (("dtype", DTYPE_NAMES), ("preset", PRESETS), ("step_preset", PRESETS)):
        if name in p and p[name] not in allowed:
            raise ValueError(f"parameter {name}={p[name]!r}: expected one of {', '.join(allowed)}")
    for name in ("capacity", "ladder_capacity", "repeats", "steps", "chunks", "audio_chunks", "whole_repeats",
                 "split_repeats"):
        if name in p and (isinstance(p[name], bool) or not isinstance(p[name], int) or p[name] < 1):
            raise ValueError(f"parameter {name}={p[name]!r}: expected a positive int")
    if "budget_s" in p:
        b = p["budget_s"]
        if isinstance(b, bool) or not isinstance(b, (int, float)) or b < 0:
            raise ValueError(f"parameter budget_s={b!r}: expected seconds >= 0 (0: no limit)")
        p["_started"] = time.monotonic()  # time_left counts from here
    if "seed" in p and (isinstance(p["seed"], bool) or not isinstance(p["seed"], int)):
        raise ValueError(f"parameter seed={p['seed']!r}: expected an int")
    if "interactive" in p and not isinstance(p["interactive"], bool):
        raise ValueError(f"parameter interactive={p['interactive']!r}: expected true or false")
    if "positions" in p:
        pos = p["positions"]
        if not isinstance(pos, (list, tuple)) or not pos or \
                not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pos):
            raise ValueError(f"parameter positions={p['positions']!r}: expected a non-empty list of ints >= 0, "
                             "e.g. -p positions '[0, 256, 1024]'")
        cap = p.get("capacity")
        if cap is not None and max(pos) >= cap:
            raise ValueError(f"parameter positions: {max(pos)} is beyond capacity={cap} (positions must be < capacity)")
        p["positions"] = list(pos)
    if p.get("checkpoint_path"):
        cp = Path(str(p["checkpoint_path"])).expanduser()
        if not cp.is_dir():
            raise ValueError(f"parameter checkpoint_path={str(cp)!r} is not an existing directory")
    if "out_dir" in p:
        out = Path(p["out_dir"] or (reports_dir() / f"interactive-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"))
        out.mkdir(parents=True, exist_ok=True)
        p["out_dir"] = str(out)
    return p


def time_left(params: dict, reserve_s: float = 15.0) -> Optional[float]:
    """Seconds left of ``budget_s`` since :func:`check_params`, less ``reserve_s``; None without a budget."""
    if not params.get("budget_s"):
        return None
    return max(0.0, params["budget_s"] - (time.monotonic() - params["_started"]) - reserve_s)


def provenance(params: dict, *, random_weights: Optional[bool] = None) -> None:
    """Print where and how this notebook ran: doctor summary, commit, parameters, weights."""
    silence_progress()
    d = doctor(calibrate=False)
    keys = ("torch", "voxcpm", "fastattn", "git_commit", "device", "device_name", "compute_capability",
            "cudnn_version", "threads", "cpu_features", "cpu_capability", "torchaudio_placeholder")
    print("Provenance")
    for k in keys:
        print(f"  {k:<22} {d.get(k)}")
    print(f"  {'run at (UTC)':<22} {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S}")
    print("Parameters")
    for k, v in params.items():
        if not k.startswith("_"):  # the runner's own bookkeeping (the budget's clock)
            print(f"  {k:<22} {v!r}")
    if random_weights:
        print("Weights: random (built from fastattn/voxcpm2_architecture.json with a seed). Timings are real; "
              "any audio is noise.")
    elif random_weights is False:
        print("Weights: a local checkpoint.")


def save_figure(fig, out_dir, name: str) -> Path:
    """Save a figure as PNG into the notebook's output folder (never overwriting) and return the path."""
    out = Path(out_dir) / "figures"
    out.mkdir(parents=True, exist_ok=True)
    path, i = out / f"{name}.png", 1
    while path.exists():
        i += 1
        path = out / f"{name}-{i}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def table(rows: list):
    """Rows (dicts with the same keys) as an HTML table for a notebook, floats to 3 significant digits."""
    from IPython.display import HTML

    return HTML(html_table(rows) if rows else "<p>(no rows)</p>")


def save(record: dict, out_dir, name: str) -> Path:
    """Save a record (JSON + CSV of rows) into the notebook's output folder, never overwriting."""
    return save_record(record, Path(out_dir) / "records", name)


def save_rows(P: dict, kind: str, rows: list, params: Optional[dict] = None, name: Optional[str] = None) -> Path:
    """Rows a notebook measured, saved as a ``kind`` record of ``P["device"]`` into ``P["out_dir"]``."""
    return save(record(kind, env=env_record(P["device"]), params=params or {}, rows=rows), P["out_dir"], name or kind)


def findings(out_dir, items: dict, key: Optional[Sequence[str]] = None) -> None:
    """Print the closing findings, write ``findings.json``; ``key`` (default: first four) lead the summary."""
    key = list(items)[:4] if key is None else list(key)
    missing = [k for k in key if k not in items]
    if missing:
        raise ValueError(f"key must name findings among items; not found: {missing}")
    print("Findings (measured in this run)")
    for k, v in items.items():
        print(f"  - {k}: {fmt(v, k)}" + ("   [key]" if k in key else ""))
    atomic_write_text(Path(out_dir, "findings.json"), json.dumps(items, indent=1, default=str))
    atomic_write_text(Path(out_dir, "key_findings.json"), json.dumps(key))


# --------------------------------------------------------------------------- runner
def _kernelspec(spec_root: Path) -> str:
    """A kernelspec for this interpreter under ``spec_root`` (a temp folder on JUPYTER_PATH)."""
    kdir = spec_root / "kernels" / "fastattn-runner"
    kdir.mkdir(parents=True, exist_ok=True)
    (kdir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"fastattn ({sys.executable})", "language": "python",
        "env": {"PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"},
    }))
    return kdir.name


def _new_run_dir(device: str, base: Optional[Path]) -> Path:
    base = Path(base) if base else reports_dir()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base.mkdir(parents=True, exist_ok=True)
    for i in range(1, 10_000):
        run = base / (f"{stamp}-{device.replace(':', '')}" + (f"-{i}" if i > 1 else ""))
        with contextlib.suppress(FileExistsError):
            run.mkdir()  # atomic: two runners starting in the same second never share a folder
            return run
    raise FileExistsError(f"{base}: no free run folder for {stamp}")


#: what the rendered notebooks add to nbconvert's page: code lines wrap instead of being clipped
_HTML_CSS = ("<style>.jp-InputArea-editor pre, .highlight pre, .jp-OutputArea-output pre "
             "{white-space: pre-wrap !important; overflow-wrap: anywhere;}</style>")


def _html(executed: Path, run_dir: Path, params: dict, items: Optional[dict], key: list) -> Path:
    """The executed notebook as HTML: code wrapped, no machine paths, no empty widget cells. With ``items`` (its
    findings.json) the key findings are first put in a markdown cell after its title, in the notebook too."""
    import nbformat
    from nbconvert import HTMLExporter
    nb = nbformat.read(str(executed), as_version=4)
    if items is not None:
        lines = ["**What this run found on this machine** (key findings from this run's own values; the last cell "
                 "lists them all):", ""]
        lines += [f"* {md_text(k)}: **{md_text(fmt(items[k], k))}**" for k in key if k in items]
        nb.cells.insert(1, nbformat.v4.new_markdown_cell("\n".join(lines), metadata={"tags": ["fastattn-findings"]}))
        nbformat.write(nb, str(executed))
    if not params.get("interactive"):
        nb.cells = [c for c in nb.cells if not (c.cell_type == "code" and c.source.lstrip().startswith(
            'if P["interactive"]') and not c.get("outputs"))]
    body, _ = HTMLExporter().from_notebook_node(nb)
    body = body.replace("</head>", _HTML_CSS + "</head>", 1)
    return atomic_write_text(executed.with_suffix(".html"), without_machine_paths(body, run_dir))


def run_workbook(params: Optional[dict] = None, *, only: Optional[list] = None, keep_going: bool = False,
                 out: Optional[Path] = None, timeout: int = 1800, log=print,
                 budget_s: Optional[float] = BUDGET_S, profile: Optional[str] = None) -> tuple[Path, dict]:
    """Run the notebooks; return (run folder, summary). A failure stops the run unless ``keep_going``.
    ``budget_s`` (s; None or 0: defaults) fits the sized measurements to this machine, never ``params``."""
    params = dict(params or {})
    prof = load_profile(profile) if profile else {}
    if prof:
        budget_s = prof.get("budget") or None
        timeout = max(timeout, int(prof.get("timeout", 0)))  # a profile's long cells (01's stream) need longer
    nbs = notebooks()
    if only:
        nbs = [p for p in nbs if any(p.name.startswith(o) or p.stem == o for o in only)]
        if not nbs:
            raise ValueError(f"--only {only}: no notebook matches (have: {', '.join(p.name for p in notebooks())})")
    _validate_run(params, nbs)
    for nb in nbs:  # a profile's sizes are its notebook's own
        _validate_run(prof.get("notebooks", {}).get(nb.stem, {}), [nb])
    per_nb = {nb.stem: {**prof.get("notebooks", {}).get(nb.stem, {}), **params} for nb in nbs}
    device = str(resolve_device(str(params.get("device", "auto"))))  # ValueError for cuda without CUDA
    if budget_s and unplannable(device):
        log(f"[fastattn] {unplannable(device)}")
        budget_s = None
    plan = None
    if budget_s:  # probe this machine and fit the sized measurements to the budget
        log("[fastattn] measuring this machine first (a few small-preset chunks per dtype) ...")
        probe = budget.probe(device)
        plan = dict(budget.plan(probe, [nb.stem for nb in nbs], given=params, budget_s=budget_s), probe=probe)
        for line in budget.plan_lines(plan):
            log(f"[fastattn] {line}")
    if prof:
        log(f"[fastattn] profile {profile}: " + "; ".join(profile_lines(prof, device)))
    run_dir, saved_path = _new_run_dir(device, out), os.environ.get("JUPYTER_PATH")
    with tempfile.TemporaryDirectory(prefix="fastattn-kernel-", ignore_cleanup_errors=True) as spec_root:
        kernel = _kernelspec(Path(spec_root))
        os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (spec_root, saved_path) if p)
        try:
            summary = _run_all(nbs, per_nb, run_dir, device, kernel, keep_going, timeout, log, plan)
            if prof.get("bench") and summary["status"] == "ok":
                summary["bench"] = _run_bench(prof["bench"], run_dir / "bench" / "records", device, log)
        finally:
            if saved_path is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = saved_path
    summary["parameters"], summary["profile"] = params, profile  # each notebook's own: its entry's
    summary["environment"] = {k: v for k, v in doctor(calibrate=False).items() if not isinstance(v, dict)}
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=1, default=str))
    write_report(run_dir, summary)
    return run_dir, summary


def load_profile(name: str) -> dict:
    """``data/profiles/<name>.yaml`` (``{budget, notebooks: {stem: params}, bench: [what]}``); else ValueError."""
    import yaml
    have = sorted(p.stem for p in (data_dir() / "profiles").glob("*.yaml"))
    if name not in have:
        raise ValueError(f"--profile {name!r}: expected one of {', '.join(have)}")
    prof = yaml.safe_load((data_dir() / "profiles" / f"{name}.yaml").read_text()) or {}
    bad = set(prof.get("bench", [])) - set(BENCH_EXTRAS)
    if bad:
        raise ValueError(f"profile {name}: bench {sorted(bad)} unknown (expected some of {sorted(BENCH_EXTRAS)})")
    return prof


def profile_lines(prof: dict, device: str) -> list:
    """A profile's plan: each notebook's sizes and, from this machine's probe and the calibration, its seconds."""
    sizes = prof.get("notebooks", {})
    est = budget.profile_estimate(budget.probe(device), [p.stem for p in notebooks()], sizes)
    return [f"{stem} about {t:.0f} s" + "".join(f", {k}={v}" for k, v in sizes.get(stem, {}).items())
            for stem, t in est.items()] + [f"then bench {', '.join(prof.get('bench', [])) or 'nothing'}; in all "
                                           f"about {sum(est.values()) / 60:.0f} min of notebooks"]


#: what a profile's ``bench`` list may name: records no notebook makes
BENCH_EXTRAS = ("compiled", "forms")


def _run_bench(what: list, out: Path, device: str, log) -> list:
    """The profile's bench records (both dtypes): their paths, a ``failed: ...`` entry per failing job."""
    entries = bench_cli.run(what, out, device, log=log, dtypes=("bfloat16", "float32"), progress=False)
    return [f"failed: {n}: {e['why']}" if e["status"] != "ok" else str((out / f).relative_to(out.parents[1]))
            for n, e in entries.items() for f in (e["files"] if e["status"] == "ok" else [None])]


def _validate_run(params: dict, nbs: list) -> None:
    """Before anything runs: ValueError for a parameter undeclared, mistyped, or not fitting a notebook."""
    import ast

    import papermill as pm

    declared = {nb.stem: pm.inspect_notebook(str(nb)) for nb in nbs}
    names = set().union(*declared.values())
    unknown = sorted(set(params) - names)
    if unknown:
        raise ValueError(f"parameter {', '.join(map(repr, unknown))} is not declared by any selected notebook "
                         f"(they declare: {', '.join(sorted(names - {'out_dir'}))})")
    check_params(**{k: v for k, v in params.items() if k != "out_dir"})
    for stem, d in declared.items():
        if "positions" in params and "positions" in d and "capacity" in d:
            cap = params.get("capacity", ast.literal_eval(d["capacity"]["default"]))
            try:
                check_params(positions=params["positions"], capacity=cap)
            except ValueError as exc:
                raise ValueError(f"{stem}: {exc}") from None


def _planned(plan: Optional[dict], params: dict, declared: dict, elapsed_s: float, stem: str = "05_profiling") -> dict:
    """The plan's parameters for ``stem`` (its own, none the user gave), and ``budget_s`` left if it sizes itself."""
    if not plan:
        return {}
    out = {k: v for k, v in plan["params"].items() if SCALABLE[k][0] == stem and k in declared and k not in params}
    if "budget_s" in declared and "steps" not in params and "budget_s" not in params:
        out["budget_s"] = round(notebook_budget(plan, elapsed_s, stem), 1)
    return out


def _run_all(nbs, per_nb: dict, run_dir: Path, device: str, kernel: str, keep_going: bool, timeout: int, log,
             plan: Optional[dict] = None) -> dict:
    import papermill as pm  # here: every kernel imports this module, and nbformat's jsonschema took 2.7 s to import
    from papermill.exceptions import PapermillExecutionError

    from .nbexec import ENGINE  # registers the engine with papermill
    params = next(iter(per_nb.values()), {})
    summary = {"run": run_dir.name, "parameters": params, "device": device, "started_utc":
               datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "notebooks": [], "plan": plan}
    for nb in nbs:
        elapsed = sum(e["duration_s"] for e in summary["notebooks"])
        declared, params = pm.inspect_notebook(str(nb)), per_nb[nb.stem]
        nb_params = {k: v for k, v in params.items() if k in declared}
        nb_params.update(_planned(plan, params, declared, elapsed, nb.stem))
        nb_out = run_dir / nb.stem
        nb_out.mkdir()
        if "out_dir" in declared:
            nb_params["out_dir"] = str(nb_out)
        executed = run_dir / nb.name
        entry = {"name": nb.name, "executed": executed.name, "html": None, "parameters": nb_params,
                 "planned_s": plan["estimate_s"].get(nb.stem) if plan else None, "status": "ok"}
        left = f" (plan: about {entry['planned_s']:.0f} s; {plan['budget_s'] - elapsed:.0f} s of " \
            f"the budget left)" if plan else ""
        log(f"[fastattn] running {nb.name}{left} ...")
        t0 = time.perf_counter()
        try:
            pm.execute_notebook(str(nb), str(executed), parameters=nb_params, kernel_name=kernel, engine_name=ENGINE,
                                cwd=str(nb.parent), execution_timeout=timeout,
                                progress_bar={"desc": f"[fastattn] {nb.stem}", "unit": "cell", "leave": False})
        except PapermillExecutionError as exc:
            entry.update(status="failed", error=f"{nb.name}, cell {exc.exec_count}: {exc.ename}: {exc.evalue}")
        except Exception as exc:  # kernel died, timeout, ...
            entry.update(status="failed", error=f"{nb.name}: {type(exc).__name__}: {exc}")
        entry["duration_s"] = time.perf_counter() - t0
        fj, kf = nb_out / "findings.json", nb_out / "key_findings.json"
        items = json.loads(fj.read_text()) if fj.exists() else None
        key = json.loads(kf.read_text()) if kf.exists() else list(items or {})[:4]
        if executed.exists():
            try:
                entry["html"] = _html(executed, run_dir, nb_params, items, key).name
            except Exception as exc:  # keep the executed notebook; a run whose report failed is not "ok"
                entry["html_error"] = f"{type(exc).__name__}: {exc}"
                entry["status"], entry["error"] = "failed", f"{nb.name}: writing its HTML failed: {exc}"
        entry["findings"], entry["key_findings"] = items or {}, key
        summary["notebooks"].append(entry)
        log(f"[fastattn] {nb.name}: {entry['status']} in {entry['duration_s']:.1f} s"
            + (f"\n[fastattn] ERROR {entry['error']}" if entry.get("error") else ""))
        if entry["status"] != "ok" and not keep_going:
            break
    summary["finished_utc"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    summary["status"] = "failed" if any(e["status"] != "ok" for e in summary["notebooks"]) else "ok"
    return summary


def _params_file(path: str) -> dict:
    """A --params YAML file: a mapping of parameter names to values, or a ValueError naming the file."""
    import yaml
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--params {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"--params {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is not None and (not isinstance(data, dict) or not all(isinstance(k, str) for k in data)):
        raise ValueError(f"--params {path}: expected a mapping of parameter names to values, got "
                         f"{type(data).__name__}")
    return dict(data or {})


def _out_dir(path: str) -> Path:
    """--out: an existing writable folder, or one that can be made; a ValueError naming it otherwise."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"--out {path}: exists and is not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {path}: cannot create it ({exc.strerror})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: not writable")
    return p


def _parse_value(text: str):
    import yaml
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m fastattn workbook",
                                 description="Run the workbook's notebooks headless into reports/<UTC time>-<device>/.")
    ap.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                    help="a parameter for every notebook that declares it (repeatable), e.g. -p device cuda")
    ap.add_argument("--params", help="YAML file of parameters")
    ap.add_argument("--only", action="append", help="run only notebooks starting with this (e.g. 03); repeatable")
    ap.add_argument("--keep-going", action="store_true", help="continue after a failing notebook")
    ap.add_argument("--out", help="parent folder of the run folder (default: reports/)")
    ap.add_argument("--timeout", type=int, default=1800, help="per-cell timeout in seconds")
    ap.add_argument("--profile", help="a named set of sizes (data/profiles/NAME.yaml), e.g. reference: the sizes "
                                      "that decide the seeds' claims (its plan printed first); sets the budget")
    ap.add_argument("--budget", type=float, default=BUDGET_S, metavar="SECONDS",
                    help=f"seconds of notebooks to fit the sized measurements to after probing this machine "
                         f"(default {BUDGET_S:.0f}; 0: the notebooks' own defaults, unscaled); -p values are never "
                         "changed")
    args = ap.parse_args(argv)
    try:
        params = _params_file(args.params) if args.params else {}
        params.update({k: _parse_value(v) for k, v in args.param})
        out = _out_dir(args.out) if args.out else None
        if args.budget < 0:
            raise ValueError(f"--budget {args.budget:g}: expected seconds >= 0 (0: no sizing)")
        run_dir, summary = run_workbook(params, only=args.only, keep_going=args.keep_going, out=out,
                                        timeout=args.timeout, budget_s=args.budget or None, profile=args.profile)
    except (ValueError, OSError) as exc:
        print(f"[fastattn] error: {exc}", file=sys.stderr)
        return 2
    print(f"[fastattn] run folder: {run_dir}")
    print(f"[fastattn] index: {run_dir / 'index.html'}")
    for n in summary["notebooks"]:
        if n["status"] != "ok":
            print(f"[fastattn] FAILED {n.get('error')}", file=sys.stderr)
    return 0 if summary["status"] == "ok" else 1
