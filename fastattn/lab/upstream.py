"""The fix as patches upstream could merge: three kits of patched voxcpm 2.0.3 files under ``data/kits/``, and the
bench (``scripts/voxcpm_decode_bench.py``) as a fourth, a new script of upstream's repository the other three's texts
use to check them."""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

from fastattn import compat
from fastattn.devices import resolve_device
from fastattn.models import build_voxcpm2

from .paths import data_dir, repo_root

KIT_DIR = data_dir() / "kits"

#: layout -> (the right-sized kit's diff under data/, path prefix of the package in the target tree)
LAYOUTS = {
    "wheel": ("voxcpm-2.0.3-right-sized-decode.diff", ""),        # site-packages/voxcpm/... (voxcpm 2.0.3)
    "src": ("voxcpm-main-src-right-sized-decode.diff", "src/"),  # upstream's repository: src/voxcpm/...
}

#: the 2.0.3 files the kits change, by sha256 (first 16 hex digits): a kit refuses any other base
BASE_SHA = {
    "modules/minicpm4/cache.py": "644acd3bf7cf8313",
    "modules/minicpm4/model.py": "0733349295d13b2e",
    "modules/minicpm4/config.py": "5bed3ea87242f0ad",
    "model/utils.py": "cea16e1ab57f1512",
}


class DiffError(RuntimeError):
    """A diff that does not apply, or a base that is not the one a kit was written against."""


def _installed(rel: str) -> Path:
    compat.ensure_torchaudio()
    import voxcpm

    return Path(voxcpm.__file__).parent / rel


def _base_text(rel: str) -> str:
    text = _installed(rel).read_text()
    sha = hashlib.sha256(text.encode()).hexdigest()[:16]
    if sha != BASE_SHA[rel]:
        raise DiffError(f"voxcpm/{rel} is not voxcpm 2.0.3's (sha256 {sha}): the kits are written against 2.0.3")
    return text


def kit_sources(kit: str) -> dict:
    """``{"voxcpm/<rel>": (2.0.3 text, patched text)}`` of ``kit``'s package files (none for a kit of
    :data:`REPO_FILES`); DiffError where the base is not 2.0.3."""
    if kit not in KITS:
        raise ValueError(f"kit must be one of {sorted(KITS)}, got {kit!r}")
    if kit in REPO_FILES:
        return {}
    root = KIT_DIR / kit / "voxcpm"
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    return {f"voxcpm/{rel}": (_base_text(rel), (root / rel).read_text()) for rel in files}


def cache_source() -> str:
    """The right-sized kit's ``cache.py``: the library's sizing functions (:mod:`fastattn.cache`) and the class."""
    return (KIT_DIR / "right-sized" / "voxcpm" / "modules" / "minicpm4" / "cache.py").read_text()


#: kit -> (its ``{path: (old, new)}``, {layout: diff file under data/}, its upstream-style test under tests/); a
#: package kit's files are ``data/kits/<kit>/voxcpm/...``
KITS = {kit: (partial(kit_sources, kit), {"wheel": f"voxcpm-2.0.3-{name}.diff", "src": f"voxcpm-main-src-{name}.diff"},
              f"test_{test}.py") for kit, name, test in (
    ("right-sized", "right-sized-decode", "minicpm4_right_sized_cache"),
    ("cpu-dtype", "cpu-dtype-override", "model_utils"),
    ("decode-attention", "live-decode-attention", "minicpm4_decode_attention"))}
#: the bench: a new script of upstream's repository (outside the package, so not in the wheel). It only adds files,
#: so one diff serves main and the 2.0.3 tag alike
KITS["bench"] = (partial(kit_sources, "bench"), dict.fromkeys(LAYOUTS, "voxcpm-decode-bench.diff"),
                 "test_voxcpm_decode_bench.py")
#: a kit's new files outside the package: their path in upstream's repository -> this repository's file
REPO_FILES = {"bench": {"scripts/voxcpm_decode_bench.py": repo_root() / "scripts" / "voxcpm_decode_bench.py"}}
#: the fix kits (they change the package) and the bench kit
FIX_KITS = tuple(k for k in KITS if k not in REPO_FILES)


def diff_root(kit: str, layout: str) -> str:
    """Where ``kit``'s ``layout`` diff applies in a tree of upstream's repository: its root, or ``src`` (a 2.0.3
    diff's paths are the wheel's, ``voxcpm/...``)."""
    return "" if layout == "src" or kit in REPO_FILES else LAYOUTS["src"][1].rstrip("/")


def _defs(text: str) -> dict:
    """Top-level function and class sources of ``text``: name -> (first line, end line), 0-based, end exclusive."""
    return {node.name: (min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1, node.end_lineno)
            for node in ast.parse(text).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def _transplant(base: str, old: str, new: str) -> str:
    """``base`` with the top-level definitions ``new`` changes or adds over ``old`` (an added one before its next)."""
    lines = base.splitlines(True)
    ours, theirs = ({k: t.splitlines(True)[a:b] for k, (a, b) in _defs(t).items()} for t in (new, old))
    order = list(ours)
    for k in reversed([k for k in order if ours[k] != theirs.get(k)]):
        bd = _defs("".join(lines))
        if k in bd:
            lines[bd[k][0]:bd[k][1]] = ours[k]
        else:
            after = next(n for n in order[order.index(k) + 1:] if n in bd)
            lines[bd[after][0]:bd[after][0]] = ours[k] + ["\n", "\n"]
    return "".join(lines)


#: a kit's change to a file of upstream's repository outside the package (not in the wheel): a diff against main
#: stored under data/upstream-tests/. TEST_PATCHES: its tests, added to an existing file of upstream's tests/
SCRIPT_PATCHES = {"cpu-dtype": "scripts-test_pick_runtime_dtype.diff"}
TEST_PATCHES = {"cpu-dtype": "tests-test_model_utils.diff"}


def _new_file(path: str, text: str) -> str:
    return "".join(difflib.unified_diff([], text.splitlines(True), fromfile="/dev/null", tofile=f"b/{path}", n=3))


def test_setup(kit: str) -> str:
    """How ``kit``'s test reaches a tree of upstream's repository alone (no package change): a new file's diff,
    or its stored patch to an existing test file."""
    if kit in TEST_PATCHES:
        return (data_dir() / "upstream-tests" / TEST_PATCHES[kit]).read_text()
    test = KITS[kit][2]
    return _new_file(f"tests/{test}", (data_dir() / "upstream-tests" / test).read_text())


def upstream_diff(layout: str = "wheel", kit: str = "right-sized", base: Path | None = None) -> str:
    """``kit``'s ``-p1`` diff for site-packages (``wheel``) or upstream's repo (``src``), or against ``base``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    if kit in REPO_FILES:  # new files of the repository, the same against main and 2.0.3, and the kit's test
        return "".join(_new_file(path, src.read_text()) for path, src in REPO_FILES[kit].items()) + test_setup(kit)
    prefix, parts = LAYOUTS[layout][1], []
    for rel, (old, new) in sorted(kit_sources(kit).items(), reverse=True):
        if base is not None:
            theirs = (Path(base) / "src" / rel).read_text()
            old, new = theirs, (new if theirs == old else _transplant(theirs, old, new))
        parts.extend(difflib.unified_diff(old.splitlines(True), new.splitlines(True), fromfile=f"a/{prefix}{rel}",
                                          tofile=f"b/{prefix}{rel}", n=3))
    if layout == "src":  # upstream's repository carries the PR's tests too (a new file, or hunks against main's)
        parts.append(test_setup(kit))
        if kit in SCRIPT_PATCHES:  # and the change to upstream's own check script (hunks against main's file)
            parts.append((data_dir() / "upstream-tests" / SCRIPT_PATCHES[kit]).read_text())
    return "".join(parts)


_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _file_patches(diff: str) -> list:
    """``[(path after -p1, [(old start, old lines, new lines)], whether the file is new)]`` of a unified diff."""
    out, lines = [], iter(diff.splitlines(True))
    for line in lines:
        if line.startswith("--- "):
            out.append((next(lines)[4:].strip().split("/", 1)[1], [], line[4:].strip() == "/dev/null"))
        elif out and (m := _HUNK.match(line)):
            old, new = [], []
            while len(old) < int(m[2] or 1) or len(new) < int(m[4] or 1):
                body = next(lines)
                old += [body[1:]] if body[0] in " -" else []
                new += [body[1:]] if body[0] in " +" else []
            out[-1][1].append((int(m[1]), old, new))
    return out


def apply_diff(root, diff: str, max_offset: int = 200) -> list:
    """Apply a ``-p1`` ``diff`` under ``root``: [(path, hunk, offset)]; DiffError, nothing written, on a miss."""
    out, texts = [], {}
    for path, hunks, new_file in _file_patches(diff):
        target = Path(root) / path
        if not new_file and path not in texts and not target.is_file():
            raise DiffError(f"{path}: no such file under {root}")
        lines = texts.get(path) or ([] if new_file else target.read_text().splitlines(True))
        shift = 0
        for n, (start, old, new) in enumerate(hunks, 1):
            want = max(start - 1, 0) + shift
            found = next((p for d in range(max_offset + 1) for p in (want - d, want + d)
                          if 0 <= p <= len(lines) - len(old) and lines[p:p + len(old)] == old), None)
            if found is None:
                raise DiffError(f"{path}: hunk {n} (line {start}) does not apply: its lines are not there")
            lines[found:found + len(old)] = new
            shift += found - want + len(new) - len(old)
            out.append((path, n, found - want))
        texts[path] = lines
    for path, lines in texts.items():
        (Path(root) / path).parent.mkdir(parents=True, exist_ok=True)
        (Path(root) / path).write_text("".join(lines))
    return out


def pristine_copy(dest, layout: str = "wheel") -> Path:
    """Copy the installed voxcpm to ``dest/voxcpm`` (``layout="src"``: ``dest/src/voxcpm``); returns ``dest``."""
    dest = Path(dest)
    shutil.copytree(_installed(""), dest / LAYOUTS[layout][1] / "voxcpm", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def patched_copy(dest, kit="right-sized", layout: str = "wheel") -> Path:
    """:func:`pristine_copy` with ``kit``'s diffs applied in order; returns ``dest``, for a new process's PYTHONPATH.
    A kit of :data:`REPO_FILES` adds its files (not its test) under ``layout="src"``, and nothing to the wheel."""
    kits = (kit,) if isinstance(kit, str) else tuple(kit)
    for k in kits:
        if k not in KITS:
            raise ValueError(f"kit must be one of {sorted(KITS)}, got {k!r}")
    dest = pristine_copy(dest, layout)
    for k in kits:
        if k in REPO_FILES:  # upstream's repository has these files; the wheel has none of them
            for path, src in REPO_FILES[k].items() if layout == "src" else ():
                (dest / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, dest / path)
            continue
        # the installed 2.0.3 under either layout: its wheel diff, applied inside the layout's prefix
        diff = data_dir() / KITS[k][1]["wheel"]
        try:
            apply_diff(dest / LAYOUTS[layout][1], diff.read_text())
        except DiffError as exc:
            raise DiffError(f"{diff.name} ({k} kit) did not apply to a copy of the installed voxcpm: {exc}") from None
    return dest


def run_in_patched_copy(kit: str, script, *args, timeout: int = 1800, env: dict | None = None) -> dict:
    """What ``script`` saved to ``out`` in a fresh process over :func:`patched_copy`; else RuntimeError."""
    with tempfile.TemporaryDirectory() as tmp:
        root = patched_copy(Path(tmp) / "pkg", kit=kit)
        out = Path(tmp) / "out.pt"
        run = [str(script)] if isinstance(script, Path) else ["-c", script]
        r = subprocess.run([sys.executable, *run, str(root), *map(str, args), str(out)], capture_output=True,
                           text=True, env={**os.environ, **(env or {}), "PYTHONPATH": str(root)}, timeout=timeout)
        if r.returncode:
            raise RuntimeError(f"running through the {kit} kit failed: {r.stderr[-2000:]}")
        return torch.load(out)


def upstream_decode(preset: str, *, text: str, steps: int, dtype: str, seed: int, device: str, prepare=None):
    """Upstream's unpatched decode from ``seed``, after ``prepare(model)``: ``(model, waveform on CPU)``."""
    model = build_voxcpm2(preset, seed=seed, dtype=dtype, device=device)
    if prepare is not None:
        prepare(model)
    torch.manual_seed(seed)
    return model, model.generate(text, min_len=steps, max_len=steps, inference_timesteps=2).cpu()


def max_abs_diff(a, b) -> float:
    """The largest elementwise distance of two tensors in float64; inf where their shapes differ."""
    return float((a.double() - b.double()).abs().max()) if a.shape == b.shape else float("inf")


def decode_with_diff(preset: str, *, text: str, steps: int, dtype: str = "bfloat16", seed: int = 0,
                     device="cpu", granularity: int | None = None) -> dict:
    """Right-sized diff (fresh process) vs unpatched decode: {identical, max_abs_diff, capacities, ...}."""
    device = str(resolve_device(device))
    res = run_in_patched_copy("right-sized", KIT_DIR / "scripts" / "decode.py", preset, dtype, text, steps, seed,
                              device, *([granularity] if granularity else []))
    model, ref = upstream_decode(preset, text=text, steps=steps, dtype=dtype, seed=seed, device=device)
    return {"identical": bool(ref.shape == res["wav"].shape and torch.equal(ref, res["wav"])),
            "max_abs_diff": max_abs_diff(ref, res["wav"]),
            "diff_capacity": int(res["capacity"]), "upstream_capacity": int(model.base_lm.kv_cache.kv_cache.shape[4]),
            "length": int(res["length"]), "device": device}


#: the decode-attention kit's accuracy contract: "live"'s worst step error against float64 is at most this many
#: times "masked"'s (the bound its upstream tests assert)
LIVE_ERROR_BOUND = 2


def live_decode_check(preset: str, *, text: str, steps: int, dtype: str = "float32", seed: int = 0, device="cpu",
                      lengths=(1, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1000)) -> dict:
    """The ``decode-attention`` kit in a fresh process, masked vs live, step errors vs float64 at ``lengths``:
    {identical_off, max_abs_diff_on/_compiled, deterministic_on, step_errors, error_ratio, rows, ...}."""
    device = str(resolve_device(device))
    res = run_in_patched_copy("decode-attention", KIT_DIR / "scripts" / "live_check.py", preset, dtype, text, steps,
                              seed, device, json.dumps(list(lengths)))
    _, ref = upstream_decode(preset, text=text, steps=steps, dtype=dtype, seed=seed, device=device)
    same = ref.shape == res["masked"].shape == res["live"].shape
    err = res["step_errors"]
    return {"identical_off": bool(same and torch.equal(ref, res["masked"])),
            "max_abs_diff_on": max_abs_diff(res["live"], res["masked"]) if same else float("inf"),
            "max_abs_diff_compiled": max_abs_diff(res["live_compiled"], res["live"]),
            "deterministic_on": bool(torch.equal(res["live"], res["live_again"])),
            "step_errors": err, "lengths": list(lengths),
            "error_ratio": max(err["live"]) / max(max(err["masked"]), 1e-300), "error_bound": LIVE_ERROR_BOUND,
            "rows": res["rows"], "device": device, "dtype": dtype, "steps": steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastattn diff", description="The upstream-ready diffs.")
    ap.add_argument("--write", action="store_true", help="write every kit's diffs under data/, not print")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="wheel",
                    help="print the diff for site-packages (wheel) or upstream's repository (src)")
    ap.add_argument("--kit", choices=sorted(KITS), default="right-sized", help="which kit")
    ap.add_argument("--upstream", type=Path, default=None,
                    help="a checkout of upstream's main: the src diffs are made against its files")
    args = ap.parse_args(argv)
    if not args.write:
        print(upstream_diff(args.layout, args.kit, args.upstream if args.layout == "src" else None), end="")
        return 0
    written = set()
    for kit in KITS:
        for layout in LAYOUTS:
            if layout == "src" and args.upstream is None and kit == "cpu-dtype":
                print(f"kept {KITS[kit][1][layout]} (its file differs on main: pass --upstream CHECKOUT)")
                continue
            path = data_dir() / KITS[kit][1][layout]
            if path not in written:
                path.write_text(upstream_diff(layout, kit, args.upstream if layout == "src" else None))
                written.add(path)
                print(path)
    return 0
