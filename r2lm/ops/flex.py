"""Block-sparse attention from a Layout's predicate (docs/design.md 6, invariant 9).

`block_sparse(layout, kind, part)` evaluates the layout's `mask_mod` once, a bounded batch of tiles at a time (never a
[T, T] mask), into the non-empty tiles of the [T, T] pairs:
- `.block_mask`: a flex_attention BlockMask (partial and full tiles, the predicate for the partial ones);
- `.tiles`: the same tiles as a flat list with the masks of the partial ones, for the tile-by-tile code here.
It is cached per layout, so every layer of one forward shares it.

`flex_attention(q, k, v, sparse, scale)`: softmax attention over it, skipping the empty tiles.
- CUDA: torch's compiled flex_attention on the BlockMask, forward and backward.
- CPU: torch 2.13 compiles flex_attention for CPU inference only (no backward, no logsumexp), and its CPU kernel was
  measured slower than SDPA's on the same tiles (docs/results.md, "Block-sparse attention on a CPU"). So CPU runs
  `packed_attention`: SDPA's fused kernels over each query tile's non-empty key tiles, forward and backward, no
  compilation.
  `torch_flex_attention` is torch's kernel on any device (on CPU without gradients); the tests check it there.

Checked against SDPA over the dense mask (tests/ops/test_flex.py):
- GQA: flex's `enable_gqa` lets query head h read key head h // (H / Hkv), as SDPA's `enable_gqa` does;
- empty rows: flex gives zeros (not NaN). The Layout leaves no row empty anyway (a padding query sees itself).

`tile_softmax(q, k, v, tiles, scale)` is the softmax numerator and denominator shifted by the row maximum, over the
tiles only: the in-chunk part of block-hybrid layers (differentiable; memory linear in the number of tiles).
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

TILE = 128  # flex_attention's sparse block size
_EVAL_ELEMENTS = 1 << 20  # predicate values evaluated at once while building (1 MiB per bool temporary)
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layout -> {(kind, part, tile): BlockSparse}


@dataclass(eq=False)
class Tiles:
    """The non-empty tiles of a [T, T] predicate, in (row, query tile, key tile) order."""

    size: int  # tile side
    length: int  # T
    rows: int  # batch rows they are listed for; 1 when every row has the same tiles
    row: torch.Tensor  # long [P]
    q_block: torch.Tensor  # long [P]
    kv_block: torch.Tensor  # long [P]
    partial: torch.Tensor  # long [P]: the tile's index into `masks`, -1 for a full tile (every pair visible)
    masks: torch.Tensor  # bool [P_partial, size, size]: the visible pairs of each partial tile

    @property
    def blocks(self) -> int:
        return math.ceil(self.length / self.size)

    def mask(self, tile: torch.Tensor | None = None) -> torch.Tensor:
        """bool [n, size, size]: the visible pairs of the given tiles (long [n]; default every tile)."""
        slot = self.partial if tile is None else self.partial[tile]
        out = torch.ones(len(slot), self.size, self.size, dtype=torch.bool, device=slot.device)
        part = slot >= 0
        out[part] = self.masks[slot[part]]
        return out

    @property
    def q_index(self) -> torch.Tensor:
        """Each tile's query block as an index into the [rows * blocks] tiles of `_blocks`."""
        return self.row * self.blocks + self.q_block

    @property
    def kv_index(self) -> torch.Tensor:
        return self.row * self.blocks + self.kv_block


@dataclass(eq=False)
class BlockSparse:
    """A layout's predicate compiled to tiles: the flex_attention BlockMask and the tile list."""

    mask_mod: object  # the predicate, f(b, h, q, kv) -> bool
    tiles: Tiles
    any_: torch.Tensor  # bool [rows, blocks, blocks]: the tile holds a visible pair
    all_: torch.Tensor  # bool [rows, blocks, blocks]: every pair of the tile is visible
    _additive: dict = field(default_factory=dict, repr=False)

    @cached_property
    def block_mask(self):
        from torch.nn.attention.flex_attention import BlockMask

        partial, full = self.any_ & ~self.all_, self.all_
        length = self.tiles.length

        def ordered(blocks):  # (count [rows, 1, nq] int32, indices [rows, 1, nq, nk] int32): listed tiles first
            order = torch.sort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).indices
            return blocks.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

        return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=self.tiles.size,
                                        mask_mod=self.mask_mod, seq_lengths=(length, length))

    @property
    def density(self) -> float:
        """Fraction of tiles that are not empty (what block sparsity computes, against 1 for a dense mask)."""
        return float(self.any_.float().mean())

    @cached_property
    def packed(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], torch.Tensor]:
        """The tiles grouped for `packed_attention`: for each number c of non-empty key tiles a query tile has,
        (query blocks [n], key blocks [n, c], mask bool [n, 1, size, c * size]) over the tiles of `_blocks`; and the
        order that puts the groups' query blocks, concatenated, back in place."""
        tiles = self.tiles
        q_index, kv_index = tiles.q_index, tiles.kv_index
        q_blocks, counts = torch.unique_consecutive(q_index, return_counts=True)
        first = torch.cumsum(counts, 0) - counts  # each query block's first tile (tiles are ordered by query block)
        groups = []
        for c in torch.unique(counts).tolist():
            members = counts == c
            tile = first[members][:, None] + torch.arange(c, device=first.device)  # [n, c]
            mask = tiles.mask(tile.flatten()).view(*tile.shape, tiles.size, tiles.size).transpose(1, 2).flatten(2)
            groups.append((q_blocks[members], kv_index[tile], mask[:, None]))
        return groups, torch.argsort(torch.cat([g[0] for g in groups]))

    def additive_masks(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The packed masks as 0 / -inf in `dtype`, made once per layout: SDPA turns a bool mask into one of these
        on every call and keeps it for the backward, so sharing one across the layers saves a copy per layer."""
        if dtype not in self._additive:
            self._additive[dtype] = [torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)
                                     for _, _, mask in self.packed[0]]
        return self._additive[dtype]


def block_sparse(layout, kind: str, part: str = "all", tile: int = TILE) -> BlockSparse:
    """The tiles of `layout.mask_mod(kind, part)`, built once per layout (the layers of one forward share them).

    The predicate is evaluated on every tile, or for the own part (outside bidirectional attention) only on the tiles
    whose query and key columns share a stream, and the diagonal ones: linear in the length, not quadratic."""
    per_layout = _CACHE.setdefault(layout, {})
    key = (kind, part, tile)
    if key not in per_layout:
        blocks = math.ceil(layout.length / tile)
        if part == "own" and kind != "bidirectional":
            candidates = _sharing_a_stream(layout.streams, tile, blocks)
        else:
            candidates = torch.ones(layout.rows, blocks, blocks, dtype=torch.bool, device=layout.chunks.device)
        per_layout[key] = _build(layout.mask_mod(kind, part, pad_to=tile), layout.length, tile, candidates)
    return per_layout[key]


def _sharing_a_stream(streams: torch.Tensor, tile: int, blocks: int) -> torch.Tensor:
    """bool [rows, blocks, blocks]: tile pairs whose query and key tiles hold columns of one stream, or the diagonal."""
    rows, length = streams.shape
    _, ids = torch.unique(streams, return_inverse=True)
    where = torch.zeros(rows, int(ids.max()) + 1, blocks, device=streams.device)  # stream s has columns in tile j
    row = torch.arange(rows, device=streams.device)[:, None].expand(-1, length)
    where[row, ids, (torch.arange(length, device=streams.device) // tile).expand(rows, -1)] = 1
    shared = (where.transpose(1, 2) @ where) > 0
    return shared | torch.eye(blocks, dtype=torch.bool, device=streams.device)


def _build(mask_mod, length: int, tile: int, candidates: torch.Tensor) -> BlockSparse:
    """Evaluate the predicate on the candidate tiles (bool [rows, blocks, blocks]; the others hold no visible pair),
    a bounded number at a time, and keep what the tiles need: which hold a visible pair, which are full, and the
    pairs of the partial ones."""
    rows, blocks, _ = candidates.shape
    device = candidates.device
    row, q_block, kv_block = torch.nonzero(candidates, as_tuple=True)
    offsets = torch.arange(tile, device=device)
    nonempty, full, masks = [], [], []
    per_batch = max(1, _EVAL_ELEMENTS // tile**2)
    for lo in range(0, len(row), per_batch):
        r, q, kv = row[lo : lo + per_batch], q_block[lo : lo + per_batch], kv_block[lo : lo + per_batch]
        seen = mask_mod(r[:, None, None], None, (q * tile)[:, None, None] + offsets[:, None],
                        (kv * tile)[:, None, None] + offsets).expand(len(r), tile, tile)
        nonempty.append(seen.flatten(1).any(1))
        full.append(seen.flatten(1).all(1))
        masks.append(seen[nonempty[-1] & ~full[-1]])
    nonempty, full = torch.cat(nonempty), torch.cat(full)
    any_ = torch.zeros_like(candidates).index_put_((row, q_block, kv_block), nonempty)
    all_ = torch.zeros_like(candidates).index_put_((row, q_block, kv_block), full)
    partial = torch.full((len(row),), -1, dtype=torch.long, device=device)
    is_partial = nonempty & ~full
    partial[is_partial] = torch.arange(int(is_partial.sum()), device=device)
    tiles = Tiles(tile, length, rows, row[nonempty], q_block[nonempty], kv_block[nonempty], partial[nonempty],
                  torch.cat(masks))
    return BlockSparse(mask_mod, tiles, any_, all_)


# ------------------------------------------------------------------------------------------------ attention


def flex_attention(q, k, v, sparse: BlockSparse, scale: float) -> torch.Tensor:
    """Softmax attention over the visible pairs of `sparse`: q [B, H, T, d], k/v [B, Hkv, T, d] -> [B, H, T, d].

    CUDA: torch's flex_attention kernel (forward and backward). CPU: `packed_attention`, SDPA over the same tiles."""
    if q.device.type == "cuda":
        return torch_flex_attention(q, k, v, sparse, scale)
    return packed_attention(q, k, v, sparse, scale)


def torch_flex_attention(q, k, v, sparse: BlockSparse, scale: float) -> torch.Tensor:
    """torch's compiled flex_attention on the BlockMask. On CPU, torch 2.13 compiles it for inference only."""
    if q.device.type == "cpu" and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("torch 2.13 has no flex_attention backward on CPU: use flex_attention (packed tiles)")
    return _compiled_flex(q.device.type)(q, k, v, block_mask=sparse.block_mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])


@functools.cache
def _compiled_flex(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention as flex

    # torch 2.13's CPU flex template does not build with dynamic shapes: compile each shape on its own there.
    return torch.compile(flex, dynamic=False if device_type == "cpu" else None)


def packed_attention(q, k, v, sparse: BlockSparse, scale: float) -> torch.Tensor:
    """Block-sparse attention through SDPA's fused kernels: each query tile attends to its non-empty key tiles only,
    packed side by side (query tiles with the same number of key tiles share one SDPA call). Differentiable.

    On CPU this beats torch's flex kernel (compiled for inference only in torch 2.13, and slower than SDPA on the
    same tiles), and needs no compilation."""
    tiles = sparse.tiles
    qb, kb, vb = (_blocks(t, tiles, t.dtype) for t in (q, k, v))
    groups, order = sparse.packed
    out = []
    for (q_blocks, kv_blocks, _), mask in zip(groups, sparse.additive_masks(qb.dtype), strict=True):
        n, c = kv_blocks.shape
        keys, values = (x[kv_blocks.flatten()].view(n, c, *x.shape[1:]).transpose(1, 2).flatten(2, 3) for x in (kb, vb))
        out.append(F.scaled_dot_product_attention(qb[q_blocks], keys, values, attn_mask=mask, scale=scale,
                                                  enable_gqa=qb.shape[1] != kb.shape[1]))
    return _unblock(torch.cat(out)[order], tiles, q.shape[0])


def _blocks(x: torch.Tensor, tiles: Tiles, dtype=torch.float32) -> torch.Tensor:
    """[B, h, T, d] -> [rows * blocks, (B / rows) * h, size, d], T zero-padded to whole tiles.

    With tiles shared by every row (rows = 1) the batch is folded into the heads, so one tile list serves the whole
    batch; query head i of a row still reads key head i // (H / Hkv) of the same row."""
    batch, heads, length, dim = x.shape
    if batch % tiles.rows:
        raise ValueError(f"tiles listed for {tiles.rows} rows do not fit a batch of {batch}")
    x = F.pad(x.to(dtype).reshape(tiles.rows, -1, length, dim), (0, 0, 0, tiles.blocks * tiles.size - length))
    return x.view(tiles.rows, x.shape[1], tiles.blocks, tiles.size, dim).transpose(1, 2).flatten(0, 1)


def _unblock(x: torch.Tensor, tiles: Tiles, batch: int) -> torch.Tensor:
    """Inverse of `_blocks`: [rows * blocks, (B / rows) * h, size, ...] -> [B, h, T, ...]."""
    x = x.view(tiles.rows, tiles.blocks, *x.shape[1:]).transpose(1, 2).flatten(2, 3)[:, :, : tiles.length]
    return x.reshape(batch, -1, *x.shape[2:])


def tile_softmax(q, k, v, tiles: Tiles, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax numerator and denominator over each query's visible keys, shifted by the query's maximum score m:
    num [B, H, T, d] = sum_j exp(s_j - m) v_j, den [B, H, T] = sum_j exp(s_j - m), s_j = scale q.k_j, m = max_j s_j.

    Computed on the non-empty tiles only, in fp32, and differentiable (through m too). q [B, H, T, d], k/v
    [B, Hkv, T, d]; every real query must see a key."""
    qb, kb, vb = (_blocks(t, tiles) for t in (q, k, v))
    kv_heads, size = kb.shape[1], tiles.size
    qi, ki = tiles.q_index, tiles.kv_index
    Q, K, V = qb[qi].view(len(qi), kv_heads, -1, size, qb.shape[-1]), kb[ki][:, :, None], vb[ki][:, :, None]
    scores = (Q @ K.transpose(-1, -2) * scale).masked_fill(~tiles.mask()[:, None, None], -math.inf)
    # m: each query row's maximum over all its tiles (0 past the end, where a row sees nothing and exp gives 0)
    row_max = scores.amax(-1)
    m = torch.full((len(qb), *row_max.shape[1:]), -math.inf, device=q.device).scatter_reduce(
        0, qi.view(-1, 1, 1, 1).expand_as(row_max), row_max, "amax", include_self=False)
    m = torch.where(torch.isfinite(m), m, 0)
    p = torch.exp(scores - m[qi][..., None])
    num = torch.zeros(len(qb), *Q.shape[1:-1], vb.shape[-1], device=q.device).index_add(0, qi, p @ V)
    den = torch.zeros(len(qb), *p.shape[1:-1], device=q.device).index_add(0, qi, p.sum(-1))
    return _unblock(num.flatten(1, 2), tiles, q.shape[0]), _unblock(den.flatten(1, 2), tiles, q.shape[0])
