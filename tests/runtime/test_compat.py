"""fastattn.compat: the torchaudio placeholder, engaged only where torchaudio cannot load, reversible."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def _run(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = f"{extra_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300)


def test_import_fastattn_and_voxcpm():
    r = _run("""
        import fastattn, voxcpm, importlib.util
        from fastattn import compat
        print(compat.shim_engaged(), importlib.util.find_spec('torchaudio') is not None)
    """)
    assert r.returncode == 0, r.stderr
    # On this install torchaudio is absent, so the placeholder is engaged and carries a spec.
    assert r.stdout.split() == ["True", "True"]


def test_placeholder_raises_clearly_when_used():
    r = _run("""
        import fastattn, torchaudio
        from fastattn.compat import TorchaudioUnavailable
        for call in (lambda: torchaudio.load('x.wav'), lambda: torchaudio.functional.resample(None, 1, 2)):
            try:
                call()
            except TorchaudioUnavailable as e:
                print('ERR', e)
            else:
                print('NO ERROR')
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith("ERR") for ln in lines)
    assert "torchaudio.load" in lines[0] and "not usable" in lines[0]
    assert "torchaudio.functional.resample" in lines[1]


def test_placeholder_not_engaged_when_torchaudio_works(tmp_path):
    pkg = tmp_path / "torchaudio"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\ndef load(p):\n    return 'real'\n")
    r = _run("""
        import fastattn, torchaudio
        from fastattn import compat
        print(compat.shim_engaged(), torchaudio.load('x'))
    """, extra_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "real"]


def test_placeholder_engaged_when_torchaudio_cannot_load(tmp_path):
    pkg = tmp_path / "torchaudio"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise OSError('libc10_cuda.so: cannot open shared object file')\n")
    r = _run("""
        import fastattn, voxcpm
        from fastattn import compat
        print(compat.shim_engaged())
        print(compat.shim_reason())
    """, extra_path=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()
    assert out[0] == "True" and "libc10_cuda.so" in out[1]


def test_placeholder_is_idempotent_and_reversible():
    r = _run("""
        import sys, fastattn
        from fastattn import compat
        first = sys.modules['torchaudio']
        assert compat.ensure_torchaudio() and sys.modules['torchaudio'] is first
        compat.disengage()
        assert 'torchaudio' not in sys.modules and not compat.shim_engaged()
        print('ok')
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_placeholder_survives_module_scans():
    """pickle's whichmodule (used by inductor's cache) walks every module with getattr: the placeholder
    must answer "no such attribute", not raise something else."""
    r = _run("""
        import pickle, fastattn, voxcpm, torchaudio
        print(pickle.whichmodule(object(), "no_such_name_anywhere"), getattr(torchaudio, "torch", "default"))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["__main__", "default"]
