"""fastattn: VoxCPM2's full-cache decode attention, proved, fixed and measured.

Runtime: :func:`attention_step`, :func:`attention`, :class:`RightSizedKVCache`; voxcpm side: :func:`patch_voxcpm`."""

from importlib import import_module

from . import compat as _compat

_compat.ensure_torchaudio()
_compat.separate_inductor_cache()

from .cache import RightSizedKVCache  # noqa: E402
from .exactness import calibrate_exact, exactness_report, reset_exactness_cache  # noqa: E402
from .fast import fast_report, reset_fast_cache  # noqa: E402
from .masks import MaskInfo, attention  # noqa: E402
from .step import MODES, attention_step, check_exactness, window_for  # noqa: E402

__version__ = "0.1.0"

_LAZY = {
    "explain_sdpa": "backends", "backend_matrix": "backends", "SDPAReport": "backends",
    "patch_voxcpm": "patch", "patch_status": "patch", "upstream_diff": "upstream",
    "build_voxcpm2": "models", "load_voxcpm2": "models",
    "optimize": "graphs",
}

__all__ = ["MODES", "attention_step", "calibrate_exact", "check_exactness", "exactness_report", "reset_exactness_cache",
           "window_for", "RightSizedKVCache", "fast_report", "reset_fast_cache",
           "MaskInfo", "attention", *_LAZY]


_SUBMODULES = {"core", "clock", "step", "modes", "masks", "cache", "exactness", "fast", "static", "backends", "devices",
               "doctor", "claims", "diagnosis", "budget",
               "patch", "forward", "inflight", "models", "graphs", "upstream", "compat", "bench", "plots", "report",
               "workbook", "nbexec", "gpucheck", "runner", "ingest", "experiments", "paths"}


def __getattr__(name):
    if name in _SUBMODULES:
        return import_module(f".{name}", __name__)
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'fastattn' has no attribute {name!r}")
    value = getattr(import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)
