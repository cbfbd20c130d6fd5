"""Layouts: what each column of one forward is (docs/design.md section 2).

A layout gives every column of the input
- a RoPE position (per row: left-padded rows have their own positions),
- a chunk index: the unit one prefill / commit call appends, or one diffusion window,
- whether it is clean context or part of an active (noisy) window,
- whether it is a real token or padding.

The attention mask and the sidecar's scope are both derived from it, so training (dual stream) and decoding
(prefill, denoise, commit over a cache) cannot drift apart:

- a clean column sees clean columns of earlier chunks, and clean columns of its own chunk causally
  (`causal`) or all of them (`block_causal`);
- a window column sees clean columns of earlier chunks, and columns of its own window causally or fully;
- `bidirectional`: every real column sees every real column;
- columns already in a KV cache are clean and belong to earlier chunks: every column sees them (unless the
  cache's columns have a layout of their own, which the predicate reads as well: `anchored_blocks`);
- a kind with a window (r2lm.kind.Attention.window) hides every key that many positions or more before the query,
  cached ones included;
- a column on a branch (`branches` > 0: verification's siblings, r2lm.generation.verify) is seen by the columns of
  its own branch alone: the other candidates for the same position and everything after it never read it.

The attention kinds are the rows of r2lm.kind.ATTENTION; the predicate below evaluates their rules.

The sidecar runs over each window (the noisy columns of one chunk) and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from r2lm.kind import ModelKind, attention_rule, prediction_lead


@dataclass(eq=False)
class Layout:
    positions: torch.Tensor  # long [B or 1, T]: RoPE positions
    chunks: torch.Tensor  # long [T], or [B, T] when rows are chunked differently (a prompt on each row's grid)
    noisy: torch.Tensor  # bool [T]: column belongs to an active window
    valid: torch.Tensor | None = None  # bool [B, T]: False for padding; None when every column is real
    # The windows' columns when the builder knows them (see `windows`); None: derived from noisy and chunks.
    window_columns: torch.Tensor | slice | None = None
    branches: torch.Tensor | None = None  # long [T]: 0 (the trunk) or a branch seen only by itself; None: all trunk

    def __post_init__(self):
        T = self.chunks.shape[-1]
        if self.positions.dim() != 2 or self.positions.shape[1] != T or self.noisy.shape != (T,) or self.chunks.dim() > 2:
            raise ValueError(
                f"layout shapes disagree: positions {tuple(self.positions.shape)}, chunks {tuple(self.chunks.shape)}, "
                f"noisy {tuple(self.noisy.shape)}"
            )
        if self.valid is not None and (self.valid.dim() != 2 or self.valid.shape[1] != T):
            raise ValueError(f"layout valid mask {tuple(self.valid.shape)} does not match {T} columns")
        if self.branches is not None and self.branches.shape != (T,):
            raise ValueError(f"layout branches {tuple(self.branches.shape)} do not match {T} columns")

    @property
    def length(self) -> int:
        return self.chunks.shape[-1]

    @property
    def rows(self) -> int:
        """Rows the layout tells apart: 1 when every row of the batch has the same columns."""
        return max(self.positions.shape[0], self.chunks.shape[0] if self.chunks.dim() == 2 else 1,
                   1 if self.valid is None else self.valid.shape[0])

    # ---------------------------------------------------------------- builders

    @classmethod
    def span(cls, attention_mask: torch.Tensor, start=0, noisy: bool = False, chunk: int = 0, grid: int | None = None,
             grid_offset: int = 0) -> Layout:
        """One chunk of columns: clean context (`noisy=False`) or one window (`noisy=True`).

        attention_mask [B, T] (1 = token, 0 = left padding); start: each row's first position (int or [B]).
        With `grid`, clean columns are instead cut into chunks on each row's absolute position grid: the token at
        position p is in chunk `chunk + (p + grid_offset) // grid` (how block-diffusion training chunks its clean
        stream, so a prompt committed this way is seen exactly as training saw context)."""
        valid = attention_mask.bool()
        start = torch.as_tensor(start, device=valid.device).reshape(-1, 1)
        positions = start + (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        T = valid.shape[1]
        if grid is not None:
            chunks = chunk + (positions + grid_offset) // grid
        else:
            chunks = torch.full((T,), chunk, dtype=torch.long, device=valid.device)
        return cls(
            positions=positions,
            chunks=chunks,
            noisy=torch.full((T,), noisy, dtype=torch.bool, device=valid.device),
            valid=None if bool(valid.all()) else valid,
            window_columns=slice(0, T if noisy else 0),
        )

    @classmethod
    def prompt(cls, attention_mask: torch.Tensor, kind: ModelKind, start=0, chunk: int = 0) -> Layout:
        """The layout a prompt goes in with (prefill): one clean chunk, or where chunks matter (`kind.chunked`) the
        block grid of training's clean stream, block k's chunk opening at k * block_size - lead."""
        if not kind.chunked:
            return cls.span(attention_mask, start=start, chunk=chunk)
        return cls.span(attention_mask, start=start, chunk=chunk, grid=kind.block_size, grid_offset=kind.lead)

    @classmethod
    def cat(cls, *layouts: Layout) -> Layout:
        """Columns of several layouts side by side, their chunk indices kept (so they must already be numbered as
        one layout's: distinct, but where a window and clean columns share a chunk on purpose, `anchored_blocks`)."""
        batch = max(lay.positions.shape[0] for lay in layouts)
        valid = None
        if any(lay.valid is not None for lay in layouts):
            valid = torch.cat([lay.valid_mask(batch) for lay in layouts], dim=1)
        per_row = any(lay.chunks.dim() == 2 for lay in layouts)
        branches = None
        if any(lay.branches is not None for lay in layouts):
            branches = torch.cat([torch.zeros_like(lay.noisy, dtype=torch.long) if lay.branches is None else lay.branches
                                  for lay in layouts])
        windows, offset = [], 0
        for lay in layouts:  # each part's windows, moved to where the part starts
            part = lay.windows
            if isinstance(part, slice):
                windows.append(slice(part.start + offset, part.stop + offset))
            elif part is not None:
                windows += [row[row >= 0] + offset for row in part]
            offset += lay.length
        return cls(
            positions=torch.cat([lay.positions.expand(batch, -1) for lay in layouts], dim=1),
            chunks=torch.cat([lay.chunks.expand(batch, -1) if per_row else lay.chunks for lay in layouts], dim=-1),
            noisy=torch.cat([lay.noisy for lay in layouts]),
            valid=valid,
            window_columns=windows[0] if len(windows) == 1 and isinstance(windows[0], slice) else
            _right_aligned(windows, layouts[0].noisy.device) if windows else slice(0, 0),
            branches=branches,
        )

    def select_rows(self, keep: torch.Tensor) -> Layout:
        """The layout of the rows `keep` (a bool mask or indices over the batch) of a layout that tells rows apart."""
        return Layout(
            positions=self.positions[keep] if self.positions.shape[0] > 1 else self.positions,
            chunks=self.chunks[keep] if self.chunks.dim() == 2 else self.chunks,
            noisy=self.noisy,
            valid=None if self.valid is None else self.valid[keep],
            window_columns=self.window_columns,
            branches=self.branches,
        )

    def valid_mask(self, batch: int) -> torch.Tensor:
        if self.valid is not None:
            return self.valid
        return torch.ones(batch, self.length, dtype=torch.bool, device=self.chunks.device)

    # ---------------------------------------------------------------- derived

    def mask_mod(self, kind: str, part: str = "all", pad_to: int = 1):
        """The attention predicate, flex_attention's `mask_mod`: f(b, h, q, kv) -> True where query column q of row b
        may see key column kv (any head h). The one definition of who sees whom: the dense masks below and the
        block-sparse masks of r2lm.ops.flex are both evaluated from it.

        part: "own" (the key is in the query's own chunk and stream, causally for `causal`), "earlier" (the key is
        clean and in an earlier chunk) or "all" (their union; what softmax layers attend over). Block-hybrid layers
        attend to "own" with softmax and to "earlier" linearly. Padding keys are in neither; a padding query sees
        only itself (so no row is empty: SDPA would give NaN there, flex zeros, and the two agree on every row).

        The predicate indexes small per-column tables; they are padded to a multiple of `pad_to` columns, which are
        no query's key and see nothing, so a kernel may evaluate it on the whole last tile. It broadcasts: called
        with index tensors of shapes [B, 1, 1], [1, T, 1] and [1, 1, S] it gives the [B, T, S] mask."""
        if part not in ("own", "earlier", "all"):
            raise ValueError(f"unknown mask part {part!r}; expected 'own', 'earlier' or 'all'")
        rule = attention_rule(kind)
        streams, causal, window = rule.streams, rule.causal, rule.window
        rows, pad = self.rows, -self.length % pad_to
        real = self.valid_mask(rows)

        def table(t, fill):  # [rows, T + pad]; the padding columns are no key of any query, and see nothing
            return torch.nn.functional.pad(t.expand(rows, self.length), (0, pad), value=fill).contiguous()

        stream = self.streams
        pos, chunk = table(self.positions, 0), table(self.chunks.expand(rows, -1), -1)
        query_stream = table(stream, -2)
        key_stream = table(torch.where(real, stream, -1), -1)  # padding keys are in no stream
        clean_key = table(~self.noisy & real, False)
        padding_query = table(~real, False) if self.valid is not None else None
        branch = None if self.branches is None else table(self.branches[None], 0)

        def on_branch(r, q, kv):  # a key on a branch is its own branch's alone
            return (branch[r, kv] == 0) | (branch[r, kv] == branch[r, q])

        def row(b):  # tables shared by every row have one row, whatever batch they are applied to
            return b if rows > 1 else 0

        def own(b, h, q, kv):
            r = row(b)
            if not streams:
                seen = key_stream[r, kv] >= 0
            else:
                seen = query_stream[r, q] == key_stream[r, kv]
                if causal:
                    seen = seen & (pos[r, kv] <= pos[r, q])
            if window is not None:
                seen = seen & (pos[r, q] - pos[r, kv] < window)
            if branch is not None:
                seen = seen & on_branch(r, q, kv)
            if padding_query is not None:
                seen = seen | ((q == kv) & padding_query[r, q])
            return seen

        def earlier(b, h, q, kv):
            r = row(b)
            seen = clean_key[r, kv] & (chunk[r, kv] < chunk[r, q])
            if window is not None:
                seen = seen & (pos[r, q] - pos[r, kv] < window)
            if branch is not None:
                seen = seen & on_branch(r, q, kv)
            return seen if streams else seen & False  # without streams every key is its own

        def union(b, h, q, kv):
            return own(b, h, q, kv) | earlier(b, h, q, kv)

        return {"own": own, "earlier": earlier, "all": union}[part]

    @property
    def streams(self) -> torch.Tensor:
        """long [rows, T]: each column's stream, a chunk's clean columns or its window. Outside bidirectional
        attention a real key is in a query's own part only if it is in the query's stream."""
        return self.chunks.expand(self.rows, -1) * 2 + self.noisy.long()

    def dense_mask(self, kind: str, part: str = "all", queries: slice = slice(None)) -> torch.Tensor:
        """The predicate evaluated on every pair: bool [B or 1, T, T] (True = query row may see key column);
        `queries`: those query rows only."""
        cols = torch.arange(self.length, device=self.chunks.device)
        rows, asked = torch.arange(self.rows, device=cols.device), cols[queries]
        mask = self.mask_mod(kind, part)(rows[:, None, None], None, asked[None, :, None], cols[None, None, :])
        return mask.expand(self.rows, len(asked), self.length)  # a part may not depend on every index

    def mask_parts(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(own, earlier), bool [B or 1, T, T]: the two parts of the predicate (see `mask_mod`)."""
        return self.dense_mask(kind, "own"), self.dense_mask(kind, "earlier")

    def attention_mask(self, kind: str, cached: torch.Tensor | None = None, stale: torch.Tensor | None = None,
                       context: Layout | None = None) -> torch.Tensor:
        """Boolean mask [B or 1, 1, T, C + T (+ S)] (True = attend) for softmax attention.

        `cached` [B, C] marks real columns already in a KV cache (clean, earlier chunks: see `cached_keys_seen`);
        `stale` [B, S]: real columns after the input that an approximate (Fast-dLLM dual) cache keeps visible.
        `context`: instead of `cached`, the layout of the C cached columns, when not every query sees every real one
        (`anchored_blocks`): the predicate over [context ; self] decides, for this layout's queries."""
        if context is not None:
            if cached is not None or stale is not None:
                raise ValueError("a context layout describes the cached columns: pass it instead of cached and stale")
            return Layout.cat(context, self).dense_mask(kind, queries=slice(context.length, None))[:, None]
        allowed = self.dense_mask(kind)
        if cached is not None and cached.shape[1]:
            past = cached_keys_seen(kind, cached, self.positions).expand(-1, self.length, -1)
            allowed = torch.cat([past, allowed.expand(past.shape[0], -1, -1)], dim=2)
        if stale is not None:
            after = stale[:, None, :].expand(-1, self.length, -1)
            allowed = torch.cat([allowed.expand(after.shape[0], -1, -1), after], dim=2)
        return allowed[:, None]

    @cached_property
    def windows(self) -> torch.Tensor | slice | None:
        """The sidecar's scope: the columns of each window (the noisy columns of one chunk). A slice when there is
        one window of contiguous columns; else [W, Lw] column indices, right-aligned, -1 padded; None: no window.

        Builders that know them pass `window_columns` (arithmetic, no host sync; an empty slice: no window);
        otherwise they are derived here."""
        if isinstance(self.window_columns, slice) and self.window_columns.start == self.window_columns.stop:
            return None
        if self.window_columns is not None:
            return self.window_columns
        cols = torch.nonzero(self.noisy).flatten()
        if cols.numel() == 0:
            return None
        chunks = self.chunks[..., cols]
        if chunks.dim() == 2:
            if not bool((chunks == chunks[:1]).all()):
                raise ValueError("windows must cover the same columns in every row")
            chunks = chunks[0]
        ids, counts = torch.unique_consecutive(chunks, return_counts=True)
        if len(ids) != len(torch.unique(ids)):
            raise ValueError("the columns of a window must be contiguous")
        width = int(counts.max())
        out = torch.full((len(ids), width), -1, dtype=torch.long, device=cols.device)
        for w, (piece, n) in enumerate(zip(cols.split(counts.tolist()), counts.tolist(), strict=True)):
            out[w, width - n :] = piece
        return out

    @property
    def is_plain(self) -> bool:
        """One clean chunk with no padding: the mask is plain causal (or empty), so SDPA can take a fast path."""
        return (self.valid is None and self.branches is None and not bool(self.noisy.any())
                and bool((self.chunks == self.chunks.flatten()[0]).all()))


def cached_keys_seen(kind: str, cached: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Which keys of a KV cache queries at `positions` [B or 1, T] see: bool [B, 1 or T, C], from `cached` [B, C]
    (the cache's real columns). Cached keys are clean and in earlier chunks, so every query sees every real one, but
    under a window only those fewer than `window` positions before it; a cached column's position is the count of
    real columns before it (a KVCache advances each row's next position by its real columns)."""
    window = attention_rule(kind).window
    if window is None:
        return cached[:, None, :]
    key_positions = cached.long().cumsum(1) - 1
    return cached[:, None, :] & (positions[..., :, None] - key_positions[:, None, :] < window)


def _right_aligned(windows: list, device) -> torch.Tensor | None:
    """[W, Lw] on `device` from a list of windows (slices or 1-D column tensors), right-aligned, -1 padded; None if
    empty. (The layout's device, also when every window is a slice: the sidecar indexes activations with it.)"""
    if not windows:
        return None
    rows = [torch.arange(w.start, w.stop, device=device) if isinstance(w, slice) else w for w in windows]
    width = max(len(r) for r in rows)
    return torch.stack([torch.cat([torch.full((width - len(r),), -1, dtype=torch.long, device=device), r.to(device)])
                        for r in rows])


def anchored_blocks(valid: torch.Tensor, anchors: torch.Tensor, block_size: int) -> tuple[Layout, Layout]:
    """A drafter's training batch (r2lm.drafter_loss): a text as context, and one block per anchor read over it.

    valid [B, L]: the text's real columns, already in the drafter's cache: clean, column p at position p and alone in
    chunk p. anchors [B, n], distinct within a row: block w of row r is one window of `block_size` columns at
    positions a .. a + block_size - 1 (a = anchors[r, w]), in chunk a (as in `dual_stream`, a window and a clean
    column share a chunk index in different streams). So a block sees the real context columns before its anchor
    (what decoding holds in the drafter's cache before that block) and the columns of its own block (those at or
    before a query's position under `causal`, all of them under `block_causal`), never another block's.

    Returns (context, blocks): the cached columns' layout (plan_of's `context`) and the forward's input, the n
    blocks side by side (block w at columns [w * block_size, (w + 1) * block_size)), each a sidecar window."""
    length, count, device = valid.shape[1], anchors.shape[1], valid.device
    columns, offsets = torch.arange(length, device=device), torch.arange(block_size, device=device)
    context = Layout(positions=columns[None], chunks=columns, noisy=torch.zeros(length, dtype=torch.bool, device=device),
                     valid=valid.bool())
    blocks = Layout(
        positions=(anchors[..., None] + offsets).flatten(1),
        chunks=anchors.repeat_interleave(block_size, 1),
        noisy=torch.ones(count * block_size, dtype=torch.bool, device=device),
        window_columns=torch.arange(count * block_size, device=device).view(count, block_size),
    )
    return context, blocks


def dual_stream(x0: torch.Tensor, xt: torch.Tensor, block_size: int, prediction: str):
    """The block-diffusion training layout of BD3-LM / Fast-dLLM v2 (docs/design.md 2.1): `[windows of x_t ; x_0]`.

    x0 [B, L] clean tokens, xt [B, L] the same tokens with some replaced by [MASK]. Block k covers
    `[k*b, (k+1)*b)`; block 0 is context only. For each later block the input holds one window:
    - `inplace`: positions [kb, (k+1)b) with inputs xt there; column j predicts x0[j];
    - `shift`: positions [kb - 1, (k+1)b - 1) with inputs [x0[kb-1], xt[kb .. (k+1)b-2]]; column p predicts x0[p+1].
    The clean stream is x0 at positions 0..L-1, chunked like decoding commits it (block k's chunk opens at kb - 1
    under `shift`), so a window sees exactly the clean prefix decoding would hold in its cache.

    Returns (input_ids [B, T], layout, target [T]) where target[j] is the index into x0 that column j predicts
    (-1 for clean columns).
    """
    if x0.shape != xt.shape or x0.dim() != 2:
        raise ValueError(f"x0 {tuple(x0.shape)} and xt {tuple(xt.shape)} must both be [batch, length]")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    length, device = x0.shape[1], x0.device
    offset = prediction_lead(prediction)
    pos = torch.arange(length, device=device)
    chunk_of = (pos + offset) // block_size  # block k's chunk is [kb - offset, (k+1)b - offset)
    win_pos = pos[(chunk_of >= 1) & (pos + offset < length)]
    win_inputs = xt[:, win_pos]
    if offset:  # each window opens with the last clean token before its block
        win_inputs = torch.where((win_pos + 1) % block_size == 0, x0[:, win_pos], win_inputs)
    # Window w (block w + 1; block 0 is context) holds columns [w*b, min((w+1)*b, L - b)) of the input: every
    # window has block_size columns but maybe the last. Right-aligned and -1 padded, as Layout.windows.
    count = -(-length // block_size) - 1
    windows = slice(0, 0)  # none
    if count > 0:
        starts = torch.arange(count, device=device) * block_size
        ends = (starts + block_size).clamp(max=length - block_size)
        width = min(block_size, length - block_size)
        cols = ends[:, None] - width + torch.arange(width, device=device)
        windows = torch.where(cols >= starts[:, None], cols, -1)
    layout = Layout(
        positions=torch.cat([win_pos, pos])[None],
        chunks=torch.cat([chunk_of[win_pos], chunk_of]),
        noisy=torch.cat([torch.ones_like(win_pos, dtype=torch.bool), torch.zeros_like(pos, dtype=torch.bool)]),
        window_columns=windows,
    )
    target = torch.cat([win_pos + offset, torch.full_like(pos, -1)])
    return torch.cat([win_inputs, x0], dim=1), layout, target


def verify_layout(b: int, outcomes: list[int], device=None, siblings: int = 0) -> Layout:
    """The columns of one verification forward, positions relative to the cache's next position: clean column j
    at position j in chunk 2j + 1 (so it sees the clean columns before it), then for each j in `outcomes` window j
    at positions j .. j + b - 1 in chunk 2j (so it sees the clean columns before position j), then `siblings` clean
    columns at position 1 in chunk 2, each on a branch of its own (so each sees the opener and itself, and no
    column sees it but itself: the other candidates for the draft's first token)."""
    one, window = torch.ones(1, 1, device=device), torch.ones(1, b, device=device)
    clean = [Layout.span(one, start=j, chunk=2 * j + 1) for j in range(b)]
    windows = [Layout.span(window, start=j, noisy=True, chunk=2 * j) for j in outcomes]
    if siblings:
        if outcomes or b < 2:
            raise ValueError("siblings stand in for a draft's first token: a clean draft of 2 columns or more")
        clean.append(Layout(positions=torch.ones(1, siblings, dtype=torch.long, device=device),
                            chunks=torch.full((siblings,), 2, device=device),
                            noisy=torch.zeros(siblings, dtype=torch.bool, device=device),
                            window_columns=slice(0, 0), branches=torch.arange(1, siblings + 1, device=device)))
    return Layout.cat(*clean, *windows)
