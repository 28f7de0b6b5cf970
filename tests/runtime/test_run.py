"""``python -m fastattn run``: any program, patched where it imports voxcpm, proven on programs this project did not
write (upstream's CLI, a streaming service loop, multiprocessing workers); bad input gets its message and exit code;
the start-up hook never breaks a start."""

import ast
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fastattn import run

TEXT = "The quick brown fox jumps over the lazy dog near the quiet river bank. " * 5  # 360 characters
STEPS, TIMESTEPS = (200, 330), 1  # the stop lands here: positions past text + 200 > 512, the first window edge


def _python(code: str, *, wrap=None, env=None, timeout=600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code]
    cmd = [sys.executable, "-m", "fastattn", "run", *wrap, "--", *cmd] if wrap is not None else cmd
    return subprocess.run(cmd, capture_output=True, text=True, env=env or dict(os.environ), timeout=timeout)


def _with_path(*folders) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, folders))}


# --------------------------------------------------------------------------- the wrapper's contract, cheap
def test_a_process_that_never_imports_voxcpm_imports_no_torch():
    r = _python("import sys; print('torch' in sys.modules, 'fastattn' in sys.modules)", wrap=[])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"] and "fastattn[" not in r.stderr


def test_the_hook_imports_only_the_standard_library():
    """What runs at every interpreter start: os, sys and importlib's own parts, nothing that could import torch."""
    for path in run.HOOK_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        top = {n.names[0].name for n in tree.body if isinstance(n, ast.Import)}
        top |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
        assert top <= {"os", "sys"}, (path.name, top)


@pytest.mark.parametrize("argv, code, words", [
    ([], run.NO_COMMAND, "no COMMAND"),
    (["--mode", "bogus", "true"], run.BAD_MODE, "unknown mode 'bogus'"),
    (["--mode"], run.BAD_MODE, "unknown mode ''"),
    (["--frobnicate", "true"], run.NO_COMMAND, "unknown option '--frobnicate'"),
    (["--", "no-such-command-fastattn"], run.NOT_FOUND, "command not found: no-such-command-fastattn"),
])
def test_bad_input_gets_a_message_and_its_own_exit_code(argv, code, words, capsys):
    assert run.main(argv) == code
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_a_file_that_is_not_executable_is_refused(tmp_path, capsys):
    script = tmp_path / "script.py"
    script.write_text("print(1)\n")
    assert run.main([str(script)]) == run.NOT_EXECUTABLE
    assert "not executable" in capsys.readouterr().err


def test_exit_codes_are_distinct_and_pass_through_python_m_fastattn():
    assert len({run.NO_COMMAND, run.BAD_MODE, run.NOT_EXECUTABLE, run.NOT_FOUND, 0, 1}) == 6
    r = subprocess.run([sys.executable, "-m", "fastattn", "run", "--mode", "nope", "x"], capture_output=True, text=True)
    assert r.returncode == run.BAD_MODE and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "fastattn", "run", "--", sys.executable, "-c", "raise SystemExit(7)"],
                       capture_output=True, text=True)
    assert r.returncode == 7  # the command's own exit code


def test_print_env_arms_a_shell_that_cannot_be_wrapped():
    r = subprocess.run(["bash", "-c", f'eval "$({sys.executable} -m fastattn run --print-env --mode off)"; '
                                      f'{sys.executable} -c "import voxcpm"'], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "voxcpm 2.0.3 left unpatched (--mode off)" in r.stderr


CHILDREN = """
import multiprocessing as mp, os

def status(_):
    import fastattn, voxcpm
    s = fastattn.patch_status()
    return s["applied"] and s["mode"], os.environ.get("USER_SITE_RAN")

if __name__ == "__main__":
    for method in ("spawn", "fork"):
        with mp.get_context(method).Pool(1) as pool:
            print(method, *pool.map(status, [0])[0])
"""


def test_every_process_is_patched_and_the_users_sitecustomize_still_runs(tmp_path):
    """A spawned and a forked multiprocessing worker, each importing voxcpm itself; the user's own sitecustomize (on
    PYTHONPATH before the wrapper's) runs in each."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    (tmp_path / "children.py").write_text(CHILDREN)
    cmd = [sys.executable, "-m", "fastattn", "run", "--mode", "fast", "--", sys.executable,
           str(tmp_path / "children.py")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_with_path(tmp_path / "site"), timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["spawn fast yes", "fork fast yes"]
    assert r.stderr.count("patched voxcpm 2.0.3 (mode fast, verified)") == 2  # each importing process, once


def test_a_sitecustomize_that_imports_voxcpm_first_still_gets_the_patch(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import voxcpm\n")
    r = _python("import fastattn; print(fastattn.patch_status()['applied'])", wrap=[], env=_with_path(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True" and "patched voxcpm" in r.stderr


def test_mode_off_runs_the_same_hook_unpatched():
    r = _python("import voxcpm, fastattn; print(fastattn.patch_status()['applied'])", wrap=["--mode", "off"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False" and "left unpatched (--mode off)" in r.stderr


def test_a_changed_voxcpm_stops_at_its_import_naming_the_functions(tmp_path):
    from fastattn.lab.upstream import patched_copy
    root = patched_copy(tmp_path / "pkg", "right-sized")  # upstream's code, changed where the patch replaces it
    r = _python("import voxcpm; print('ran unpatched')", wrap=[], env=_with_path(root))
    assert r.returncode != 0 and "ran unpatched" not in r.stdout
    assert "changed source in MiniCPMAttention.forward_step" in r.stderr
    assert "--force" in r.stderr and "--mode off" in r.stderr


# --------------------------------------------------------------------------- never a broken start
def test_a_broken_hook_never_breaks_a_start(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text((run.HOOK_DIR / "sitecustomize.py").read_text())
    (hook / "fastattn_hook.py").write_text("raise RuntimeError('broken on purpose')\n")
    r = _python("print('started')", env={**_with_path(hook), "FASTATTN_RUN": "exact"})
    assert r.returncode == 0 and r.stdout.strip() == "started"
    assert "start-up hook failed (RuntimeError: broken on purpose); voxcpm will NOT be patched" in r.stderr


def test_at_start_swallows_its_own_failure(monkeypatch, capsys):
    hook = run.hook()
    monkeypatch.setattr(hook, "TorchaudioPlaceholder", None)  # isinstance(f, None) raises TypeError
    hook.at_start()
    assert "start-up hook failed (TypeError" in capsys.readouterr().err


@pytest.mark.skipif(Path(sys.prefix).name != ".venv", reason="the workbook's .venv (make setup) installs the .pth")
def test_the_workbooks_venv_is_a_normal_voxcpm_environment():
    """Upstream's README start and CLI work without importing fastattn first (torchaudio is absent here)."""
    assert (Path(sysconfig.get_paths()["purelib"]) / "fastattn-torchaudio.pth").is_file()
    r = _python("from voxcpm import VoxCPM; import fastattn.compat as c; print(c.shim_engaged())")
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
    cli = subprocess.run([sys.executable, "-m", "voxcpm.cli", "--help"], capture_output=True, text=True)
    assert cli.returncode == 0 and "design" in cli.stdout, cli.stderr
    r = _python("import sys; print('torch' in sys.modules, 'fastattn_hook' in sys.modules)")
    assert r.stdout.split() == ["False", "True"]  # at start: the hook's module, no torch


# --------------------------------------------------------------------------- programs this project did not write
@pytest.fixture(scope="module")
def stopping(tmp_path_factory):
    """A tiny random-weight checkpoint whose stop head ends this text's generation at a step in STEPS."""
    from fastattn.lab.bench.programs import stopping_checkpoint
    return stopping_checkpoint(tmp_path_factory.mktemp("programs"), TEXT, steps=STEPS, timesteps=TIMESTEPS)


def _both(make, stopping, tmp_path, suffix) -> dict:
    from fastattn.lab.bench.programs import program_env, wrapped
    env, out = program_env(stopping["site"]), {}
    for variant in ("plain", "wrapped"):
        cmd = make(stopping["checkpoint"], TEXT, tmp_path / f"{variant}{suffix}", TIMESTEPS)
        r = subprocess.run(wrapped(cmd) if variant == "wrapped" else cmd, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        out[variant] = ((tmp_path / f"{variant}{suffix}").read_bytes(), r.stderr)
    return out


@pytest.mark.slow
def test_upstreams_cli_writes_the_same_wav_under_the_wrapper(stopping, tmp_path):
    """``voxcpm design`` plain and under ``fastattn run``: the same bytes, generation ended by the stop head past the
    first 512-slot window, and the patch's line on stderr."""
    from fastattn.lab.bench.programs import cli_command
    assert len(TEXT) + stopping["step"] > 512
    out = _both(cli_command, stopping, tmp_path, ".wav")
    assert out["plain"][0] == out["wrapped"][0]
    assert "Badcase" not in out["plain"][1]  # it stopped by itself: voxcpm retries a generation cut by its length cap
    assert "patched voxcpm 2.0.3 (mode exact, verified)" in out["wrapped"][1] and "fastattn" not in out["plain"][1]


@pytest.mark.slow
def test_a_streaming_service_loop_gives_the_same_bytes_under_the_wrapper(stopping, tmp_path):
    """generate_streaming on a worker thread, chunks taken by another, as web services do."""
    import json

    from fastattn.lab.bench.programs import service_command
    out = _both(service_command, stopping, tmp_path, ".bin")
    assert out["plain"][0] == out["wrapped"][0] and len(out["plain"][0]) > 0
    chunks = json.loads((tmp_path / "wrapped.bin.json").read_text())["chunks"]
    assert chunks > 100 and "patched voxcpm" in out["wrapped"][1]
