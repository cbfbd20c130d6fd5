"""Prompt prefill through a PrefixCache: each row starts from its cached prefix, computes the rest exactly,
and stores what it computed for the requests after it."""

from __future__ import annotations

import torch

from r2lm.cache import KVCache


@torch.no_grad()
def prefill_rows(model, prefix_cache, rows: list[list[int]], max_length: int):
    """(cache, pinned, forwards): a batched KVCache holding `rows` (token lists, each row's clean context)
    right-aligned (left padding) with room for `max_length` columns, the cached blocks pinned for this call
    (release them after it), and the number of model forwards it took. If it raises (a bad token id, Ctrl-C), it
    releases them itself: a pinned block can never be evicted.

    Rows are prefilled one at a time: each row resumes from its own cached depth (and, for block-hybrid layers,
    from its deepest state checkpoint), prefills the remainder in pieces that end at the checkpoint positions
    the placement DP chose, then inserts its blocks and checkpoints."""
    config, dtype, device = model.config, model.dtype, model.device
    prefix_cache.bind(model)
    width = max(len(tokens) for tokens in rows)
    batch = KVCache(config, len(rows), max_length, dtype, device)
    batch.pad(width)
    pinned, forwards = [], 0
    try:
        for r, tokens in enumerate(rows):
            blocks, n, state = prefix_cache.lookup(config, tokens)
            pinned += blocks
            row = KVCache(config, 1, max(len(tokens), 1), dtype, device)
            if n:
                keys = [None if b0 is None else torch.cat([b.keys[i] for b in blocks], 1)[None, :, :n]
                        for i, b0 in enumerate(blocks[0].keys)]
                values = [None if v0 is None else torch.cat([b.values[i] for b in blocks], 1)[None, :, :n]
                          for i, v0 in enumerate(blocks[0].values)]
                row.load(keys, values, state, n)
            stops = prefix_cache.checkpoint_positions(config, n, prefix_cache.boundary(config, len(tokens)), tokens)
            states, done = {}, n
            for stop in [*stops, len(tokens)]:
                if stop > done:
                    model.prefill(torch.tensor([tokens[done:stop]], device=device), row)
                    done, forwards = stop, forwards + 1
                if stop in stops:
                    states[stop] = row.states()
            prefix_cache.insert(
                config, tokens,
                [None if k is None else k[0, :, : len(tokens)] for k in row.key],
                [None if v is None else v[0, :, : len(tokens)] for v in row.value],
                states,
            )
            batch.place_row(r, row)
    except BaseException:
        prefix_cache.release(pinned)
        raise
    return batch, pinned, forwards
