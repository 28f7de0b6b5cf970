"""Inside one streaming AudioVAE decode, each weight-normed conv computes ``g * v / ||v||`` once, not once a chunk:
its pre-hook reuses the weight while ``g`` and ``v`` are the same tensors at the same version (same inputs, same
bits), and recomputes as upstream does when either changed or autograd records. Leaving the stream restores them."""

from __future__ import annotations

import torch
from torch.nn.utils.weight_norm import WeightNorm


class WeightOnce:
    """A ``WeightNorm`` pre-hook that recomputes only when ``g`` or ``v`` changed (or autograd needs a new graph)."""

    def __init__(self, hook: WeightNorm):
        self.hook, self.key = hook, None

    def __call__(self, module, inputs):
        g, v = getattr(module, self.hook.name + "_g"), getattr(module, self.hook.name + "_v")
        fresh = g.is_inference() or v.is_inference() or (  # inference tensors keep no version counter
            torch.is_grad_enabled() and (g.requires_grad or v.requires_grad))
        key = None if fresh else (id(g), id(v), g.data_ptr(), v.data_ptr(), g._version, v._version)
        if key is None or key != self.key:
            self.hook(module, inputs)
        self.key = key


def swap_hooks(root, wrap: bool) -> None:
    """Wrap every ``WeightNorm`` pre-hook under ``root`` in :class:`WeightOnce` (``wrap``), or unwrap them."""
    for m in root.modules():
        for k, h in m._forward_pre_hooks.items():
            if isinstance(h, WeightNorm if wrap else WeightOnce):
                m._forward_pre_hooks[k] = WeightOnce(h) if wrap else h.hook


def stream_enter(self):
    """``StreamingVAEDecoder.__enter__``: upstream's, then the hooks wrapped."""
    self._states.clear()
    self._install()
    swap_hooks(self._vae.decoder, True)
    return self


def stream_exit(self, *exc):
    """``StreamingVAEDecoder.__exit__``: the hooks restored, then upstream's."""
    swap_hooks(self._vae.decoder, False)
    self._restore()
    self._states.clear()
