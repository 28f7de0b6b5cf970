"""Structured masks: :class:`MaskInfo` lets :func:`attention` skip unseen keys and drop needless masks.

True = attend. Causal and window are bottom-right aligned: query ``i`` is the token at ``i + Lk - Lq``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .exactness import CPU_FLASH_KEY_BLOCK

#: Set to 1 to verify every ``attention(..., mask=..., mask_info=...)`` call (as ``check=True``).
CHECK_ENV = "FASTATTN_CHECK_MASKS"

# slice boundaries are rounded out to the CPU flash kernel's key block (see _kept_range): a cut at a multiple
# of it hands the kernel the same blocks as the dense call, so a right-padded cut keeps the dense call's bits
_ALIGN = CPU_FLASH_KEY_BLOCK


@dataclass(frozen=True)
class MaskInfo:
    """The structure of a bool mask, the AND of the stated constraints: ``keys`` bool (B, Lk), True = real (None: all);
    ``causal``: query i sees key j iff ``j <= i + Lk - Lq``; ``window`` w: only the w most recent keys; ``padding``
    ``"right"`` / ``"left"``: each row's real keys are one run from key 0 / ending at key Lk-1. Bad fields raise."""

    keys: Optional[torch.Tensor] = None
    causal: bool = False
    window: Optional[int] = None
    padding: Optional[str] = None

    def __post_init__(self):
        k = self.keys
        if k is not None and (not isinstance(k, torch.Tensor) or k.dtype != torch.bool or k.dim() != 2):
            got = f"{k.dtype} {tuple(k.shape)}" if isinstance(k, torch.Tensor) else type(k).__name__
            raise TypeError(f"keys must be a bool tensor of shape (B, Lk), got {got}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {type(self.causal).__name__}")
        w = self.window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"window must be a positive int or None, got {self.window!r}")
        if self.padding not in (None, "left", "right"):
            raise ValueError(f"padding must be 'left', 'right' or None, got {self.padding!r}")
        if self.padding is not None and self.keys is None:
            raise ValueError("padding needs keys= (which keys are real)")

    # ------------------------------------------------------------------ dense form
    def dense(self, Lq: int, Lk: int, device=None) -> torch.Tensor:
        """The bool mask this structure stands for: (B, 1, Lq, Lk), or (1, 1, Lq, Lk) without keys."""
        if self.keys is not None:
            if self.keys.shape[1] != Lk:
                raise ValueError(f"keys has {self.keys.shape[1]} columns but Lk is {Lk}")
            device = self.keys.device
        rows = torch.arange(Lq, device=device).view(-1, 1) + (Lk - Lq)  # absolute position of each query
        cols = torch.arange(Lk, device=device).view(1, -1)
        m = torch.ones(Lq, Lk, dtype=torch.bool, device=device)
        if self.causal:
            m &= cols <= rows
        if self.window is not None:
            m &= cols > rows - self.window
        m = m.view(1, 1, Lq, Lk)
        if self.keys is not None:
            m = m & self.keys.view(self.keys.shape[0], 1, 1, Lk)
        return m

    def describes(self, mask: torch.Tensor) -> bool:
        """True iff the bool ``mask``, broadcast to the dense shape, equals :meth:`dense`."""
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"describes() compares bool masks; got {mask.dtype} "
                            "(an additive float mask has no structure to check)")
        if mask.dim() < 2:
            return False
        Lq, Lk = mask.shape[-2], mask.shape[-1]
        if self.keys is not None and self.keys.shape[1] != Lk:
            return False
        ref = self.dense(Lq, Lk, device=mask.device)
        try:
            shape = torch.broadcast_shapes(mask.shape, ref.shape)
        except RuntimeError:
            return False
        return bool(torch.equal(mask.expand(shape), ref.expand(shape)))

    def check_padding(self) -> None:
        """Raise ValueError if ``padding`` is claimed but some row's real keys are not one run at that side."""
        if self.padding is None:
            return
        n = self.keys.sum(dim=1, keepdim=True)
        cols = torch.arange(self.keys.shape[1], device=self.keys.device).view(1, -1)
        want = cols < n if self.padding == "right" else cols >= self.keys.shape[1] - n
        if not torch.equal(want, self.keys):
            raise ValueError(f"padding={self.padding!r} claimed, but keys are not {self.padding}-padded in every row")


# ---------------------------------------------------------------------- attention
def attention(q, k, v, *, mask=None, mask_info: Optional[MaskInfo] = None, scale=None, enable_gqa=False, check=False):
    """SDPA with the dense mask's semantics along the cheapest path: q (B, Hq, Lq, D), k, v (B, Hkv, Lk, D), ``mask``
    bool broadcastable to (B, Hq, Lq, Lk), ``mask_info`` describing or standing for it (``check``: verify it). Unseen
    keys are cut in 512-key blocks (right-padded: the dense bits on CPU); fully masked rows are zeros, not NaN. Host
    reads: not for CUDA graphs."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, H, L, D), got {getattr(t, 'shape', type(t).__name__)}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = getattr(mask, "dtype", type(mask).__name__)
            raise TypeError(f"mask must be a bool tensor (True = attend), got {got}")
        dense = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        try:  # what SDPA accepts: broadcastable to (B, Hq, Lq, Lk), never truncated or stretched along keys
            ok = torch.broadcast_shapes(tuple(mask.shape), dense) == dense and mask.shape[-1] == k.shape[2]
        except RuntimeError:
            ok = False
        if not ok or mask.dim() > 4:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to (B, Hq, Lq, Lk) = {dense}")
    if mask_info is not None and not isinstance(mask_info, MaskInfo):
        raise TypeError(f"mask_info must be a MaskInfo, got {type(mask_info).__name__}")
    Lq, Lk = q.shape[2], k.shape[2]
    if mask_info is not None and (check or os.environ.get(CHECK_ENV) == "1"):
        mask_info.check_padding()
        if mask is not None and not mask_info.describes(mask):
            raise ValueError("mask_info does not describe mask: its dense form differs (check=True)")
    if mask is None and mask_info is not None:
        mask = mask_info.dense(Lq, Lk, device=q.device)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)

    lo, hi = (0, Lk) if mask_info is None else _kept_range(mask_info, Lq, Lk)
    sub = mask[..., lo:hi]
    ks, vs = k[:, :, lo:hi], v[:, :, lo:hi]
    visible_any = sub.any(dim=-1, keepdim=True)  # (.., Lq, 1)
    if bool(sub.all()):
        out = F.scaled_dot_product_attention(q, ks, vs, scale=scale, enable_gqa=enable_gqa)
    else:
        out = F.scaled_dot_product_attention(q, ks, vs, attn_mask=sub, scale=scale, enable_gqa=enable_gqa)
    return torch.where(visible_any, out, torch.zeros((), dtype=out.dtype, device=out.device))


def _kept_range(info: MaskInfo, Lq: int, Lk: int) -> tuple[int, int]:
    """[lo, hi): the keys some query can see, rounded out to multiples of ``_ALIGN`` (one host read for padding)."""
    lo, hi = 0, Lk
    if info.window is not None:
        lo = max(lo, Lk - Lq - info.window + 1)  # first key the first query can see
    if info.padding == "right":
        hi = min(hi, int(info.keys.sum(dim=1).max().item()))
    elif info.padding == "left":
        lo = max(lo, Lk - int(info.keys.sum(dim=1).max().item()))
    lo = (lo // _ALIGN) * _ALIGN
    hi = min(Lk, -(-hi // _ALIGN) * _ALIGN)
    if hi <= lo:  # nothing visible at all: keep one aligned block so SDPA has keys; rows come out zero
        lo, hi = 0, min(Lk, _ALIGN)
    return lo, hi
