"""Which SDPA kernel runs for a call, and why (:func:`explain_sdpa`, :func:`backend_matrix`); state is restored."""

from __future__ import annotations

import re
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from functools import partial
from html import escape
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .core import f64_attention
from .devices import dtype_name, dtype_of, quiet_native_stderr, resolve_device
from .exactness import exact_window

#: aten ops that are attention kernels, by backend.
KERNEL_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "FLASH_ATTENTION (CPU)",
    "aten::_scaled_dot_product_flash_attention": "FLASH_ATTENTION",
    "aten::_scaled_dot_product_efficient_attention": "EFFICIENT_ATTENTION",
    "aten::_scaled_dot_product_cudnn_attention": "CUDNN_ATTENTION",
    "aten::_scaled_dot_product_attention_math": "MATH",
    "aten::_scaled_dot_product_fused_attention_overrideable": "OVERRIDEABLE",
}
_HELPER_OPS = ("aten::where", "aten::repeat_interleave", "aten::masked_fill", "aten::logical_not",
               "aten::_safe_softmax", "aten::softmax", "aten::_softmax", "aten::bmm", "aten::matmul", "aten::expand")


@dataclass
class SDPAReport:
    """One call: the dispatcher's ``backend``, aten ``ops`` run, per backend ``eligibility`` and ``forced``."""

    call: dict
    backend: str
    ops: list
    eligibility: dict
    forced: dict
    notes: list = field(default_factory=list)

    @property
    def kernel(self) -> Optional[str]:
        return next((op for op in self.ops if op in KERNEL_OPS), None)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SDPAReport:
        return cls(**{k: d[k] for k in ("call", "backend", "ops", "eligibility", "forced")}, notes=d.get("notes", []))

    def _rows(self):
        for b in self.eligibility:
            e, f = self.eligibility[b], self.forced.get(b, {})
            yield (b, "yes" if e["eligible"] else "no", e.get("reason") or "",
                   f"ran: {f.get('kernel')}" if f.get("ran") else f"error: {f.get('error', '')}")

    def _call_line(self) -> str:
        c = self.call
        return (f"q{tuple(c['q'])} k{tuple(c['k'])} {c['dtype']} on {c['device']}, mask={c['mask']}, "
                f"is_causal={c['is_causal']}, enable_gqa={c['enable_gqa']}")

    def __str__(self) -> str:
        head = (f"SDPA call: {self._call_line()}\n"
                f"  dispatcher picks: {self.backend}\n  ops that ran: {', '.join(self.ops) or '-'}\n")
        body = "\n".join(f"  {b:<20} eligible={e:<3} {r[:90]:<90} forced -> {f[:120]}" for b, e, r, f in self._rows())
        return head + body + ("".join(f"\n  note: {n}" for n in self.notes))

    def _repr_html_(self) -> str:
        cols = ("backend", "eligible", "torch's reason", "forced")
        cell = lambda tag, vals: "".join(f"<{tag}>{escape(str(v))}</{tag}>" for v in vals)  # noqa: E731
        table = f"<table><tr>{cell('th', cols)}</tr>" + "".join(f"<tr>{cell('td', r)}</tr>" for r in self._rows()) \
            + "</table>"
        notes = "".join(f"<li>{escape(n)}</li>" for n in self.notes)
        return (f"<div><b>SDPA call</b> {escape(self._call_line())}<br>"
                f"<b>dispatcher picks:</b> {escape(self.backend)}<br>"
                f"<b>ops that ran:</b> <code>{escape(', '.join(self.ops))}</code>{table}"
                f"{'<ul>' + notes + '</ul>' if notes else ''}</div>")


# --------------------------------------------------------------------------- pieces
def _check(q, k, v, attn_mask):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    devs = {t.device for t in (q, k, v, attn_mask) if t is not None}
    if len(devs) != 1:
        raise ValueError(f"q, k, v and attn_mask must be on one device, got {sorted(map(str, devs))}")


def _mask_kind(m) -> str:
    return "none" if m is None else f"{dtype_name(m.dtype)} {tuple(m.shape)}"


def _choice(q, k, v, attn_mask, is_causal, scale, enable_gqa) -> str:
    try:
        idx = torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
        return SDPBackend(idx).name
    except Exception as exc:  # older torch without enable_gqa / scale keywords
        return f"unknown ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"


def native_warnings(text: str) -> list[str]:
    """The messages of c10's ``[W... file:line] Warning: <msg> (function <name>)`` lines (C++ ``TORCH_WARN``)."""
    msgs = (re.sub(r"\s*\(function [^)]*\)\s*$", "", line.partition("Warning: ")[2]).strip()
            for line in text.splitlines() if "Warning: " in line)
    return [m for m in msgs if m]


def call_capturing_native_stderr(fn) -> tuple:
    """``(fn(), text fn wrote to fd 2)``: C++ code writes there directly, Python's ``warnings`` never sees it."""
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        with quiet_native_stderr(tmp):
            result = fn()
        tmp.seek(0)
        return result, tmp.read().decode(errors="replace")


def _eligibility_cuda(q, k, v, attn_mask, is_causal, enable_gqa) -> dict:
    """torch's ``can_use_*(params, debug=True)`` per CUDA backend; its reasons go to C++ stderr, so fd 2 is read too."""
    cb = torch.backends.cuda
    params = cb.SDPAParams(q, k, v, attn_mask, 0.0, is_causal, enable_gqa)
    out = {}
    for name, fn in (("FLASH_ATTENTION", cb.can_use_flash_attention),
                     ("EFFICIENT_ATTENTION", cb.can_use_efficient_attention),
                     ("CUDNN_ATTENTION", cb.can_use_cudnn_attention)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok, text = call_capturing_native_stderr(lambda fn=fn: bool(fn(params, True)))
        reasons = [str(w.message).strip() for w in caught] + native_warnings(text)
        out[name] = {"eligible": ok, "reason": " | ".join(dict.fromkeys(reasons))}
    out["MATH"] = {"eligible": True, "reason": ""}
    return out


def _run_profiled(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    with quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return list(dict.fromkeys(ev.name for ev in prof.events() if ev.name in KERNEL_OPS or ev.name in _HELPER_OPS))


def _forced(backend: str, call) -> dict:
    """Run ``call`` with only ``backend`` enabled: the kernel op that ran, or the error and SDPA's warned reasons."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                ops = _run_profiled(call)
            return {"ran": True, "kernel": next((o for o in ops if o in KERNEL_OPS), None), "ops": ops}
        except Exception as exc:
            why = [" ".join(str(w.message).split())[:300] for w in caught]
            return {"ran": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}",
                    "reasons": list(dict.fromkeys(why))}


# --------------------------------------------------------------------------- public
def explain_sdpa(q, k, v, *, attn_mask=None, is_causal=False, enable_gqa=False, scale=None) -> SDPAReport:
    """Which SDPA backend and aten ops run for this exact call; TypeError/ValueError for bad or mixed-device inputs."""
    _check(q, k, v, attn_mask)

    call = partial(F.scaled_dot_product_attention, q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                   enable_gqa=enable_gqa)
    backends = (["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"] if q.device.type == "cuda"
                else ["FLASH_ATTENTION", "MATH"])
    forced = {b: _forced(b, call) for b in backends}
    if q.device.type == "cuda":
        eligibility = _eligibility_cuda(q, k, v, attn_mask, is_causal, enable_gqa)
        for b, e in eligibility.items():  # where the binding's stderr said nothing, the forced call's reasons
            if not e["eligible"] and not e["reason"] and forced.get(b, {}).get("reasons"):
                e["reason"] = " | ".join(forced[b]["reasons"])
    else:  # no public CPU check: forcing is the check, its error (and reasons) torch's reason
        eligibility = {b: {"eligible": forced[b]["ran"],
                           "reason": " | ".join([*forced[b].get("reasons", []), forced[b].get("error", "")][:4])
                           if not forced[b]["ran"] else ""} for b in backends}
    report = SDPAReport(
        call={"q": list(q.shape), "k": list(k.shape), "v": list(v.shape), "dtype": dtype_name(q.dtype),
              "device": str(q.device), "mask": _mask_kind(attn_mask), "is_causal": is_causal,
              "enable_gqa": enable_gqa, "scale": scale, "torch": torch.__version__},
        backend=_choice(q, k, v, attn_mask, is_causal, scale, enable_gqa),
        ops=_run_profiled(call), eligibility=eligibility, forced=forced)
    bool_mask = attn_mask is not None and attn_mask.dtype == torch.bool
    if bool_mask and report.kernel == "aten::_scaled_dot_product_cudnn_attention":  # first: its conversion also
        report.notes.append("cuDNN converts the bool mask itself (convert_boolean_attn_mask_cudnn) on every call")
    elif bool_mask and "aten::where" in report.ops:  # shows an aten::where
        report.notes.append("the bool mask is converted to an additive -inf mask (aten::where) on every call")
    if report.kernel and attn_mask is not None:
        report.notes.append(f"the chosen kernel reads all {k.shape[2]} keys; masked keys still cost time")
    return report


def decode_inputs(device, dtype, *, capacity: int = 8192, hq: int = 16, hkv: int = 2, head_dim: int = 128,
                  seed: int = 0) -> tuple:
    """:func:`backend_matrix`'s seeded decode call: ``q`` (1, Hq, 1, D), ``k``, ``v`` (1, Hkv, capacity, D)."""
    g = torch.Generator().manual_seed(seed)
    k, v, q = (torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
               for shape in ((1, hkv, capacity, head_dim), (1, hkv, capacity, head_dim), (1, hq, 1, head_dim)))
    return q, k, v


#: the largest error against float64 a decode call may make in each dtype and still be ``correct``
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def backend_matrix(device="cpu", dtype=None, *, capacity: int = 8192, position: int = 256, hq: int = 16,
                   hkv: int = 2, head_dim: int = 128, unsupported_head_dim: int = 512, seed: int = 0) -> list[dict]:
    """Rows of :func:`explain_sdpa` over VoxCPM2's decode cases at ``position`` per dtype, with ``correct``."""
    device = resolve_device(device)
    if not 0 <= position < capacity:
        raise ValueError(f"position must be in [0, capacity={capacity}), got {position}")
    # an asked-for dtype must run (a clear error otherwise); by default those of fp32/bf16/fp16 that run here
    dtypes = [dtype_of(dtype)] if dtype is not None else [torch.float32, torch.bfloat16, torch.float16]
    rows = []

    def run(case, k, v, mask=None, is_causal=False, enable_gqa=True):  # the loop's dt, D, q, ref and tag
        rep = explain_sdpa(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=enable_gqa)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=enable_gqa)
        err = (out.double().cpu() - ref).abs().max().item()
        rows.append({
            "case": case + tag, "dtype": dtype_name(dt), "head_dim": D, "keys": k.shape[2],
            "mask": rep.call["mask"], "enable_gqa": enable_gqa, "is_causal": is_causal,
            "backend": rep.backend, "kernel": rep.kernel, "helpers": [o for o in rep.ops if o not in KERNEL_OPS],
            "eligible": [b for b, e in rep.eligibility.items() if e["eligible"]],
            "forced": {b: (f["kernel"] if f["ran"] else "error") for b, f in rep.forced.items()},
            "max_abs_err": err, "correct": err <= TOLERANCE[dt], "report": rep.to_dict(),
        })

    for dt in dtypes:
        for D in (head_dim, unsupported_head_dim):
            try:
                q, k, v = decode_inputs(device, dt, capacity=capacity, hq=hq, hkv=hkv, head_dim=D, seed=seed)
                F.scaled_dot_product_attention(q, k[:, :, :4], v[:, :, :4], enable_gqa=True)
            except Exception as exc:  # this device has no kernel for this dtype
                if dtype is not None and D == head_dim:
                    raise ValueError(f"dtype={dtype_name(dt)}: SDPA cannot run it on {device} "
                                     f"({type(exc).__name__}: {str(exc)[:120]})") from None
                continue
            n = position + 1
            bool_mask = (torch.arange(capacity, device=device) <= position).view(1, 1, 1, -1)
            ref = f64_attention(q.cpu(), k.cpu(), v.cpu(), n)
            tag = "" if D == head_dim else f" (head_dim {D})"
            run("upstream: bool mask over full cache + GQA", k, v, bool_mask)
            run("fast: slice to length, no mask", k[:, :, :n], v[:, :, :n])
            if D != head_dim:  # the unsupported head_dim: only the two calls the fix compares
                continue
            add = torch.zeros(bool_mask.shape, device=device, dtype=dt).masked_fill(~bool_mask, float("-inf"))
            run("float additive mask over full cache + GQA", k, v, add)
            gq = hq // hkv
            run("bool mask, no enable_gqa (K/V repeated)", k.repeat_interleave(gq, 1), v.repeat_interleave(gq, 1),
                bool_mask, enable_gqa=False)
            w = exact_window(q, k, n, None)  # the default exact's window here (calibrated; the capacity if none)
            run(f"exact: window {w} keys, mask sliced", k[:, :, :w], v[:, :, :w], bool_mask[..., :w])
            run("is_causal=True with Lq=1 (top-left aligned)", k[:, :, :n], v[:, :, :n], is_causal=True)
    return rows
