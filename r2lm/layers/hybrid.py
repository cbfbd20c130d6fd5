"""Block-hybrid attention (LLaDA-Hybrid, after LoLCATs; DESIGN 1.2).

Queries attend exactly (softmax) to the keys of their own chunk, and through linear attention to every clean
key of earlier chunks, with one shared normaliser:

    phi(x) = [softmax(x W_h), softmax(-x W_h)]                      Hedgehog feature map, W_h [head_dim, F] per head
    out    = (w * sm_num + phi(q) S) / (w * sm_den + phi(q) Z),      w = sigmoid(alpha_h), alpha_h = 0 at init
    S = sum phi(k)^T v,  Z = sum phi(k)   over the earlier clean keys

Queries and keys share W_h (LLaDA-Hybrid), or, with `hybrid_tie_feature_maps=False`, keys have their own
(LoLCATs): key_hedgehog_weights, applied per query head after the GQA repeat like the query map.

sm_num / sm_den are the softmax numerator and denominator over the own chunk, shifted by its row maximum. With
no earlier keys the layer is exactly in-chunk softmax attention.

Two forms of the linear part, equal up to summation order:
- parallel (training, recompute): the kernel matrix phi(q) phi(k)^T masked to the layout's earlier-clean part;
- recurrent (decoding): fp32 (S, Z) per layer and row in the cache; a commit folds its clean keys in after
  reading. Its memory does not grow with the context.
"""

import torch
from torch import nn


class BlockHybridAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.feature_dim = config.hybrid_feature_dim
        self.hedgehog_weights = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.feature_dim))
        self.key_hedgehog_weights = (None if config.hybrid_tie_feature_maps else
                                     nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.feature_dim)))
        self.alpha = nn.Parameter(torch.zeros(self.num_heads))
        self.eps = 1e-6
        if self.alpha.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Identity on the first F dimensions plus small noise on the rest (so no dimension starts ignored)."""
        from transformers import initialization as init

        for param in (self.hedgehog_weights, self.key_hedgehog_weights):
            if param is not None:  # untied maps start equal but for their noise
                weights = torch.randn(self.num_heads, self.head_dim, self.feature_dim) * min(0.02, self.head_dim**-0.5)
                weights[:, : self.feature_dim] += torch.eye(self.feature_dim)
                init.copy_(param, weights)
        init.zeros_(self.alpha)

    @staticmethod
    def features(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, head_dim], weights [H, head_dim, F] -> phi(x) [B, H, T, 2F] in fp32."""
        proj = torch.einsum("bhtd,hdf->bhtf", x.float(), weights.float())
        return torch.cat([proj.softmax(-1), (-proj).softmax(-1)], dim=-1)

    def forward(self, q, k, v, own, earlier, scale, valid=None, state=None, fold: int = 0):
        """q [B, H, T, d]; k, v [B, Hkv, T, d]; own / earlier bool [B or 1, 1, T, T]; valid [B, T] or None;
        state: (S [B, H, 2F, d], Z [B, H, 2F]) of earlier committed chunks, or None.

        Returns out [B, H, T, d] and, with `fold` = n > 0, (dS, dZ) of the real keys among the first n columns (the
        part of the input being committed) to add to the state; else None."""
        groups = self.num_heads // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1).float(), v.repeat_interleave(groups, dim=1).float()
        key_weights = self.hedgehog_weights if self.key_hedgehog_weights is None else self.key_hedgehog_weights
        fq, fk = self.features(q, self.hedgehog_weights), self.features(k, key_weights)
        w = torch.sigmoid(self.alpha.float())[None, :, None, None]

        scores = (q.float() @ k.transpose(-1, -2) * scale).masked_fill(~own, float("-inf"))
        a = torch.exp(scores - scores.amax(-1, keepdim=True))
        num, den = w * (a @ v), w * a.sum(-1, keepdim=True)
        kernel = (fq @ fk.transpose(-1, -2)) * earlier
        num, den = num + kernel @ v, den + kernel.sum(-1, keepdim=True)
        if state is not None:
            S, Z = state
            num, den = num + fq @ S, den + fq @ Z[..., None]
        out = (num / den.clamp_min(self.eps)).to(q.dtype)
        if not fold:
            return out, None
        fk, v = fk[:, :, :fold], v[:, :, :fold]
        if valid is not None:
            keep = valid[:, None, :fold, None].float()
            fk, v = fk * keep, v * keep
        return out, (fk.transpose(-1, -2) @ v, fk.sum(-2))
