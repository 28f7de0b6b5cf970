"""Two environment workarounds, each engaged only where needed (docs/design.md).

An inductor cache per forced ``ATEN_CPU_CAPABILITY`` (torch's key omits it); a torchaudio stub VoxCPM2 never calls."""

from __future__ import annotations

import getpass
import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import tempfile
import types

_MARK = "__fastattn_placeholder__"


class TorchaudioUnavailable(AttributeError):
    """Raised on touching the torchaudio placeholder; an AttributeError so ``hasattr`` and pickle's scan move on."""


class _Placeholder(types.ModuleType):
    """A module whose every public attribute access raises TorchaudioUnavailable."""

    def __init__(self, name: str, reason: str):
        super().__init__(name)
        self.__dict__.update({
            _MARK: True, "__fastattn_reason__": reason, "__file__": None, "__version__": "0+fastattn.placeholder",
            "__spec__": importlib.machinery.ModuleSpec(name, loader=None, origin="fastattn.compat"),
            "__path__": [],  # a package, so `import torchaudio.functional` resolves to us
        })

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        raise TorchaudioUnavailable(
            f"{self.__name__}.{attr} was called, but torchaudio is not usable here "
            f"({self.__dict__['__fastattn_reason__']}); fastattn registered a placeholder so that "
            "`import voxcpm` works. VoxCPM2 inference from text or from tensors does not need "
            "torchaudio; loading or resampling audio files with the VoxCPM 1 model does. "
            "Install a torchaudio build that matches your torch to use it."
        )


def _broken_reason() -> str | None:
    existing = sys.modules.get("torchaudio")
    if existing is not None:
        return getattr(existing, "__fastattn_reason__", None)
    if importlib.machinery.PathFinder.find_spec("torchaudio") is None:  # on sys.path: not fastattn_hook's placeholder
        return "torchaudio is not installed"
    try:
        importlib.import_module("torchaudio")
    except Exception as exc:  # OSError from a CUDA-linked wheel, ImportError, ...
        for name in [m for m in sys.modules if m == "torchaudio" or m.startswith("torchaudio.")]:
            del sys.modules[name]
        return f"import torchaudio failed: {type(exc).__name__}: {exc}"
    return None


def ensure_torchaudio() -> bool:
    """Make ``import torchaudio`` succeed; True if the placeholder is engaged. Idempotent; never replaces a real one."""
    if shim_engaged():
        return True
    reason = _broken_reason()
    if reason is None:
        return False
    root = _Placeholder("torchaudio", reason)
    sys.modules["torchaudio"] = root
    for sub in ("functional", "transforms"):
        mod = _Placeholder(f"torchaudio.{sub}", reason)
        sys.modules[f"torchaudio.{sub}"] = mod
        root.__dict__[sub] = mod
    return True


def shim_engaged() -> bool:
    mod = sys.modules.get("torchaudio")
    return bool(mod is not None and mod.__dict__.get(_MARK, False))


def shim_reason() -> str | None:
    mod = sys.modules.get("torchaudio")
    return mod.__dict__.get("__fastattn_reason__") if shim_engaged() else None


def disengage() -> None:
    """Remove the placeholder (tests use this; modules that imported it keep their reference)."""
    if shim_engaged():
        for name in [m for m in sys.modules if m == "torchaudio" or m.startswith("torchaudio.")]:
            del sys.modules[name]


def separate_inductor_cache() -> str | None:
    """Give a forced build its own ``TORCHINDUCTOR_CACHE_DIR`` (returned; None: unchanged). Run before compiling."""
    build = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not build or os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    name = re.sub(r'[\\/:*?"<>|]', "_", f"torchinductor_{user}_aten-{build}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder = os.path.join(tempfile.gettempdir(), name)
    return folder
