"""Measuring instruments: attention sweep, decode-step sweep, whole decode, memory, bandwidth floor, targets.

Every function returns a *record* built by :func:`record`: ``{"kind", "env",
"params", "rows", ...}`` that plots and target checks read and :func:`save_record`
writes as JSON (+ CSV of the rows) under a name that is never reused. Timing is
honest on a shared, noisy box: variants are interleaved call by call (rotating
their order afresh each repeat, seeded), after warm-up, several repeats, and reported as median
with p10/p90 spread; on CUDA every sample is bracketed by CUDA events and one
synchronisation. No test asserts a time; :func:`check_targets` compares records
with the workbook's targets and says pass or fail with the measured figure.

Layout: ``timing`` (interleaving, statistics), ``floor`` (bandwidth, live bytes),
``attention`` (one call per mode, fast's choice), ``steps`` (one decode step,
eager and compiled), ``decode`` (a whole generate, split by component),
``memory`` (KV bytes, allocations, fill and growth, peak RSS), ``stream`` (time per streamed chunk),
``records``,
``targets``, ``cli``.
"""

from ..devices import DTYPES, resolve_device
from .attention import attention_sweep, cpu_flags, dtype_costs, fast_choices
from .cli import main, reference_run
from .decode import whole_decode
from .floor import bandwidth, bandwidth_line, floor_ms, live_kv_bytes, llc_bytes
from .memory import cache_growth, fill_cost, kv_memory, peak_rss, step_allocations
from .records import env_record, load_record, record, save_record
from .stats import ratio_ci, scaled_ci
from .steps import compiled_step_sweep, decode_step_sweep
from .stream import stream_profile, stream_table
from .targets import GOALS, check_targets, target_goals
from .timing import time_interleaved

__all__ = ["env_record", "record", "time_interleaved", "attention_sweep", "fast_choices", "dtype_costs", "cpu_flags",
           "decode_step_sweep", "compiled_step_sweep", "whole_decode", "resolve_device", "kv_memory",
           "step_allocations", "fill_cost", "cache_growth", "stream_profile", "stream_table", "peak_rss", "bandwidth",
           "floor_ms",
           "live_kv_bytes", "llc_bytes",
           "bandwidth_line", "save_record", "load_record", "check_targets", "target_goals", "GOALS",
           "ratio_ci", "scaled_ci", "reference_run", "main", "DTYPES"]
