"""Shared test tools: random caches, kernels injected in place of SDPA, the patch-leak guard."""

import pytest
import torch
import torch.nn.functional as F


def rand_cache(B, hq, hkv, cap, D, dtype, seed=0, lq=1):
    """Random (q, k_cache, v_cache): q (B, hq, lq, D), caches (B, hkv, cap, D), never zeros."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, hkv, cap, D, generator=g).to(dtype)
    v = torch.randn(B, hkv, cap, D, generator=g).to(dtype)
    q = torch.randn(B, hq, lq, D, generator=g).to(dtype)
    return q, k, v


@pytest.fixture(autouse=True)
def no_patch_leaks():
    """Fail a test that leaves voxcpm patched (and undo it for the next one). Import it where needed."""
    yield
    from fastattn import patch as patch_mod
    if patch_mod._STATE is not None:
        patch_mod._STATE.undo()
        pytest.fail("a test left voxcpm patched")


def order_sensitive(exact_multiple=None, capacity=None):
    """An SDPA whose rounding depends on the key count, like a kernel that reduces in other blocks.

    A key count that is a multiple of ``exact_multiple`` (or equals ``capacity``) rounds like the full
    cache; any other key count comes out one ulp off. ``exact_multiple=None``: only ``capacity`` is exact.
    """
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        out = real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                   enable_gqa=enable_gqa)
        n = k.shape[-2]
        exact = n == capacity or (exact_multiple is not None and n % exact_multiple == 0)
        return out if exact else torch.nextafter(out, torch.full_like(out, float("inf")))

    return sdpa
