"""Static-shape decode attention: the forms a compiled or CUDA-graph decode can use, and their checks.

An eager decode slices the cache to the live keys (``fast``). A compiled one cannot do that for free:
slicing by a device position is data-dependent (``fullgraph=True`` refuses it), a Python-int position
makes dynamo specialise on it (one graph per step until the recompile limit), and CUDA graphs replay
fixed shapes. Each form here takes the cache view a compiled step holds and the newest token's position
``pos`` as a one-element integer device tensor (``length = pos + 1``, Lq = 1), and states how many graphs a
decode records with it (:data:`FORMS`):

``slice_live`` (a)
    SDPA over exactly ``[0, pos]``, no mask: the public slice fix. Compiles into one graph only with
    ``capture_scalar_outputs`` (the length becomes an unbacked size): that is a host read of the
    position per step, so no CUDA graph can hold it; under upstream's ``optimize()`` settings it is refused.
``bucketed_window`` (b)
    upstream's masked SDPA over a window of the cache rounded up to ``bucket`` slots (the caller's host
    bookkeeping picks the window): O(length + bucket), at most two dynamo graphs (static, then dynamic) and
    one CUDA-graph recording per window (``capacity / bucket`` at most).
``flex_decode`` (c)
    FlexAttention over the whole cache with a block mask built in the graph from ``pos``: full blocks
    ``[0, length // B)`` skip the mask, one partial block holds the last key, blocks past it are never
    read. Static shapes, no host sync, GQA native: one graph for the whole decode. Fused only under
    ``torch.compile`` (eager FlexAttention is torch's unfused reference over every slot); on CPU it
    needs inductor's C++ backend.
``upstream_masked`` (d)
    upstream's call: a bool mask over every slot, SDPA with ``enable_gqa``. One graph, O(capacity).

:func:`check_form` compiles one form with ``fullgraph=True`` and reports its availability (the reason
where it cannot compile), its max error against float64 over a dense sweep of lengths around every
block and bucket edge, against twice upstream's error on the same data, its graphs over a long run of
consecutive steps, and its determinism. :func:`choose_graph_form` adds an interleaved timing and picks the
fastest accepted form (the ``fast`` chain's graph class, :func:`fastattn.fast.graph_choice`).
"""

from __future__ import annotations

import statistics
import sys
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .clock import interleaved
from .core import causal_mask, f64_attention, random_decode, sdpa, window_for

__all__ = ["FLEX_BLOCK", "FORMS", "Form", "slice_live", "bucketed_window", "flex_decode", "upstream_masked",
           "decode_block_mask", "flex_available", "sweep_lengths", "check_form",
           "choose_graph_form", "form_view", "form_caller", "compile_form", "decode_data", "fresh_calls"]

#: FlexAttention's key block (torch's default block size): blocks past the position are never read
FLEX_BLOCK = 128


# --------------------------------------------------------------------------- the forms: (q, k, v, pos) -> out
def upstream_masked(q, k, v, pos):
    """(d) upstream's call over every slot of ``k``, ``v`` (B, Hkv, n, D): the bool mask ``arange(n) <= pos``."""
    return sdpa(q, k, v, causal_mask(k.shape[2], 1, pos.reshape(()) + 1, q.device))


def bucketed_window(q, k, v, pos):
    """(b) the same masked call, over the bucketed window the caller hands (:func:`form_view`)."""
    return upstream_masked(q, k, v, pos)


def slice_live(q, k, v, pos):
    """(a) SDPA over exactly keys ``[0, pos]``, no mask (one host read of ``pos``)."""
    n = pos.reshape(()).item() + 1
    torch._check(n >= 1)
    torch._check(n <= k.shape[2])
    return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], enable_gqa=True)


def decode_block_mask(pos, n_keys: int, block: int = FLEX_BLOCK):
    """The block mask of one decode step (Lq = 1) over ``n_keys`` slots, built from tensor ops on ``pos``
    (no host sync, fixed shapes): ``length // block`` full blocks, then the one partial block holding key
    ``pos`` (none where ``length`` ends on a block edge); ``mask_mod`` masks keys past ``pos`` inside it."""
    from torch.nn.attention.flex_attention import BlockMask

    n_blocks = -(-n_keys // block)
    idx = torch.arange(n_blocks, device=pos.device, dtype=torch.int32).view(1, 1, 1, -1)  # (1, 1, 1, nb)
    length = pos.reshape(()) + 1
    full = (length // block).to(torch.int32)
    partial = (length % block != 0).to(torch.int32)
    partial_idx = torch.where(idx == 0, full.clamp(max=n_blocks - 1), idx)  # its first entry: the partial block
    last = pos.reshape(-1)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= last[0]

    return BlockMask.from_kv_blocks(partial.view(1, 1, 1), partial_idx, full.view(1, 1, 1), idx,
                                    BLOCK_SIZE=(block, block), mask_mod=mask_mod, seq_lengths=(1, n_keys))


def flex_decode(q, k, v, pos):
    """(c) FlexAttention over every slot of ``k``, ``v``, reading only blocks up to ``pos``."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=decode_block_mask(pos, k.shape[2]), enable_gqa=True)


class Form(NamedTuple):
    name: str
    fn: Callable          # (q, k, v, pos) -> (B, Hq, 1, D)
    label: str            # its letter in the issue and what it is
    window: bool          # the caller hands a bucketed window, not the whole cache
    scalar_outputs: bool  # compiles into one graph only with capture_scalar_outputs (a host read per step)
    graphs: str           # how many graphs a decode records


FORMS = {f.name: f for f in (
    Form("slice_live", slice_live, "(a) SDPA over the exact slice (the public fix)", False, True,
         "1 dynamo graph with capture_scalar_outputs (unbacked length; a host read per step, so no CUDA graph); "
         "refused under upstream's optimize() settings"),
    Form("bucketed_window", bucketed_window, "(b) bucketed window, mask kept", True, False,
         "at most 2 dynamo graphs (static, then dynamic window); one CUDA-graph recording per window, at most "
         "capacity / bucket"),
    Form("flex_decode", flex_decode, "(c) FlexAttention, block mask from the position", False, False,
         "1 graph for the whole decode (static shapes)"),
    Form("upstream_masked", upstream_masked, "(d) upstream's masked call over the whole cache", False, False,
         "1 graph for the whole decode (static shapes, O(capacity))"),
)}


def form_view(name: str, k_cache, v_cache, length: int, bucket: int):
    """The K/V views a decode hands form ``name`` at ``length`` live keys: the bucketed window for
    ``bucketed_window`` (``min(ceil(length / bucket) * bucket, capacity)`` slots), the whole cache otherwise."""
    if not FORMS[name].window:
        return k_cache, v_cache
    w = window_for(length, k_cache.shape[2], bucket)
    k, v = k_cache[:, :, :w], v_cache[:, :, :w]
    for t in (k, v):  # the window's size is symbolic from the first trace on (as RightSizedKVCache marks it)
        torch._dynamo.maybe_mark_dynamic(t, 2)
    return k, v


def flex_available(device="cpu") -> Optional[str]:
    """None where this torch has FlexAttention for ``device``, else the reason (compiling it can still fail:
    see check_form). On CPU inductor lowers it only over AVX2 or AVX-512 kernels, off macOS."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no FlexAttention ({exc})"
    build = torch.backends.cpu.get_cpu_capability()
    if torch.device(device).type == "cpu" and (build not in ("AVX2", "AVX512") or sys.platform == "darwin"):
        return f"inductor compiles FlexAttention on CPU only over AVX2 or AVX-512 kernels, off macOS ({build}, " \
               f"{sys.platform})"
    return None


# --------------------------------------------------------------------------- the checks
def sweep_lengths(capacity: int, bucket: int, block: int = FLEX_BLOCK) -> list:
    """Key counts around every FlexAttention block edge and every bucket edge up to ``capacity``, and 1."""
    edges = set(range(block, capacity + 1, block)) | set(range(bucket, capacity + 1, bucket))
    return sorted({n for e in edges for n in (e - 1, e, e + 1) if 1 <= n <= capacity} | {1, capacity})


def compile_form(form: Form, backend: str = "inductor", mode: Optional[str] = None) -> Callable:
    """``form`` under ``torch.compile(fullgraph=True)`` (``mode="reduce-overhead"``: CUDA graphs on CUDA); the
    slice with ``capture_scalar_outputs``, the only setting under which it compiles into one graph."""
    opts = {"backend": backend, "fullgraph": True, "dynamic": None if form.window else False}
    fn = torch.compile(form.fn, **opts, **({"mode": mode} if mode else {}))
    if not form.scalar_outputs:
        return fn

    def call(*args):
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return fn(*args)
    return call


def form_caller(name: str, fn: Callable, q, k_cache, v_cache, bucket: int) -> Callable:
    """``call(p)``: one decode step of form ``name`` (run as ``fn``) with the newest key at position ``p``, handed
    the views a decode hands it (:func:`form_view`) and its own position tensor."""
    pos = torch.zeros(1, dtype=torch.int64, device=q.device)

    def call(p):
        pos.fill_(p)
        return fn(q, *form_view(name, k_cache, v_cache, p + 1, bucket), pos)
    return call


def _error_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    key = next((ln for ln in lines if "Error" in ln and len(ln) < 400), lines[0] if lines else "")
    return f"{type(exc).__name__}: {key.strip()[:300]}"


def decode_data(device, dtype, hq, hkv, head_dim, capacity, seed):
    """Random q (1, Hq, 1, D) and K, V caches (1, Hkv, capacity, D), seeded, on ``device`` in ``dtype``. K and V
    are views of one (2, 1, Hkv, capacity, D) tensor, as voxcpm's caches hold them."""
    return random_decode(device, dtype, hq=hq, hkv=hkv, head_dim=head_dim, capacity=capacity, seed=seed)


@torch.no_grad()
def check_form(name: str, device="cpu", dtype=torch.float32, *, hq: int = 16, hkv: int = 2, head_dim: int = 128,
               capacity: int = 2048, bucket: int = 256, steps: int = 2000, backend: str = "inductor",
               compiled: bool = True, compile_mode: Optional[str] = None, seed: int = 0, draws: int = 1) -> dict:
    """One form of :data:`FORMS`, compiled with ``fullgraph=True`` (or eager with ``compiled=False``).

    Returns a row: ``available`` (False with ``reason`` where it cannot compile or run here), ``max_err`` and
    ``reference_err`` against float64 over :func:`sweep_lengths` and ``draws`` random draws of q, K and V
    (copied into the same tensors: one compiled graph) (``reference``: upstream's eager call on the same
    data), ``accepted`` (``max_err <= 2 * reference_err``), ``graphs`` (dynamo graphs compiled over the
    sweep and ``steps`` consecutive positions, each one more key), ``graph_bound`` (what the form promises),
    ``deterministic`` (the same inputs twice give the same bits) and, on CUDA, ``cudagraph_recordings``
    (graphs cudagraph trees recorded, with ``compile_mode="reduce-overhead"``).

    Resets dynamo (``torch._dynamo.reset()``, which also drops the cudagraph trees) and its counters: every
    function compiled earlier in this process compiles again on its next call. Check forms before compiling
    a model."""
    if name not in FORMS:
        raise ValueError(f"name must be one of {sorted(FORMS)}, got {name!r}")
    form, device = FORMS[name], torch.device(device)
    row = {"form": name, "label": form.label, "compiled": compiled, "backend": backend if compiled else None,
           "available": False, "reason": None, "max_err": None, "reference_err": None, "accepted": False,
           "graphs": None, "graph_bound": (2 if form.window else 1) if compiled else None,
           "within_bound": None, "graphs_note": form.graphs, "deterministic": None, "steps": steps,
           "compile_mode": compile_mode, "cudagraph_recordings": None}
    if name == "flex_decode" and flex_available(device):
        return dict(row, reason=flex_available(device))
    from torch._dynamo.utils import counters

    from .graphs import cudagraph_recordings
    q, kc, vc = decode_data(device, dtype, hq, hkv, head_dim, capacity, seed)
    torch._dynamo.reset()
    counters.clear()
    before = (cudagraph_recordings(device) or 0) if device.type == "cuda" else None  # the reset dropped the trees
    step = form_caller(name, compile_form(form, backend, compile_mode) if compiled else form.fn, q, kc, vc, bucket)
    at = lambda n: step(n - 1)  # noqa: E731 - n keys: the newest at n - 1
    errs, refs = [], []
    try:
        for d in range(draws):
            if d:
                for t, new in zip((q, kc, vc), decode_data(device, dtype, hq, hkv, head_dim, capacity, seed + d)):
                    t.copy_(new)
            for n in sweep_lengths(capacity, bucket):
                want = f64_attention(q, kc, vc, n)
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
        return dict(row, reason=_error_line(exc))
    row.update(available=True, max_err=max(errs), reference_err=max(refs),
               accepted=max(errs) <= 2 * max(refs) + 1e-12)
    if compiled:
        row["graphs"] = counters["stats"].get("unique_graphs", 0)
        row["within_bound"] = row["graphs"] <= row["graph_bound"]
    if before is not None:
        after = cudagraph_recordings(device)
        row["cudagraph_recordings"] = None if after is None else after - before
    return row


def fresh_calls(calls: dict, p: int, capacity: int) -> dict:
    """``{form: call()}`` for a timing at position ``p``: each call of a form steps to a position no earlier call
    used (``p``, ``p - 1``, ... or, near 0, ``p``, ``p + 1``, ...), as a decode adds a key every step: a kernel
    that builds a plan per key count (cuDNN's graph cache on Hopper) pays for it here too. Every form walks the
    same positions."""
    def walk(call):
        down = p >= capacity // 2
        it = iter(range(p, -1, -1) if down else range(p, capacity))
        return lambda: call(next(it))
    return {n: walk(c) for n, c in calls.items()}


@torch.no_grad()
def _time_forms(names, device, dtype, hq, hkv, head_dim, capacity, bucket, positions, repeats, backend,
                seed) -> dict:
    """Median ms per position per form, compiled, interleaved (:func:`fastattn.clock.interleaved`), each call
    one more key count (:func:`fresh_calls`)."""
    q, kc, vc = decode_data(device, dtype, hq, hkv, head_dim, capacity, seed)
    calls = {n: form_caller(n, compile_form(FORMS[n], backend), q, kc, vc, bucket) for n in names}
    out = {}
    for p in positions:
        times = interleaved(fresh_calls(calls, p, capacity), repeats=repeats, warmup=2, device=device)
        out[p] = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    return out


def choose_graph_form(device="cpu", dtype=torch.float32, *, hq: int, hkv: int, head_dim: int, capacity: int,
                      bucket: int = 256, positions=None, steps: int = 2000, repeats: int = 7,
                      backend: str = "inductor", seed: int = 0) -> dict:
    """Check every form (:func:`check_form`), time the accepted ones within their graph bound at
    ``positions`` (default: a quarter, half and the end of ``capacity``), and pick the fastest by the sum of
    its medians. Returns a choice in :func:`fastattn.fast.choose_fast`'s shape, ``length_class="graph"``."""
    from .devices import dtype_name
    device = torch.device(device)
    positions = list(positions or [capacity // 4 - 1, capacity // 2 - 1, capacity - 1])
    rows = [check_form(n, device, dtype, hq=hq, hkv=hkv, head_dim=head_dim, capacity=capacity, bucket=bucket,
                       steps=steps, backend=backend, seed=seed) for n in FORMS]
    ok = [r["form"] for r in rows if r["available"] and r["accepted"] and r["within_bound"]]
    medians = _time_forms(ok, device, dtype, hq, hkv, head_dim, capacity, bucket, positions, repeats, backend,
                          seed) if ok else {}
    for r in rows:
        r.update(candidate=r["form"], median_ms=sum(medians[p][r["form"]] for p in positions)
                 if r["form"] in ok else None,
                 per_position_ms={p: medians[p][r["form"]] for p in positions} if r["form"] in ok else None)
    timed = [r for r in rows if r["median_ms"] is not None]
    winner = min(timed, key=lambda r: r["median_ms"])["form"] if timed else None
    return {"device": str(device), "dtype": dtype_name(dtype), "hq": hq, "hkv": hkv, "head_dim": head_dim,
            "lq_class": "lq=1", "length_class": "graph", "capacity": capacity, "bucket": bucket,
            "probe_lengths": positions, "reference_max_err": max((r["reference_err"] or 0) for r in rows),
            "candidates": rows, "winner": winner,
            "note": "graph class: static-shape forms for compiled / CUDA-graph decodes, compiled with "
                    f"fullgraph=True ({backend}); within twice upstream's error vs float64"}
