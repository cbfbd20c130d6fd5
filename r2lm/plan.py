"""ForwardPlan: what every layer of one forward needs from its layout (RoPE tables, attention masks, the sidecar's
windows, where keys go in the cache), derived once before the layers run; `plan_of`, which derives it from a
layout, and `kept_plan`, which assembles it from masks a decoder keeps for a whole call.

Every ForwardPlan is made here (tests/project/test_plans.py checks it), so each mask comes from a Layout's one
predicate of who sees whom. It sits below both the model (r2lm.modeling_r2lm) and the decoders (r2lm.generation),
which keep the masks of the shapes they run over and over, built from template layouts (r2lm.generation.window);
a drafter's stack of decoder layers (r2lm.drafter, and its training batch, r2lm.drafter_loss) is planned here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from r2lm.cache import KVCache
from r2lm.layers.hybrid import HybridParts
from r2lm.layout import Layout
from r2lm.ops.flex import BlockSparse, block_sparse


@dataclass(frozen=True, eq=False)
class ForwardPlan:
    """What every layer of one forward needs from its layout, derived once before the layers run; never mutated."""

    cos: torch.Tensor  # [B or 1, T, rotary dims]
    sin: torch.Tensor
    mask: torch.Tensor | None  # softmax layers: bool (True = attend) or additive float, [B or 1, 1, T, keys]
    is_causal: bool = False  # no mask tensor: SDPA's own causal kernel (True) or no mask at all (False)
    block_mask: BlockSparse | None = None  # softmax layers under flex_attention (no cache): the layout's tiles
    own: torch.Tensor | None = None  # block-hybrid layers over a cache: softmax part [B or 1, 1, T, T]
    earlier: torch.Tensor | None = None  # block-hybrid layers over a cache: linear part [B or 1, 1, T, T]
    hybrid: HybridParts | None = None  # block-hybrid layers without a cache: the chunked (linear-time) form
    valid: torch.Tensor | None = None  # [B, T] real tokens, None when all are
    windows: torch.Tensor | slice | None = None  # the sidecar's scope (see ReverseSidecar.forward); None: no sidecar
    columns: torch.Tensor | None = None  # with a cache: the cache columns this input's keys and values are written to
    keys: int = 0  # with a cache: attention reads cache columns [0, keys)
    commit: int = 0  # leading columns appended to the cache by this forward (block-hybrid layers fold their keys)
    transfer: bool = False  # attention transfer: hybrid layers also score themselves against their softmax teacher


def plan_of(config, rotary_emb, layout: Layout, cache: KVCache | None = None, commit: int = 0,
            transfer: bool = False, like: torch.Tensor | None = None, context: Layout | None = None) -> ForwardPlan:
    """The ForwardPlan of `layout` for a stack of `config`'s layers, read against `cache` when given; `commit` leading
    columns are appended to it. `like`: a tensor of the stack's dtype and device (for the RoPE tables).

    The cache's keys are clean and in earlier chunks than the input's: every query sees every real one (see
    r2lm.layout.cached_keys_seen). `context`: instead, the layout of the cache's columns, whose keys each query sees
    as the predicate over [context ; layout] says (a drafter's training batch: each block sees the text before its
    anchor, r2lm.layout.anchored_blocks).

    Without a cache, softmax layers attend through the layout's block-sparse tiles under
    attn_implementation="flex_attention" (r2lm.ops.flex) and through its dense mask under "sdpa" (the
    reference), and block-hybrid layers take their linear-time chunked form; over a cache (few columns) both
    use the dense form."""
    kind, rule = config.attention, config.kind.attention
    if transfer and cache is not None:
        raise ValueError("attention transfer runs on a full layout, without a cache")
    if context is not None and (cache is None or context.length != cache.length or config.hybrid_layers):
        raise ValueError("a context layout describes the columns of a cache (of softmax layers), as many as it holds")
    # A single unpadded clean chunk with no cache needs no mask tensor: SDPA's causal (or unmasked) kernel; a window
    # needs one.
    plain = cache is None and layout.is_plain and not transfer and rule.window is None
    # softmax layers (or, under attention transfer, the softmax teacher of every hybrid layer) need a mask
    softmax = transfer or len(config.hybrid_layers) < config.num_hidden_layers
    mask = blocks = None
    if softmax and not plain:
        if context is not None:
            mask = layout.attention_mask(kind, context=context)
        elif cache is not None:
            mask = layout.attention_mask(kind, cache.valid[:, : cache.length], cache.stale_suffix(layout.length))
        elif config._attn_implementation == "flex_attention":
            blocks = block_sparse(layout, kind)
        else:
            mask = layout.attention_mask(kind)
    own = earlier = hybrid = None
    if config.hybrid_layers and cache is None:
        hybrid = HybridParts.of(layout, kind, config.block_size)
    elif config.hybrid_layers:
        own, earlier = (m[:, None] for m in layout.mask_parts(kind))
    cos, sin = rotary_emb(like, layout.positions)
    columns = keys = None
    if cache is not None:
        columns, keys = cache.scratch(layout.length), cache.keys_read(layout.length)
    return ForwardPlan(
        cos=cos, sin=sin, mask=mask, is_causal=plain and rule.causal, block_mask=blocks, own=own,
        earlier=earlier, hybrid=hybrid, valid=layout.valid, windows=layout.windows if config.sidecar_layers else None,
        columns=columns, keys=keys or 0, commit=commit, transfer=transfer,
    )


def kept_plan(rotary_emb, like: torch.Tensor, cache: KVCache, offsets: torch.Tensor, mask: torch.Tensor, keys: int,
              commit: int, own: torch.Tensor | None = None, earlier: torch.Tensor | None = None,
              windows: torch.Tensor | slice | None = None) -> ForwardPlan:
    """The ForwardPlan of a forward shape whose masks a decoder keeps for a whole call (r2lm.generation.window:
    `mask` [B, 1, T, >= keys] over the cache's columns then the input's, `own` / `earlier` and `windows` as plan_of
    derives them, all from the shape's template Layout). Its T = len(offsets) columns sit at `offsets` past each
    row's next position, are written to the cache's scratch and read its columns [0, keys); `commit` leading ones
    are appended to it."""
    cos, sin = rotary_emb(like, cache.next_position[:, None] + offsets)
    return ForwardPlan(cos=cos, sin=sin, mask=mask[..., :keys], own=own, earlier=earlier, windows=windows,
                       columns=cache.scratch(len(offsets)), keys=keys, commit=commit)
