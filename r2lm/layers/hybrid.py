"""Block-hybrid attention (LLaDA-Hybrid, after LoLCATs; docs/design.md 1.2).

Queries attend exactly (softmax) to the keys of their own chunk, and through linear attention to every clean
key of earlier chunks, with one shared normaliser:

    phi(x) = [softmax(x W_h), softmax(-x W_h)]                      Hedgehog feature map, W_h [head_dim, F] per head
    out    = (w * sm_num + phi(q) S) / (w * sm_den + phi(q) Z),      w = sigmoid(alpha_h), alpha_h = 0 at init
    S = sum phi(k)^T v,  Z = sum phi(k)   over the earlier clean keys

Queries and keys share W_h (LLaDA-Hybrid), or, with `hybrid_tie_feature_maps=False`, keys have their own
(LoLCATs): key_hedgehog_weights, applied per query head after the GQA repeat like the query map.

sm_num / sm_den are the softmax numerator and denominator over the own chunk, shifted by its row maximum. With
no earlier keys the layer is exactly in-chunk softmax attention.

Three forms, equal up to summation order:
- chunked (training, full recompute; `HybridParts`): the in-chunk softmax over the non-empty tiles of the layout's
  "own" predicate, and the linear part through block-exclusive prefix sums over chunks of phi(K)^T V and sum phi(K).
  Time and memory grow linearly with the length (O(T F d), never T x T);
- dense (the reference, and what forwards over a cache use on their few columns): [T, T] score and kernel
  matrices masked to the layout's own and earlier parts;
- recurrent (decoding): fp32 (S, Z) per layer and row in the cache; a commit folds its clean keys in after
  reading. Its memory does not grow with the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init

from r2lm.ops.flex import Tiles, block_sparse, tile_softmax


@dataclass(eq=False)
class ChunkGroups:
    """The columns of a layout grouped by chunk, for the linear part of block-hybrid attention.

    A query reads linearly the clean real keys of strictly earlier chunks, so what it reads depends on its chunk
    alone: the state of chunk c is the exclusive prefix sum, over chunks before c, of each chunk's phi(K)^T V.
    Slots c * G .. c * G + G - 1 hold chunk c's columns (chunks ranked by index; G the widest chunk of a row)."""

    columns: torch.Tensor  # long [R, C * G]: the column in each slot (0 in an empty slot)
    keys: torch.Tensor  # bool [R, C * G]: the slot holds a clean real key (not a window, padding or empty slot)
    slot: torch.Tensor  # long [R, T]: each column's slot
    chunks: int  # C

    @classmethod
    def of(cls, layout) -> ChunkGroups:
        if layout.branches is not None:  # a chunk's state would fold a branch's keys in for every later chunk
            raise ValueError("block-hybrid layers read earlier chunks as one folded state: a layout with branches "
                             "(verification's siblings) needs softmax layers")
        rows, length = layout.rows, layout.length
        device = layout.chunks.device
        _, rank = torch.unique(layout.chunks.expand(rows, length), sorted=True, return_inverse=True)  # [R, T]
        chunks = int(rank.max()) + 1
        count = torch.zeros(rows, chunks, dtype=torch.long, device=device).scatter_add_(1, rank, torch.ones_like(rank))
        width = int(count.max())
        order = torch.argsort(rank * length + torch.arange(length, device=device), dim=1)  # by chunk, then column
        ranked = rank.gather(1, order)
        start = torch.cumsum(count, 1) - count
        slot_of_sorted = ranked * width + torch.arange(length, device=device) - start.gather(1, ranked)
        columns = torch.zeros(rows, chunks * width, dtype=torch.long, device=device).scatter_(1, slot_of_sorted, order)
        slot = torch.empty_like(rank).scatter_(1, order, slot_of_sorted)
        filled = torch.zeros(rows, chunks * width, dtype=torch.bool, device=device).scatter_(
            1, slot_of_sorted, torch.ones_like(order, dtype=torch.bool))
        clean = (~layout.noisy).expand(rows, length) & layout.valid_mask(rows)
        return cls(columns, filled & clean.gather(1, columns), slot, chunks)


@dataclass(eq=False)
class HybridParts:
    """What the chunked form needs from a layout: the tiles of the own-chunk predicate and the chunk groups."""

    own: Tiles
    groups: ChunkGroups

    @classmethod
    def of(cls, layout, kind: str, block_size: int) -> HybridParts:
        return cls(block_sparse(layout, kind, "own", tile=own_tile(block_size)).tiles, ChunkGroups.of(layout))


def own_tile(block_size: int) -> int:
    """Tile side for the own-chunk softmax: about one chunk (a power of two in [16, 128]), so few pairs are wasted."""
    return min(128, max(16, 1 << (block_size - 1).bit_length()))


def _exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """out[c] = x[0] + ... + x[c-1] along dim (summed forward, no subtraction)."""
    shifted = torch.cat([torch.zeros_like(x.narrow(dim, 0, 1)), x.narrow(dim, 0, x.shape[dim] - 1)], dim)
    return shifted.cumsum(dim)


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

    def forward(self, q, k, v, scale, parts, valid=None, state=None, fold: int = 0):
        """q [B, H, T, d]; k, v [B, Hkv, T, d]; parts: `HybridParts` of a full layout (the chunked form), or the dense
        (own, earlier) bool masks [B or 1, 1, T, T]; valid [B, T] or None; state: (S [B, H, 2F, d], Z [B, H, 2F])
        of earlier committed chunks, or None (dense form only).

        Returns out [B, H, T, d] and, with `fold` = n > 0, (dS, dZ) of the real keys among the first n columns (the
        part of the input being committed) to add to the state; else None."""
        if isinstance(parts, HybridParts):
            if state is not None or fold:
                raise ValueError("the chunked form runs over a full layout, without a cache state")
            return self.chunked(q, k, v, scale, parts), None
        return self.dense(q, k, v, *parts, scale, valid, state, fold)

    def _inputs(self, q, k, v):
        """Keys and values per query head in fp32, the feature maps phi(q), phi(k) and the gate w [1, H, 1, 1]."""
        groups = self.num_heads // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1).float(), v.repeat_interleave(groups, dim=1).float()
        key_weights = self.hedgehog_weights if self.key_hedgehog_weights is None else self.key_hedgehog_weights
        fq, fk = self.features(q, self.hedgehog_weights), self.features(k, key_weights)
        return k, v, fq, fk, torch.sigmoid(self.alpha.float())[None, :, None, None]

    def chunked(self, q, k, v, scale, parts: HybridParts):
        """The same function as `dense` over a full layout, in time and memory linear in T."""
        num, den = tile_softmax(q, k, v, parts.own, scale)  # own chunk, shifted by its row maximum
        k, v, fq, fk, w = self._inputs(q, k, v)
        groups = parts.groups
        batch, heads, length, features = fq.shape

        def grouped(x):  # [B, H, T, n] -> [B, H, C, G, n]: the columns of each chunk
            index = groups.columns.expand(batch, -1)[:, None, :, None].expand(-1, heads, -1, x.shape[-1])
            return x.gather(2, index).view(batch, heads, groups.chunks, -1, x.shape[-1])

        def ungrouped(x):  # [B, H, C, G, n] -> [B, H, T, n]
            x = x.flatten(2, 3)
            return x.gather(2, groups.slot.expand(batch, -1)[:, None, :, None].expand(-1, heads, -1, x.shape[-1]))

        keys = groups.keys.expand(batch, -1).view(batch, 1, groups.chunks, -1, 1)
        fk_chunk = grouped(fk) * keys
        S = _exclusive_cumsum(fk_chunk.transpose(-1, -2) @ grouped(v), 2)  # [B, H, C, 2F, d]: chunks before c
        Z = _exclusive_cumsum(fk_chunk.sum(3), 2)  # [B, H, C, 2F]
        fq_chunk = grouped(fq)
        linear_num, linear_den = ungrouped(fq_chunk @ S), ungrouped(fq_chunk @ Z[..., None])
        num, den = w * num + linear_num, w * den[..., None] + linear_den
        return (num / den.clamp_min(self.eps)).to(q.dtype)

    def dense(self, q, k, v, own, earlier, scale, valid=None, state=None, fold: int = 0):
        """The reference form over [T, T] masks own / earlier (bool [B or 1, 1, T, T]); see `forward`."""
        k, v, fq, fk, w = self._inputs(q, k, v)
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
