"""Measuring instruments: each returns a record (:func:`record`); headline figures come from :mod:`.metrics`.
Timing lives here, never in a test's assertion (``timing`` tests are benchmarks, outside ``make test``)."""

from fastattn.devices import DTYPES, resolve_device

from ..machine import cpu_flags
from .attention import attention_sweep, dtype_costs, fast_choices
from .cli import main
from .consumers import consumer_contention, consumer_matrix, consumer_table, stream_audio
from .decode import dtype_decode, whole_decode
from .floor import bandwidth, bandwidth_line, floor_ms, live_kv_bytes, llc_bytes
from .forms import form_sweep
from .lm import compile_counts, compiled_step_sweep, decode_step_sweep
from .memory import cache_growth, fill_cost, kv_memory, peak_rss, step_allocations
from .metrics import (
                      HEADLINES,
                      Figure,
                      attention_share,
                      attention_share_line,
                      dtype_recommendation,
                      dtype_table,
                      headlines,
                      split_line,
                      time_shares,
)
from .prompts import prompt_growth, prompt_table
from .records import env_record, load_record, load_run, record, save_record
from .split import step_split
from .stats import ratio_ci, scaled_ci
from .stream import COMPONENTS, component_table, stream_profile, stream_table
from .targets import GOALS, check_targets, target_goals
from .timing import time_interleaved

__all__ = [
    "COMPONENTS", "DTYPES", "Figure", "GOALS", "HEADLINES", "attention_share", "attention_share_line",
    "attention_sweep", "bandwidth", "bandwidth_line", "cache_growth", "check_targets", "compile_counts",
    "compiled_step_sweep", "component_table", "consumer_contention", "consumer_matrix", "consumer_table",
    "cpu_flags", "decode_step_sweep", "dtype_costs", "dtype_decode", "dtype_recommendation", "dtype_table",
    "env_record", "fast_choices", "fill_cost", "floor_ms", "form_sweep", "headlines", "kv_memory", "live_kv_bytes",
    "llc_bytes", "load_record", "load_run", "main", "peak_rss", "prompt_growth", "prompt_table", "ratio_ci",
    "record", "resolve_device", "save_record", "scaled_ci", "split_line", "step_allocations", "step_split",
    "stream_audio", "stream_profile", "stream_table", "target_goals", "time_interleaved", "time_shares", "whole_decode",
]
