"""fastattn: VoxCPM2's full-cache decode attention, proved, fixed and measured.

Runtime: :func:`attention_step`, :func:`attention`, :class:`RightSizedKVCache`; voxcpm side: :func:`patch_voxcpm`."""

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
from .upstream import upstream_diff  # noqa: E402

__version__ = "0.1.0"

__all__ = ["MODES", "attention_step", "calibrate_exact", "check_exactness", "exactness_report", "reset_exactness_cache",
           "window_for", "RightSizedKVCache", "fast_report", "reset_fast_cache", "MaskInfo", "attention",
           "explain_sdpa", "backend_matrix", "SDPAReport", "patch_voxcpm", "patch_status", "upstream_diff",
           "build_voxcpm2", "load_voxcpm2", "optimize"]
