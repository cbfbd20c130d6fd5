"""Baselines for bidirectional models (LLaDA, Dream), which have no exact cache.

- No cache (LLaDA): the canvas [prompt ; [MASK] * n] is re-encoded in full every step; blocks are filled
  semi-autoregressively (positions beyond the current block are not candidates).
- `approximate_cache="prefix"` (Fast-dLLM PrefixCache): at each block start one full forward; the keys and values
  left of the block are kept and the following steps encode only the block and everything after it.
- `approximate_cache="dual"` (Fast-dLLM DualCache): as prefix, and the keys of everything right of the block are
  kept too, so each step encodes only the block.

- `bicache=store` (BiCache, r2lm.prefix.bicache): when every prompt starts with a prefix held in the store, each
  step's layers below the store's safe depth b(r) run without the prefix and read its stored prefix-alone keys and
  values; layers from b on re-encode the whole canvas as before.

All three are APPROXIMATE: under bidirectional attention the kept keys would change as the canvas fills in;
they are refreshed once per block (Fast-dLLM) or never (BiCache). Outputs can differ from the no-cache decoder.
Under `shift` (Dream), canvas position p is predicted by the logits of p - 1.
"""

from __future__ import annotations

import torch

from r2lm.cache import KVCache
from r2lm.generation.decoding import GenerateOutput, choose


def decode_bidirectional(model, r) -> GenerateOutput:
    ids, mask = r.input_ids, r.attention_mask
    batch, prompt_len = ids.shape
    n_new, b, mask_id = r.max_new_tokens, r.block_size, r.mask_id
    lead = 1 if model.config.prediction == "shift" else 0
    canvas = torch.cat([ids, torch.full((batch, n_new), mask_id, dtype=ids.dtype, device=ids.device)], 1)
    canvas_mask = torch.cat([mask, torch.ones(batch, n_new, dtype=mask.dtype, device=mask.device)], 1)
    out = canvas[:, prompt_len:]  # a view
    stopper = r.stopper
    stopper.stream(ids)
    nfe = steps = 0
    reuse = r.bicache.prepare(model, ids, mask, n_new, lead) if r.bicache is not None else None

    end = 0
    for start in range(0, n_new, b):
        end = min(start + b, n_new)
        block = out[:, start:end]
        block[stopper.finished] = r.pad_id
        first = prompt_len + start - lead  # first column whose logits predict this block
        cache = None
        while True:
            masked = block == mask_id
            if not masked.any():
                break
            if reuse is not None:  # rest column c - P holds canvas column c (c >= padding + P: prepare() sees to it)
                col = first - reuse.prefix_len
                logits = reuse.logits(canvas)[:, col : col + end - start]
            elif r.approximate_cache is None:
                logits = model(canvas, attention_mask=canvas_mask).logits[:, first : first + end - start]
            elif cache is None:  # block start: one full forward fills the cache, then keep only its left part
                cache = KVCache(model.config, batch, canvas.shape[1], model.dtype, model.device)
                logits = model(canvas, attention_mask=canvas_mask, cache=cache, update_cache=True).logits
                logits = logits[:, first : first + end - start]
                cache.rewind(first)
                if r.approximate_cache == "dual":
                    cache.stale_end = canvas.shape[1]
            else:
                stop = first + end - start if r.approximate_cache == "dual" else canvas.shape[1]
                logits = model(canvas[:, first:stop], cache=cache).logits[:, : end - start]
            nfe, steps = nfe + 1, steps + 1
            tokens, take = choose(logits, masked, r)
            block[take] = tokens[take]
            finished = stopper.check_eos(out, start, end, mask_id)
            block[finished[:, None] & (block == mask_id)] = r.pad_id
        if stopper.stop_strings:
            stopper.check_strings(out, end)
        stopper.stream(block, start)
        if stopper.finished.all():
            break
    stopper.end()
    new = stopper.trim(out[:, :end])
    return GenerateOutput(torch.cat([ids, new], 1), nfe, steps, stopper.count(new))
