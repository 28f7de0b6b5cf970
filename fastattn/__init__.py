"""fastattn: VoxCPM2's full-cache decode attention, proved, fixed and measured.

The runtime is this package's top level: :func:`attention_step`, :func:`attention`, :class:`RightSizedKVCache`, and on
the voxcpm side :func:`patch_voxcpm` (``python -m fastattn run`` applies it to any program). The workbook's lab,
which measures, judges and reports, is :mod:`fastattn.lab`; nothing here imports it."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from . import compat as _compat

_compat.ensure_torchaudio()
_compat.separate_inductor_cache()

from .backends import SDPAReport, backend_matrix, explain_sdpa  # noqa: E402
from .cache import RightSizedKVCache  # noqa: E402
from .exactness import calibrate_exact, exactness_report, reset_exactness_cache  # noqa: E402
from .fast import fast_report, reset_fast_cache  # noqa: E402
from .graphs import optimize  # noqa: E402
from .masks import MaskInfo, attention  # noqa: E402
from .models import build_voxcpm2, load_voxcpm2  # noqa: E402
from .patch import patch_status, patch_voxcpm  # noqa: E402
from .step import MODES, attention_step, check_exactness, window_for  # noqa: E402

__version__ = "0.1.0"

__all__ = ["MODES", "attention_step", "calibrate_exact", "check_exactness", "exactness_report", "reset_exactness_cache",
           "window_for", "RightSizedKVCache", "fast_report", "reset_fast_cache", "MaskInfo", "attention",
           "explain_sdpa", "backend_matrix", "SDPAReport", "patch_voxcpm", "patch_status", "upstream_diff",
           "build_voxcpm2", "load_voxcpm2", "optimize"]

#: Old names kept for one release (0.1 -> 0.2): ``fastattn.<module>`` is ``fastattn.lab.<module>``, and
#: ``fastattn.upstream_diff`` is ``fastattn.lab.upstream.upstream_diff``. Each use warns.
MOVED = ("bench", "budget", "claims", "diagnosis", "doctor", "experiments", "gpucheck", "nbexec", "paths", "plots",
         "profiling", "report", "runner", "tables", "upstream", "workbook")


def _moved(name: str):
    warnings.warn(f"fastattn.{name} moved to fastattn.lab.{name}; the old name goes in 0.3", DeprecationWarning, 3)
    return importlib.import_module(f"fastattn.lab.{name}")


def __getattr__(name: str):
    if name in MOVED or name == "upstream_diff":
        return _moved(name) if name in MOVED else _moved("upstream").upstream_diff
    raise AttributeError(f"module 'fastattn' has no attribute {name!r}")


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import fastattn.bench.records`` gives the module ``fastattn.lab.bench.records`` itself (one object)."""

    def find_spec(self, name, path=None, target=None):
        head, _, rest = name.partition(".")
        if head == "fastattn" and rest.split(".")[0] in MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        module = _moved(spec.name.partition(".")[2])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # the import system set the old name's spec on it


sys.meta_path.insert(0, _MovedFinder())
