"""Softmax attention with a boolean mask. On CUDA, SDPA dispatches to flash / memory-efficient kernels itself."""

import torch
import torch.nn.functional as F

_SDPA_HAS_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


def attention(q, k, v, mask: torch.Tensor | None, scale: float, is_causal: bool = False) -> torch.Tensor:
    """q [B, H, T, d], k/v [B, Hkv, S, d], mask bool broadcastable to [B, H, T, S] (True = attend)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not _SDPA_HAS_GQA:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    kwargs = {"enable_gqa": True} if groups > 1 and _SDPA_HAS_GQA else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, **kwargs)
