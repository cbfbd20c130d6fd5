"""The bf16 cache check (tests/model/test_bf16.py, tests/train/test_bf16_train_launch.py): a bf16 model's cache
(prefill, denoise, commit) equals recomputation within bf16 rounding, and both stay within bf16 rounding of the fp32
model.

Tolerances: logits here are about 0.5 in size, where a bf16 step is 2^-9 ~ 0.002; the cached and recomputed
paths round in different places and land a few steps apart (not bit-identical, unlike fp32's invariant 2), and a
dtype mistake (an fp32 value cast down late, a bf16 state accumulated in bf16) shows up as a much larger gap or
as an error.
"""

import torch

from r2lm import Layout

from .models import MASK_ID

BF16 = dict(atol=2e-2, rtol=2e-2)


def cached_and_recomputed(model, ids, mask, first, second):
    """The second window's logits through the cache (prefill, a denoise, commit of the first block, denoise) and
    from one full forward over the same layout."""
    cache = model.new_cache(ids.shape[0], 64)
    with torch.no_grad():
        model.prefill(ids, cache, attention_mask=mask)
        model.denoise(second, cache)
        model.commit(first, cache)
        cached = model.denoise(second, cache)
        ones, prompt = torch.ones_like(first), model.prompt_layout(mask)
        after = int(prompt.chunks.max())
        layout = Layout.cat(prompt, Layout.span(ones, start=mask.sum(1), chunk=after + 1),
                            Layout.span(ones, start=mask.sum(1) + first.shape[1], noisy=True, chunk=after + 2))
        full = model(torch.cat([ids, first, second], 1), layout=layout).logits[:, -second.shape[1]:]
    return cache, cached, full


def decode_inputs(batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK_ID, (batch, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4], mask[2, :7] = 0, 0  # left padding
    first = torch.randint(0, MASK_ID, (batch, 8), generator=g)
    second = torch.randint(0, MASK_ID, (batch, 8), generator=g)
    second[:, [2, 3, 6]] = MASK_ID
    return ids, mask, first, second


def assert_bf16_cache_equals_recompute(model, reference=None):
    """`model` (bf16) decodes through its cache what it recomputes, within bf16 rounding; with an fp32
    `reference` of the same weights, both are within bf16 rounding of it."""
    inputs = decode_inputs()
    cache, cached, full = cached_and_recomputed(model, *inputs)
    assert cached.dtype == full.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in cache.key + cache.value if t is not None)
    assert all(t.dtype == torch.float32 for t in cache.S + cache.Z if t is not None)  # hybrid states sum in fp32
    torch.testing.assert_close(cached.float(), full.float(), **BF16)
    if reference is not None:
        _, _, want = cached_and_recomputed(reference, *inputs)
        torch.testing.assert_close(full.float(), want, **BF16)
        torch.testing.assert_close(cached.float(), want, **BF16)
