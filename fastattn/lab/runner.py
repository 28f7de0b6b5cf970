"""One runner for named steps: ``--only/--skip/--resume``, one deadline, ``steps.jsonl``, records saved per step."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, NamedTuple, Optional

from .bench.records import save_record


class Step(NamedTuple):
    name: str
    fn: Callable         # () -> [records]
    estimate_s: float    # cold, at this device's sizes: a plan figure, not a measurement
    skip: Optional[str]  # why it cannot run here
    names: Optional[Callable] = None  # records -> their file stems (default: kind, and dtype where a kind repeats)


class Overrun(BaseException):
    """The run's budget ran out inside a step (a BaseException: a step's own ``except Exception`` must not eat it)."""


def select(steps: list, only=None, skip=None, default=None) -> list:
    """``steps`` named by ``only`` (else by ``default``, else all), less ``skip``; an unknown name is a ValueError."""
    names = [s.name for s in steps]
    bad = [n for n in [*(only or []), *(skip or [])] if n not in names]
    if bad:
        raise ValueError(f"unknown step(s) {bad}; the steps are {', '.join(names)}")
    chosen = set(only or default or names)
    return [s for s in steps if s.name in chosen and s.name not in set(skip or [])]


def add_arguments(ap, out_help: str) -> None:
    names = lambda s: [n for n in s.split(",") if n]  # noqa: E731
    ap.add_argument("--only", type=names, action="extend", help="run only these steps (names, comma-separated)")
    ap.add_argument("--skip", type=names, action="extend", help="leave these steps out")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (0: none)")
    ap.add_argument("--resume", action="store_true", help="continue --out, skipping the steps that ended ok there")
    ap.add_argument("--out", default=None, help=out_help)


@contextlib.contextmanager
def deadline(seconds: Optional[float]):
    """Raise :class:`Overrun` in this (main) thread once ``seconds`` have passed; a no-op without a budget."""
    if seconds is None or threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(*_):
        raise Overrun("the run's budget ran out during this step")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def log_entries(folder: Path) -> dict:
    """{step: its last entry} of the folder's ``steps.jsonl``."""
    path = Path(folder) / "steps.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {e["step"]: e for e in entries}


def open_folder(folder: Path, resume: bool) -> Path:
    """``folder``, created; an earlier run's folder only with ``resume`` (a run never overwrites another)."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())) and not resume:
        raise ValueError(f"--out {folder}: exists and is not empty (a run never overwrites an earlier one; --resume "
                         "continues it)")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _run_step(step: Step, folder: Path, left: Optional[float], failures: Callable) -> dict:
    """Run one step under the deadline; save its records at once; return its log entry."""
    if left is not None and step.estimate_s > left:
        return {"step": step.name, "status": "stopped", "seconds": 0.0,
                "why": f"its estimate of {step.estimate_s:.0f} s is over the {max(left, 0):.0f} s left of the budget"}
    t0, entry = time.perf_counter(), {"step": step.name, "files": [], "why": None}
    try:
        with deadline(left):
            recs = step.fn()
        kinds = [r["kind"] for r in recs]  # a kind written twice by one step is told apart by its dtype
        stems = step.names(recs) if step.names else [k + (f"_{r['params']['dtype']}" if kinds.count(k) > 1 and
                                                          isinstance(r["params"].get("dtype"), str) else "")
                                                     for k, r in zip(kinds, recs)]
        entry.update(files=[save_record(r, folder, stem).name for r, stem in zip(recs, stems)],
                     status="failed" if any(failures(r) for r in recs) else "ok")
    except Overrun as exc:
        entry.update(status="stopped", why=str(exc))
    except Exception as exc:  # noqa: BLE001 - one failing step is reported, the run goes on
        entry.update(status="failed", why=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
                     traceback=traceback.format_exc())
    return dict(entry, seconds=time.perf_counter() - t0)


def run_steps(steps: list, folder: Path, *, budget: Optional[float] = None, resume: bool = False, log=print,
              tag: str = "run", after: Callable = lambda: None, failures: Callable = lambda rec: []) -> dict:
    """Run ``steps`` into ``folder``; ``budget`` (s) stops or interrupts steps. Returns {step: its log entry}."""
    done = {n for n, e in log_entries(folder).items() if e["status"] == "ok"} if resume else set()
    t_start, entries = time.perf_counter(), {}
    for s in steps:
        if s.skip or s.name in done:
            log(f"[{tag}] {s.name}: {'skipped (' + s.skip + ')' if s.skip else 'ended ok earlier'}")
            continue
        entries[s.name] = entry = _run_step(s, folder, None if budget is None else
                                            budget - (time.perf_counter() - t_start), failures)
        with open(Path(folder) / "steps.jsonl", "a") as f:
            f.write(json.dumps(entry, default=str) + "\n")
        after()
        log(f"[{tag}] {s.name}: {entry['status']} ({entry['seconds']:.1f} s){': ' * bool(entry['why'])}"
            f"{entry['why'] or ''}")
    return entries
