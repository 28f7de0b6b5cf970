"""Decode attention forms a compiled or CUDA-graph decode can use (docs/design.md).

A form is ``(q, k, v, pos) -> out``, ``pos`` the newest key's position as a one-element int device tensor (Lq = 1)."""

from __future__ import annotations

import functools
import inspect
import math
import statistics
import sys
import time
import types
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .clock import interleaved
from .core import causal_mask, f64_attention, random_decode, sdpa, window_for


@functools.cache
def _flex():
    """``(BlockMask, flex_attention, kv_only)`` on first use, or None; ``kv_only`` skips the unread q-blocks."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:  # pragma: no cover
        return None
    kv_only = {"compute_q_blocks": False} if "compute_q_blocks" in inspect.signature(
        BlockMask.from_kv_blocks).parameters else {}
    return BlockMask, flex_attention, kv_only


#: FlexAttention's key block (torch's default block size): blocks past the position are never read
FLEX_BLOCK = 128
#: float32 acceptance floor, in ulps of the output scale: upstream's fp32 error is itself ulp noise, and twice
#: a lucky small one would reject a form on rounding alone
ULP_FLOOR = 4


# --------------------------------------------------------------------------- the forms: (q, k, v, pos) -> out
def upstream_masked(q, k, v, pos):
    return sdpa(q, k, v, causal_mask(k.shape[2], 1, pos.reshape(()) + 1, q.device))


def slice_live(q, k, v, pos):
    """(a) SDPA over exactly keys ``[0, pos]``, no mask (one host read of ``pos``)."""
    n = pos.reshape(()).item() + 1
    torch._check(n >= 1)
    torch._check(n <= k.shape[2])
    return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], enable_gqa=True)


def decode_block_mask(pos, n_keys: int, block: int = FLEX_BLOCK):
    """One decode step's block mask over ``n_keys`` slots from tensor ops on ``pos`` (no sync, static shapes)."""
    n_blocks = -(-n_keys // block)
    idx = torch.arange(n_blocks, device=pos.device, dtype=torch.int32).view(1, 1, 1, -1)  # (1, 1, 1, nb)
    length = pos.reshape(()) + 1
    full = (length // block).to(torch.int32)
    partial = (length % block != 0).to(torch.int32)
    partial_idx = torch.where(idx == 0, full.clamp(max=n_blocks - 1), idx)  # its first entry: the partial block
    last = pos.reshape(-1)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= last[0]

    block_mask, _, kv_only = _flex()
    return block_mask.from_kv_blocks(partial.view(1, 1, 1), partial_idx, full.view(1, 1, 1), idx,
                                     BLOCK_SIZE=(block, block), mask_mod=mask_mod, seq_lengths=(1, n_keys), **kv_only)


def flex_decode(q, k, v, pos):
    return _flex()[1](q, k, v, block_mask=decode_block_mask(pos, k.shape[2]), enable_gqa=True)


class Form(NamedTuple):
    name: str
    fn: Callable          # (q, k, v, pos) -> (B, Hq, 1, D)
    label: str            # its letter in the issue and what it is
    window: bool          # the caller hands a bucketed window, not the whole cache
    scalar_outputs: bool  # compiled with capture_scalar_outputs: it reads the key length on the host each step
    graphs: str           # how many graphs a decode records


FORMS = {f.name: f for f in (
    Form("slice_live", slice_live, "(a) SDPA over the exact slice (the public fix)", False, True,
         "one dynamo graph, measured with capture_scalar_outputs=True (which upstream's optimize() does not set); "
         "it reads the host each step, so CUDA graphs are expected to skip it (not measured: no GPU has run it)"),
    # (b) is (d)'s masked call over the bucketed window the caller hands (form_view)
    Form("bucketed_window", upstream_masked, "(b) bucketed window, mask kept", True, False,
         "at most 2 dynamo graphs; a CUDA graph per window (capacity / bucket at most)"),
    Form("flex_decode", flex_decode, "(c) FlexAttention, block mask from the position", False, False,
         "1 graph for the whole decode (static shapes)"),
    Form("upstream_masked", upstream_masked, "(d) upstream's masked call over the whole cache", False, False,
         "1 graph for the whole decode (static shapes, O(capacity))"),
)}


def flex_available(device="cpu") -> Optional[str]:
    """None where this torch has FlexAttention for ``device`` (compiling can still fail), else the reason."""
    if _flex() is None:
        return f"torch {torch.__version__} has no FlexAttention"
    build = torch.backends.cpu.get_cpu_capability()
    if torch.device(device).type == "cpu" and (build not in ("AVX2", "AVX512") or sys.platform == "darwin"):
        return f"inductor compiles FlexAttention on CPU only over AVX2 or AVX-512 kernels, off macOS ({build}, " \
               f"{sys.platform})"
    return None


# --------------------------------------------------------------------------- calling a form as a decode does
def layer_stack(fn: Callable, tag: str) -> Callable:
    """``stack(q, caches, pos)``: ``fn`` per layer, each output the next query, as a fresh code object named ``tag``:
    dynamo caches graphs per code object and ignores static addresses, so two stacks never share a graph."""
    def stack(q, caches, pos):
        x = q
        for k, v in caches:
            x = fn(x, k, v, pos)
        return x
    return types.FunctionType(stack.__code__.replace(co_name=tag), stack.__globals__, tag, None, stack.__closure__)


def compile_form(form: Form, mode: Optional[str] = None, layers: int = 1) -> Callable:
    stack = layer_stack(form.fn, f"{form.name}_x{layers}")
    fn = torch.compile(stack, backend="inductor", fullgraph=True, dynamic=None if form.window else False, mode=mode)
    if not form.scalar_outputs:
        return fn

    def call(*args):
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return fn(*args)
    return call


def form_view(name: str, k_cache, v_cache, length: int, bucket: int, static: bool = False):
    """K/V a decode hands form ``name``: ``bucketed_window`` its dynamic window (``static``: marked), else the cache."""
    if not FORMS[name].window:
        return k_cache, v_cache
    w = window_for(length, k_cache.shape[2], bucket)
    k, v = k_cache[:, :, :w], v_cache[:, :, :w]
    for t in (k, v):  # the window's size is symbolic from the first trace on (as RightSizedKVCache marks it)
        torch._dynamo.maybe_mark_dynamic(t, 2)
        if static:  # guard=False: a fresh window view each step must not recompile
            torch._dynamo.mark_static_address(t, guard=False)
    return k, v


def form_caller(name: str, fn: Callable, q, caches: list, bucket: int, *, static: bool = False,
                host: Optional[list] = None) -> Callable:
    """``call(p)``: ``fn`` with the newest key at ``p``; ``static``: inputs marked static; ``host``: host seconds."""
    pos = torch.zeros(1, dtype=torch.int64, device=q.device)
    if static:
        for t in (q, pos, *(x for kv in caches for x in kv)):
            torch._dynamo.mark_static_address(t, guard=False)

    def call(p):
        pos.fill_(p)
        views = [form_view(name, k, v, p + 1, bucket, static) for k, v in caches]
        t0 = time.perf_counter()
        out = fn(q, views, pos)
        if host is not None:
            host.append(time.perf_counter() - t0)
        return out
    return call


def decode_data(device, dtype, hq, hkv, head_dim, capacity, seed):
    return random_decode(device, dtype, hq=hq, hkv=hkv, head_dim=head_dim, capacity=capacity, seed=seed)


def stack_data(device, dtype, hq, hkv, head_dim, capacity, seed, layers: int = 1):
    draws = [decode_data(device, dtype, hq, hkv, head_dim, capacity, seed + i) for i in range(layers)]
    return draws[0][0], [d[1:] for d in draws]  # q of the first draw, K and V of each


#: key counts this process has attended over, per (CUDA device, dtype): cuDNN's plan cache is process-wide, so a
#: count an earlier step planned is not fresh for a later one (CPU kernels plan nothing: no registry there)
_CALLED: dict = {}


def called_key_counts(device, dtype) -> Optional[set]:
    """The registry's set for ``device`` and ``dtype`` (None off CUDA); callers add the key counts they use."""
    device = torch.device(device)
    return _CALLED.setdefault((str(device), str(dtype)), set()) if device.type == "cuda" else None


def fresh_positions(p: int, n: int, capacity: int, bucket: Optional[int] = None, *, device="cpu",
                    dtype=None) -> list:
    """``n`` distinct positions from ``p``, down within its bucket (same window), else up: a kernel that plans per
    key count pays as in a decode. On CUDA, counts used before are skipped and these recorded
    (:func:`called_key_counts`)."""
    lo = 0 if bucket is None else p // bucket * bucket  # lengths (lo, lo + bucket] share p's window
    used = called_key_counts(device, dtype)
    seen = used or set()
    fresh = lambda order: [i for i in order if i + 1 not in seen][:n]  # noqa: E731
    walk = fresh(range(p, lo - 1, -1))
    if len(walk) < n:
        walk = fresh(range(p, capacity))
    if len(walk) < n:
        raise ValueError(f"no {n} fresh positions from {p} within capacity {capacity}")
    if used is not None:
        used.update(i + 1 for i in walk)
    return walk


def fresh_calls(calls: dict, p: int, capacity: int, n: int, bucket: Optional[int] = None, *, device="cpu",
                dtype=None) -> dict:
    walk = fresh_positions(p, n, capacity, bucket, device=device, dtype=dtype)
    return {name: map(call, walk).__next__ for name, call in calls.items()}  # each call: the walk's next position


# --------------------------------------------------------------------------- the checks
def sweep_lengths(capacity: int, bucket: int, block: int = FLEX_BLOCK) -> list:
    """Key counts around every FlexAttention block edge and every bucket edge up to ``capacity``, and 1."""
    edges = set(range(block, capacity + 1, block)) | set(range(bucket, capacity + 1, bucket))
    return sorted({n for e in edges for n in (e - 1, e, e + 1) if 1 <= n <= capacity} | {1, capacity})


def _error_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    key = next((ln for ln in lines if "Error" in ln and len(ln) < 400), lines[0] if lines else "")
    return f"{type(exc).__name__}: {key.strip()[:300]}"


def torch_limit(form: Form, exc: BaseException, device) -> Optional[str]:
    """Why a failure is torch's, or None: before 2.14 SDPA's CUDA backend selection guards on an unbacked length."""
    text = f"{type(exc).__name__} {exc}".lower()
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if form.scalar_outputs and torch.device(device).type == "cuda" and version < (2, 14) \
            and any(w in text for w in ("data-dependent", "datadependent", "symbolic sizes", "unbacked")):
        return f"torch {torch.__version__}'s SDPA backend selection cannot take an unbacked key length (< 2.14)"
    return None


def error_bound(ref_err: float, scale: float, dtype) -> float:
    """The accepted error: twice upstream's, floored at :data:`ULP_FLOOR` ulps of the output scale in float32."""
    floor = ULP_FLOOR * torch.finfo(dtype).eps * scale if torch.finfo(dtype).bits >= 32 else 0.0
    return max(2 * ref_err, floor) + 1e-12


@torch.no_grad()
def check_form(name: str, device="cpu", dtype=torch.float32, *, hq: int = 16, hkv: int = 2, head_dim: int = 128,
               capacity: int = 2048, bucket: int = 256, steps: int = 2000, compile_mode: Optional[str] = None,
               seed: int = 0, draws: int = 1) -> dict:
    """Check one form compiled ``fullgraph=True`` (inductor) vs float64 over :func:`sweep_lengths`: ``available`` (else
    ``reason``), ``max_err`` vs upstream's ``reference_err``, ``accepted``, ``graphs`` vs ``graph_bound``,
    ``deterministic``. Resets dynamo: check before compiling a model."""
    if name not in FORMS:
        raise ValueError(f"name must be one of {sorted(FORMS)}, got {name!r}")
    form, device = FORMS[name], torch.device(device)
    row = {"form": name, "label": form.label, "compiled": True, "backend": "inductor", "available": False,
           "reason": None, "limit": None, "max_err": None, "reference_err": None, "bound": None, "accepted": False,
           "graphs": None, "graph_bound": 2 if form.window else 1, "within_bound": None, "graphs_note": form.graphs,
           "deterministic": None, "steps": steps, "compile_mode": compile_mode, "cudagraph_recordings": None}
    if name == "flex_decode" and flex_available(device):
        return dict(row, reason=flex_available(device))
    from .graphs import cudagraph_recordings, graph_counts, reset_graph_counts
    q, kc, vc = decode_data(device, dtype, hq, hkv, head_dim, capacity, seed)
    torch._dynamo.reset()
    reset_graph_counts()
    before = (cudagraph_recordings(device) or 0) if device.type == "cuda" else None  # the reset dropped the trees
    call = form_caller(name, compile_form(form, compile_mode), q, [(kc, vc)], bucket)
    at = lambda n: call(n - 1)  # noqa: E731 - n keys: the newest at n - 1
    errs, refs, scale = [], [], 0.0
    try:
        for d in range(draws):
            if d:  # copied into the same tensors: one compiled graph
                for t, new in zip((q, kc, vc), decode_data(device, dtype, hq, hkv, head_dim, capacity, seed + d)):
                    t.copy_(new)
            for n in sweep_lengths(capacity, bucket):
                want = f64_attention(q, kc, vc, n)
                scale = max(scale, want.abs().max().item())
                errs.append((at(n).double() - want).abs().max().item())
                refs.append((upstream_masked(q, kc, vc, torch.tensor([n - 1], device=device)).double() - want)
                            .abs().max().item())
        first = at(capacity // 2).clone()  # a CUDA-graph replay overwrites the previous replay's output
        row["deterministic"] = bool(torch.equal(first, at(capacity // 2)))
        for i in range(steps):
            at(1 + i % capacity)
    except Exception as exc:  # noqa: BLE001 - a form that cannot compile or run here is reported, not raised
        if isinstance(exc, torch.OutOfMemoryError):
            raise
        limit = torch_limit(form, exc, device)
        return dict(row, reason=f"{limit}: {_error_line(exc)}" if limit else _error_line(exc),
                    limit="torch" if limit else None)
    bound, graphs = error_bound(max(refs), scale, dtype), graph_counts()["unique_graphs"]
    row.update(available=True, max_err=max(errs), reference_err=max(refs), bound=bound, accepted=max(errs) <= bound,
               graphs=graphs, within_bound=graphs <= row["graph_bound"])
    if before is not None:
        after = cudagraph_recordings(device)
        row["cudagraph_recordings"] = None if after is None else after - before
    return row


# --------------------------------------------------------------------------- the choice
def form_winner(medians: dict) -> Optional[str]:
    """The one winner rule, {form: {position: ms}} -> lowest geometric mean (a form lacking a finite time is out)."""
    positions = set().union(*medians.values())
    ok = {f: per for f, per in medians.items()
          if positions and set(per) == positions and all(math.isfinite(t) and t > 0 for t in per.values())}
    return min(ok, key=lambda f: (geomean(ok[f].values()), f)) if ok else None


def geomean(xs) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


@torch.no_grad()
def _time_forms(names, device, dtype, hq, hkv, head_dim, capacity, bucket, positions, repeats, seed, mode,
                layers) -> dict:
    q, caches = stack_data(device, dtype, hq, hkv, head_dim, capacity, seed, layers)
    calls = {n: form_caller(n, compile_form(FORMS[n], mode, layers), q, caches, bucket, static=True) for n in names}
    out = {n: {} for n in names}
    for p in positions:
        times = interleaved(fresh_calls(calls, p, capacity, repeats + 2, bucket, device=device, dtype=dtype),
                            repeats=repeats, warmup=2, device=device)
        for n, t in times.items():
            out[n][p] = statistics.median(t) * 1e3 / layers
    return out


def choose_graph_form(device="cpu", dtype=torch.float32, *, hq: int, hkv: int, head_dim: int, capacity: int,
                      bucket: int = 256, positions=None, steps: int = 2000, repeats: int = 7,
                      seed: int = 0, compile_mode: Optional[str] = None, layers: int = 1) -> dict:
    """Check every form and time the accepted ones as ``layers``-stacks at ``positions``: a choice shaped as
    :func:`fastattn.fast.choose_fast`'s, ``median_ms`` a geomean. ``compile_mode`` defaults to CUDA graphs on CUDA."""
    from .devices import dtype_name
    device = torch.device(device)
    mode = compile_mode or ("reduce-overhead" if device.type == "cuda" else None)
    positions = list(positions or [capacity // 4 - 1, capacity // 2 - 1, capacity - 1])
    rows = [check_form(n, device, dtype, hq=hq, hkv=hkv, head_dim=head_dim, capacity=capacity, bucket=bucket,
                       steps=steps, seed=seed, compile_mode=mode) for n in FORMS]
    ok = [r["form"] for r in rows if r["available"] and r["accepted"] and r["within_bound"]]
    medians = _time_forms(ok, device, dtype, hq, hkv, head_dim, capacity, bucket, positions, repeats, seed, mode,
                          layers) if ok else {}
    for r in rows:
        per = medians.get(r["form"])
        r.update(candidate=r["form"], per_position_ms=per, median_ms=geomean(per.values()) if per else None)
    how = f"mode={mode}: CUDA graphs" if mode == "reduce-overhead" and device.type == "cuda" else \
        f"mode={mode or 'default'}: no CUDA graphs"
    return {"device": str(device), "dtype": dtype_name(dtype), "hq": hq, "hkv": hkv, "head_dim": head_dim,
            "lq_class": "lq=1", "length_class": "graph", "capacity": capacity, "bucket": bucket,
            "probe_lengths": positions, "reference_max_err": max((r["reference_err"] or 0) for r in rows),
            "candidates": rows, "winner": form_winner(medians), "compile_mode": mode, "layers": layers,
            "note": f"graph class: decode forms compiled with fullgraph=True (inductor, {how}), timed as "
                    f"stacks of {layers} layer(s); within twice upstream's error vs float64"}
