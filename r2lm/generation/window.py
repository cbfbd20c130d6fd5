"""Window reads against one KVCache for a whole generate() call: the lean decode step (gpt-fast style).

A decoder runs a handful of forward shapes over and over: the first window alone; a finished block's clean
columns followed by the next window (the block is committed in the same forward that reads the window: "fused
commit"); a clean window committed as it is read (the AR case); verified decoding's clean draft followed by one
window per way its verification can end (r2lm.generation.verify). For each shape this keeps, for the whole call:

- the in-input attention predicate, from a template Layout of that shape (the Layout stays the one description
  of who sees whom), as an additive float mask;
- a [B, 1, T, max_length] mask buffer: the cache's valid columns, then the in-input predicate at the columns the
  input is written to. It is brought up to date in place when the cache has grown (once per block), and each
  forward takes a view of it: no mask is built per step;
- the sidecar's scope as a slice (the window's columns): no gather, no index arithmetic.

So a forward costs no host synchronisation. With `compile=True` the forward (stack and LM head) goes through
torch.compile with static shapes: attention reads all max_length cache columns (the mask hides those not yet
written) and keys and values are written at tensor positions, so the compiled step does not depend on the
cache length and compiles once per shape.
"""

from __future__ import annotations

import torch

from r2lm.cache import KVCache
from r2lm.layout import Layout, cached_keys_seen
from r2lm.plan import ForwardPlan, kept_plan


def window_layout(width: int, commit: int, device=None) -> Layout:
    """The usual forward shape: `commit` leading clean columns (appended to the cache), then a window of
    width - commit columns; commit == width: a clean window, read and committed at once (no sidecar). Positions
    are relative to the cache's next position."""
    parts = []
    if commit:
        parts.append(Layout.span(torch.ones(1, commit, device=device), chunk=0))
    if commit < width:
        parts.append(Layout.span(torch.ones(1, width - commit, device=device), start=commit, noisy=True, chunk=1))
    return Layout.cat(*parts)


class _Shape:
    """One forward shape, from its template Layout (positions relative to the cache's next position) and the
    number of leading clean columns it commits."""

    def __init__(self, model, cache, template: Layout, commit: int):
        config, device = model.config, cache.valid.device
        self.kind = config.attention
        # under a window a cached key drops out of sight as the cache grows: every sync looks at every cached column
        self.local = config.kind.attention.window is not None
        own, earlier = template.mask_parts(self.kind)
        width, dtype = template.length, model.dtype
        self.inner = torch.zeros(1, 1, width, width, dtype=dtype, device=device).masked_fill(
            ~(own | earlier)[:, None], float("-inf"))
        self.own, self.earlier = (own[:, None], earlier[:, None]) if config.hybrid_layers else (None, None)
        self.windows = template.windows if config.sidecar_layers else None
        self.offsets = template.positions[0].to(device)
        self.width, self.commit = width, commit
        self.mask = torch.full((cache.batch_size, 1, width, cache.max_length), float("-inf"), dtype=dtype, device=device)
        self.length = None  # the cache length the mask is in step with

    def sync(self, cache) -> None:
        """Columns [0, length) show the cache's keys the queries see (its valid tokens, r2lm.layout.cached_keys_seen),
        the next `width` the in-input predicate."""
        if self.mask.shape[-1] < cache.max_length:  # the cache grew (KVCache.reserve): the mask too, as it was
            grown = self.mask.new_full((*self.mask.shape[:-1], cache.max_length), float("-inf"))
            grown[..., : self.mask.shape[-1]] = self.mask
            self.mask = grown
        old, new = self.length or 0, cache.length
        if self.length == new:
            return
        if new < old:  # a rewound cache (benchmarks): forget the columns after it
            self.mask[..., new:] = float("-inf")
            old = new
        old = 0 if self.local else old
        queries = cache.next_position[:, None] + self.offsets if self.local else None  # (positions: only a window's)
        visible = cached_keys_seen(self.kind, cache.valid[:, old:new], queries)[:, None]
        self.mask[..., old:new] = torch.where(visible, 0.0, float("-inf")).to(self.mask.dtype)
        self.mask[..., new : new + self.width] = self.inner
        self.length = new


class WindowReader:
    def __init__(self, model, cache, compile: bool = False):
        self.model, self.cache, self.static = model, cache, compile
        self.shapes: dict = {}  # (width, commit) or a caller's template Layout -> _Shape
        self.forwards = 0
        self._run = torch.compile(self._forward, dynamic=False) if compile else self._forward

    @classmethod
    def scratch(cls, model, rows: int, context: int, room: int) -> WindowReader:
        """A reader over a cache of `rows` rows holding `context` columns and room for `room` more (for timing
        forwards: r2lm.generation.costs). Their keys and values are zeros, not a prompt's: what a forward costs does
        not depend on the values it attends to, so no forward need write them (one per width measured did)."""
        cache = KVCache(model.config, rows, context + room, model.dtype, model.device)
        cache.advance(context)
        return cls(model, cache)

    def read(self, ids: torch.Tensor, commit: int, keep: slice, advance: bool = True,
             layout: Layout | None = None, head: bool = True, capture: tuple[int, ...] = ()):
        """Logits of the columns `keep` of ids [B, T], whose `commit` leading columns are clean context, appended
        to the cache (with `advance=False` the caller advances the cache itself, by as many of them as it keeps:
        exact for softmax layers, whose keys are written either way). `layout`: the forward's template when it
        is not `window_layout(T, commit)` (positions relative to the cache's next position); keep passing the
        same object, it is the key of the masks kept for it. `head=False`: the last hidden states of those columns
        instead, for a caller that applies the LM head only to the columns it turns out to need. `capture`: layer
        indices whose outputs over every column are returned too, as (out, captured) (a drafter's context)."""
        cache, width = self.cache, ids.shape[1]
        cache.check_room(width)
        shape = self.prepare(width, commit, layout)
        shape.sync(cache)
        keys = cache.max_length if self.static else cache.length + width
        plan = kept_plan(self.model.model.rotary_emb, self.model.lm_head.weight, cache, shape.offsets, shape.mask, keys,
                         commit, own=shape.own, earlier=shape.earlier, windows=shape.windows)
        out, captured = self._run(ids, plan, cache, keep, head, capture)
        if commit and advance:
            cache.advance(commit)
        self.forwards += 1
        return (out, captured) if capture else out

    def prepare(self, width: int, commit: int, layout: Layout | None = None) -> _Shape:
        """The kept masks of a forward shape, built on first use (its set-up reads the host once: a caller that
        knows the next shape can build it ahead, outside the steps, as decoding does after the prompt; verified
        decoding builds each shape as its steps first run it: of the dozens of widths and sibling counts a call may
        run, most calls run few)."""
        key = (width, commit) if layout is None else layout
        if key not in self.shapes:
            template = window_layout(width, commit, self.cache.valid.device) if layout is None else layout
            self.shapes[key] = _Shape(self.model, self.cache, template, commit)
        return self.shapes[key]

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Drop the rows not in `keep` from the cache and from every kept mask (finished rows leave the batch)."""
        self.cache.keep_rows(keep)
        for shape in self.shapes.values():
            shape.mask = shape.mask[keep]

    def _forward(self, ids, plan: ForwardPlan, cache, keep: slice, head: bool, capture: tuple[int, ...]):
        out = self.model.model(ids, plan, cache, capture=capture)
        h = out.last_hidden_state[:, keep]
        return (self.model.lm_head(h) if head else h), out.captured
