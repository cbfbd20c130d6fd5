"""bf16 decoding on CPU (issue 33): what a GPU user runs (`from_pretrained(..., dtype=torch.bfloat16)` or
`model.to(torch.bfloat16)`), so a dtype mistake shows up without a GPU. The cache (prefill, denoise, commit) equals
recomputation within bf16 rounding, and both stay within bf16 rounding of the fp32 model.

Tolerances: logits here are about 0.5 in size, where a bf16 step is 2^-9 ~ 0.002; the cached and recomputed
paths round in different places and land a few steps apart (not bit-identical, unlike fp32's invariant 2), and a
dtype mistake (an fp32 value cast down late, a bf16 state accumulated in bf16) shows up as a much larger gap or
as an error. The two-rank bf16 training run is in test_bf16_train_launch.py (slow)."""

import pytest
import torch
from conftest import MASK_ID, tiny_r2lm

from r2lm import Layout, R2LMForDiffusionLM, generate

MODELS = {
    "r2lm": dict(attention="causal", sidecar_layers=[1, 3]),
    "block_causal+sidecar": dict(attention="block_causal", sidecar_layers=[0]),
    "r2lm+hybrid": dict(attention="causal", sidecar_layers=[1], hybrid_layers=[0, 2], hybrid_feature_dim=8),
    "block_causal+hybrid": dict(attention="block_causal", sidecar_layers=[1], hybrid_layers=[0, 3], hybrid_feature_dim=8),
}
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


@pytest.mark.parametrize("name", MODELS)
def test_bf16_model_cache_equals_recompute(name):
    """model.to(torch.bfloat16): sidecars, block-hybrid states and the KV cache in a bf16 model."""
    reference = tiny_r2lm(open_gates=True, **MODELS[name])
    model = tiny_r2lm(open_gates=True, dtype=torch.bfloat16, **MODELS[name])
    assert_bf16_cache_equals_recompute(model, reference)


def test_bf16_load_of_an_fp32_checkpoint_decodes(tmp_path):
    """from_pretrained(dtype=torch.bfloat16) of an fp32 checkpoint (what a GPU user does): every weight in bf16,
    the cache equal to recomputation, and cached generation runs end to end."""
    reference = tiny_r2lm(open_gates=True, **MODELS["r2lm+hybrid"])
    reference.save_pretrained(tmp_path)
    model = R2LMForDiffusionLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert_bf16_cache_equals_recompute(model, reference)
    ids, mask, _, _ = decode_inputs()
    out = generate(model, ids, mask, max_new_tokens=16, block_size=8)
    new = out.sequences[:, ids.shape[1]:]
    assert new.shape == (3, 16) and not (new == MASK_ID).any()
