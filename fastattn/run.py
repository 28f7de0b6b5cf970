"""``python -m fastattn run [--mode exact|fast|off] [--force] [--print-env] [--] COMMAND [ARGS...]``.

Runs COMMAND with voxcpm patched in every Python process it starts: a script, ``python -m ...``, a console script
(``voxcpm``, ``uvicorn``, ``jupyter``), their children and multiprocessing workers. As ``coverage run`` and
``opentelemetry-instrument`` do, it puts ``fastattn/hook`` first on PYTHONPATH; that folder's ``sitecustomize`` runs
the one that was there before, and patches once voxcpm's own import has finished. A process that never imports
voxcpm imports nothing more. ``--mode fast`` is opt-in and not bit-identical (docs/design.md)."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
import sysconfig
from pathlib import Path

HOOK_DIR = Path(__file__).resolve().with_name("hook")
MODES = ("exact", "fast", "off")
#: exit codes for bad input; otherwise the command's own exit code is the wrapper's (the wrapper execs it)
NO_COMMAND, BAD_MODE, NOT_EXECUTABLE, NOT_FOUND = 2, 3, 126, 127
USAGE = "usage: python -m fastattn run [--mode exact|fast|off] [--force] [--print-env] [--] COMMAND [ARGS...]"


def hook():
    """``fastattn_hook``, loaded from its folder as the processes it arms load it (it owns the variables' names)."""
    if "fastattn_hook" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fastattn_hook", HOOK_DIR / "fastattn_hook.py")
        sys.modules["fastattn_hook"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["fastattn_hook"]


def hook_env(mode: str = "exact", force: bool = False, environ=None) -> dict:
    """The variables that arm the hook in every Python process started with them (PYTHONPATH keeps what it had)."""
    before = (os.environ if environ is None else environ).get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(HOOK_DIR)] + ([before] if before else [])),
            hook().MODE: mode, hook().FORCE: "1" if force else "0"}


def _parse(argv: list) -> tuple:
    """(mode, force, print_env, command) or (exit code, message)."""
    mode, force, print_env, args = "exact", False, False, list(argv)
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        if opt == "--":
            break
        if opt in ("-h", "--help"):
            return 0, __doc__
        if opt == "--force" or opt == "--print-env":
            force, print_env = force or opt == "--force", print_env or opt == "--print-env"
        elif opt == "--mode" or opt.startswith("--mode="):
            mode = opt.partition("=")[2] if "=" in opt else (args.pop(0) if args else "")
            if mode not in MODES:
                return BAD_MODE, f"fastattn run: unknown mode {mode!r}; choose one of {', '.join(MODES)}"
        else:
            return NO_COMMAND, f"fastattn run: unknown option {opt!r}\n{USAGE}"
    if not args and not print_env:
        return NO_COMMAND, f"fastattn run: no COMMAND given\n{USAGE}"
    return mode, force, print_env, args


def main(argv=None) -> int:
    parsed = _parse(list(sys.argv[1:] if argv is None else argv))
    if len(parsed) == 2:
        print(parsed[1], file=sys.stdout if parsed[0] == 0 else sys.stderr)
        return parsed[0]
    mode, force, print_env, command = parsed
    env = hook_env(mode, force)
    if print_env:  # for a Dockerfile or a unit file: PYTHONPATH keeps what it has where these are read
        print(f'export PYTHONPATH={shlex.quote(str(HOOK_DIR))}"${{PYTHONPATH:+{os.pathsep}$PYTHONPATH}}"')
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items() if k != "PYTHONPATH"))
        return 0
    exe = shutil.which(command[0]) or (command[0] if os.sep in command[0] and os.path.exists(command[0]) else None)
    if exe is None:
        print(f"fastattn run: command not found: {command[0]}", file=sys.stderr)
        return NOT_FOUND
    if not os.access(exe, os.X_OK) or os.path.isdir(exe):
        print(f"fastattn run: not executable: {exe}", file=sys.stderr)
        return NOT_EXECUTABLE
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(exe, command, {**os.environ, **env})


def write_pth(site_dir=None) -> Path:
    """The ``.pth`` that gives an environment without torchaudio its placeholder at start (the workbook's .venv)."""
    path = Path(site_dir or sysconfig.get_paths()["purelib"]) / "fastattn-torchaudio.pth"
    path.write_text(f"{HOOK_DIR}\nimport fastattn_hook; fastattn_hook.at_start()\n")
    return path
