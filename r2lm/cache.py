"""KVCache: preallocated keys and values of clean (committed) tokens, one buffer per softmax layer, and the
fp32 linear-attention state (S, Z) of each block-hybrid layer, whose size does not depend on the context.

Rows advance in lockstep (one column per token slot); left padding is masked by `valid` rather than by per-row
offsets, and `next_position` holds each row's next RoPE position (its count of real tokens so far).

A forward over the cache writes its own keys and values into the scratch columns [length, length + T) (`scratch`)
and attends over [0, length + T): no concatenation, no reallocation. Only `advance` (called by prefill / commit)
moves `length` forward, so a denoise step leaves the committed part untouched and its scratch is simply overwritten
by the next forward. A forward may also commit only its leading columns (a finished block read together with
the next window): it advances by those, and the window's scratch is overwritten in turn.

The cache's fields are its own: the per-layer buffers (key, value, S, Z) are bound once, what changes as it is used
(length, next_position, valid, the stale region) is private and read through properties, and every change goes
through a method named for what the caller means (advance, rewind, pad, place_row, load, keep_rows, reserve);
tests/project/test_plans.py checks that no code outside this module assigns one.
"""

from __future__ import annotations

import torch


def cache_signature(config) -> tuple:
    """What a KVCache's shapes depend on: a cache only serves models with the same signature (a cache that outlives a
    request checks the whole model: r2lm.prefix.identity)."""
    return (config.num_hidden_layers, config.num_key_value_heads, config.head_dim, tuple(config.hybrid_layers),
            config.hybrid_feature_dim)


class KVCache:
    def __init__(self, config, batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device | str):
        if batch_size <= 0 or max_length <= 0:
            raise ValueError(f"KVCache needs a positive batch size and length, got {batch_size} and {max_length}")
        self.signature = cache_signature(config)
        shape = (batch_size, config.num_key_value_heads, max_length, config.head_dim)
        softmax = [i not in config.hybrid_layers for i in range(config.num_hidden_layers)]
        self.key = [torch.zeros(shape, dtype=dtype, device=device) if s else None for s in softmax]
        self.value = [torch.zeros(shape, dtype=dtype, device=device) if s else None for s in softmax]
        features = 2 * config.hybrid_feature_dim
        state = (batch_size, config.num_attention_heads, features, config.head_dim)
        self.S = [None if s else torch.zeros(state, dtype=torch.float32, device=device) for s in softmax]
        self.Z = [None if s else torch.zeros(state[:-1], dtype=torch.float32, device=device) for s in softmax]
        self._valid = torch.zeros(batch_size, max_length, dtype=torch.bool, device=device)
        self._columns = torch.arange(max_length, device=device)  # sliced into each forward's write positions
        self._next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._length = 0
        # Only for Fast-dLLM's approximate dual cache on bidirectional models (`rewind(..., keep_stale=True)`):
        # columns [length + T, _stale_end) keep keys computed in an earlier forward and stay visible to every query.
        self._stale_end = 0

    @property
    def length(self) -> int:
        """Committed columns: [0, length) hold clean keys and values (left padding among them marked by `valid`)."""
        return self._length

    @property
    def next_position(self) -> torch.Tensor:
        """long [B]: each row's next RoPE position (its count of real committed tokens)."""
        return self._next_position

    @property
    def valid(self) -> torch.Tensor:
        """bool [B, max_length]: which committed columns hold a real token (False: left padding, or not written)."""
        return self._valid

    @property
    def batch_size(self) -> int:
        return self._valid.shape[0]

    @property
    def max_length(self) -> int:
        return self._valid.shape[1]

    def scratch(self, num_tokens: int) -> torch.Tensor:
        """The columns [length, length + num_tokens) an input's keys and values are written to (a tensor, so that a
        compiled step does not depend on the cache's length)."""
        return self._columns[self._length : self._length + num_tokens]

    def keys_read(self, num_tokens: int) -> int:
        """Attention over an input of `num_tokens` reads columns [0, keys_read): the committed ones, the input's,
        and any stale ones after them."""
        return max(self._length + num_tokens, self._stale_end)

    def reserve(self, num_tokens: int) -> bool:
        """Make room for a forward of `num_tokens` columns, growing the cache if it has less: to twice its length or
        what is needed, whichever is more, the columns in use moved into the new buffers. For a cache whose worst case
        is many times what it usually holds (verified decoding's, whose rows may drift apart: r2lm.generation.verify),
        which can then start at what it usually needs. Returns whether it grew (a static-shape caller, compile=True,
        sizes its cache for the worst case and never calls this)."""
        if self._length + num_tokens <= self.max_length:
            return False
        used, length = max(self._length, self._stale_end), max(self._length + num_tokens, 2 * self.max_length)
        for buffers in (self.key, self.value):
            for i, t in enumerate(buffers):
                if t is not None:
                    grown = t.new_zeros(*t.shape[:2], length, t.shape[3])
                    grown[:, :, :used] = t[:, :, :used]
                    buffers[i] = grown
        valid = self._valid.new_zeros(self.batch_size, length)
        valid[:, :used] = self._valid[:, :used]
        self._valid, self._columns = valid, torch.arange(length, device=self._columns.device)
        return True

    def check_room(self, num_tokens: int) -> None:
        if self._length + num_tokens > self.max_length:
            raise ValueError(
                f"KVCache overflow: {self._length} cached + {num_tokens} new tokens exceed its max_length {self.max_length}"
            )

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, columns: torch.Tensor, keys: int):
        """Write key/value [B, Hkv, T, d] into cache columns `columns` [T] (the scratch after the committed part);
        return keys and values over columns [0, keys). The positions come in as a tensor, so a compiled step
        does not depend on the cache's length."""
        self.key[layer_idx].index_copy_(2, columns, key)
        self.value[layer_idx].index_copy_(2, columns, value)
        return self.key[layer_idx][:, :, :keys], self.value[layer_idx][:, :, :keys]

    def state(self, layer_idx: int):
        """(S, Z) of a block-hybrid layer: the linear-attention sums over every committed token."""
        return self.S[layer_idx], self.Z[layer_idx]

    def fold(self, layer_idx: int, dS: torch.Tensor, dZ: torch.Tensor) -> None:
        """Add a committed chunk's keys to a block-hybrid layer's state (after the chunk has read it)."""
        self.S[layer_idx] += dS
        self.Z[layer_idx] += dZ

    def layer_bytes(self, layer_idx: int) -> int:
        tensors = (self.key[layer_idx], self.value[layer_idx], self.S[layer_idx], self.Z[layer_idx])
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def stale_suffix(self, num_tokens: int) -> torch.Tensor | None:
        """Validity [B, S] of the stale columns after an input of `num_tokens`, or None when there are none."""
        start = self._length + num_tokens
        return self._valid[:, start : self._stale_end] if self._stale_end > start else None

    def relocate(self, into: int, source: torch.Tensor) -> None:
        """Before `advance`: in each row r, the keys and values just written at scratch column source[r] replace
        those at scratch column `into` (verification's accepted sibling takes its trunk column's place, so that what
        is committed stays one run of columns; a row whose source is `into` keeps its own)."""
        index = (self._length + source).view(-1, 1, 1, 1)
        for buffers in (self.key, self.value):
            for t in buffers:
                if t is not None:
                    moved = t.gather(2, index.expand(-1, t.shape[1], 1, t.shape[3]))
                    t[:, :, self._length + into] = moved[:, :, 0]

    def advance(self, valid: torch.Tensor | int) -> None:
        """Commit the columns just written: valid [B, T] marks real tokens (False for padding), or an int T when
        all of them are real."""
        if isinstance(valid, int):
            self._valid[:, self._length : self._length + valid] = True
            self._next_position += valid
            self._length += valid
            return
        end = self._length + valid.shape[1]
        self._valid[:, self._length : end] = valid
        self._next_position += valid.sum(dim=1)
        self._length = end

    def load(self, keys: list, values: list, states: list | None, length: int) -> None:
        """Start an empty cache from `length` tokens of clean context computed elsewhere (a prefix cache hit):
        keys/values per layer [B, Hkv, length, d] (None for hybrid layers), states per layer (S, Z) or None."""
        if self._length:
            raise ValueError("load() needs an empty cache")
        self.check_room(length)
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            if self.key[layer] is not None:
                self.key[layer][:, :, :length] = k
                self.value[layer][:, :, :length] = v
            elif states is not None:
                self.S[layer].copy_(states[layer][0])
                self.Z[layer].copy_(states[layer][1])
        self._valid[:, :length] = True
        self._next_position += length
        self._length = length

    def pad(self, width: int) -> None:
        """Make an empty cache `width` columns long, all of them padding, for `place_row` to fill row by row."""
        if self._length:
            raise ValueError("pad() needs an empty cache")
        self.check_room(width)
        self._length = width

    def states(self) -> list:
        """A copy of every hybrid layer's (S, Z) (None for softmax layers): a checkpoint of the recurrent part."""
        return [None if S is None else (S.clone(), Z.clone()) for S, Z in zip(self.S, self.Z, strict=True)]

    def place_row(self, row: int, source: KVCache) -> None:
        """Copy the only row of `source` into `row`, right-aligned at this cache's length (left padding; `pad` gives an
        empty cache its length)."""
        n, end = source.length, self._length
        if n > end:
            raise ValueError(f"a row of {n} tokens does not fit in {end} columns")
        for layer in range(len(self.key)):
            if self.key[layer] is not None:
                self.key[layer][row, :, end - n : end] = source.key[layer][0, :, :n]
                self.value[layer][row, :, end - n : end] = source.value[layer][0, :, :n]
            else:
                self.S[layer][row] = source.S[layer][0]
                self.Z[layer][row] = source.Z[layer][0]
        self._valid[row, :end] = False
        self._valid[row, end - n : end] = source.valid[0, :n]
        self._next_position[row] = source.next_position[0]

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Keep only the rows `keep` (a [B] bool mask or row indices), in order: rows a decoder has finished leave
        the batch, so later forwards do not compute them. The kept rows' keys and values move into the leading rows
        of the same buffers, only the columns in use: a cache with room for a long generation (a verifier's) pays
        for what it holds, not for its room. (The columns after them keep finite values from before: scratch, never
        read before a forward writes it, and masked where a compiled step reads every column.)"""
        keep = keep.nonzero().flatten() if keep.dtype == torch.bool else keep
        rows, used = keep.numel(), max(self._length, self._stale_end)
        for buffers in (self.key, self.value):
            for i, t in enumerate(buffers):
                if t is not None:
                    t[:rows, :, :used] = t[keep, :, :used]
                    buffers[i] = t[:rows]
        for buffers in (self.S, self.Z):
            buffers[:] = [None if t is None else t[keep] for t in buffers]
        self._valid, self._next_position = self._valid[keep], self._next_position[keep]

    def rewind(self, length: int, keep_stale: bool = False) -> None:
        """Forget committed columns from `length` on (approximate caches recompute from a block start; a benchmark
        repeats a forward from the same state). With `keep_stale` the forgotten columns' keys stay visible to every
        later query, as stale keys (Fast-dLLM's dual cache on bidirectional models); without, there are none."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot rewind a cache of length {self._length} to {length}")
        self._stale_end = max(self._stale_end, self._length) if keep_stale else 0
        self._length = length
        self._next_position = self._valid[:, :length].sum(dim=1)
