"""Inputs and references of the decoding tests: left-padded prompt batches, and verified decoding's reference."""

import torch

from r2lm import generate
from r2lm.convert.to_hf import without_sidecars

from .models import MASK_ID


def left_padded(batch=3, length=9, pads=(0, 3, 6), seed=1):
    """Random prompts [batch, length] (seeded) and their attention mask, row i left-padded with pads[i] zeros."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK_ID - 1, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate(pads[:batch]):
        mask[row, :n], ids[row, :n] = 0, 0
    return ids, mask


def left_pad(prompts):
    """Prompts of different lengths (1-D id tensors) as one left-padded batch: (ids, attention mask)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return ids, mask


def ar_greedy(model, input_ids, max_new_tokens, **options):
    """The model's greedy AR decoding with its sidecars off (block size 1, no EOS unless given): what verify=True
    must reproduce token for token (invariant 8)."""
    options.setdefault("eos_token_id", [])
    return generate(without_sidecars(model), input_ids, max_new_tokens=max_new_tokens, block_size=1, **options)
