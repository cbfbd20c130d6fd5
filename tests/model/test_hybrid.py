"""Block-hybrid attention: exact in-chunk softmax with an empty state, parallel == recurrent, flat memory."""

import pytest
import torch

from r2lm import Layout
from r2lm.ops import attention
from tests.helpers.models import MASK_ID, tiny_r2lm

HYBRID = dict(sidecar_layers=[1], hybrid_layers=[0, 2], hybrid_feature_dim=8)


def _layer(**overrides):
    return tiny_r2lm(open_gates=True, **dict(HYBRID, **overrides)).model.layers[0].self_attn


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_empty_state_is_in_chunk_softmax(tied):
    attn = _layer(hybrid_tie_feature_maps=tied)
    q, k, v = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    own = torch.tril(torch.ones(7, 7, dtype=torch.bool))[None, None]
    no_earlier = torch.zeros_like(own)
    out, _ = attn.linear_attention(q, k, v, attn.scaling, (own, no_earlier))
    torch.testing.assert_close(out, attention(q, k, v, own, attn.scaling), atol=1e-6, rtol=1e-5)


def test_linear_part_is_used():
    """With earlier keys, the output moves away from pure in-chunk softmax (the linear branch is live)."""
    attn = _layer()
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    chunks = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    own = (chunks[:, None] == chunks[None, :])[None, None]
    earlier = (chunks[None, :] < chunks[:, None])[None, None]
    hybrid, _ = attn.linear_attention(q, k, v, attn.scaling, (own, earlier))
    softmax_only = attention(q, k, v, own, attn.scaling)
    torch.testing.assert_close(hybrid[:, :, :4], softmax_only[:, :, :4], atol=1e-6, rtol=1e-5)
    assert (hybrid[:, :, 4:] - softmax_only[:, :, 4:]).abs().max() > 1e-3


def test_state_memory_does_not_grow_with_context():
    model = tiny_r2lm(max_position_embeddings=4096, **HYBRID)
    short, long = model.new_cache(2, 256), model.new_cache(2, 4096)
    for layer in HYBRID["hybrid_layers"]:
        assert short.layer_bytes(layer) == long.layer_bytes(layer) > 0
        assert short.key[layer] is None
    assert long.layer_bytes(1) == 16 * short.layer_bytes(1)  # softmax layers grow with the context


def test_commit_folds_state_and_denoise_does_not():
    model = tiny_r2lm(open_gates=True, **HYBRID)
    cache = model.new_cache(1, 64)
    with torch.no_grad():
        model.prefill(torch.randint(0, MASK_ID, (1, 6)), cache)
        S = cache.S[0].clone()
        assert S.abs().sum() > 0
        model.denoise(torch.full((1, 4), MASK_ID), cache)
        assert torch.equal(cache.S[0], S)
        model.commit(torch.randint(0, MASK_ID, (1, 4)), cache)
        assert not torch.equal(cache.S[0], S)


def test_padded_keys_contribute_nothing():
    model = tiny_r2lm(open_gates=True, **HYBRID)
    ids = torch.randint(0, MASK_ID, (1, 6))
    padded = torch.cat([torch.randint(0, MASK_ID, (1, 3)), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    a, b = model.new_cache(1, 32), model.new_cache(1, 32)
    window = torch.full((1, 4), MASK_ID)
    with torch.no_grad():
        model.prefill(ids, a)
        model.prefill(padded, b, attention_mask=mask)
        torch.testing.assert_close(a.S[0], b.S[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(model.denoise(window, a), model.denoise(window, b), atol=1e-5, rtol=1e-5)
        layout = Layout.span(mask)
        full = model(padded, layout=layout).logits[:, 3:]
        torch.testing.assert_close(full, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_untied_maps_give_keys_their_own_features():
    tied, untied = _layer(), _layer(hybrid_tie_feature_maps=False)
    assert tied.linear_attention.key_hedgehog_weights is None
    keys = untied.linear_attention.key_hedgehog_weights
    assert keys.shape == untied.linear_attention.hedgehog_weights.shape
    assert not torch.equal(keys, untied.linear_attention.hedgehog_weights)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_attention_transfer_lowers_the_per_layer_mse(tied):
    """Stage 1: only feature maps and gates train, against each layer's own softmax attention."""
    from r2lm import dual_stream

    model = tiny_r2lm(attention="block_causal", hybrid_layers=[0, 2], hybrid_feature_dim=8,
                      hybrid_tie_feature_maps=tied).train()
    trainable = [p for n, p in model.named_parameters() if ".linear_attention." in n]
    model.requires_grad_(False)
    for p in trainable:
        p.requires_grad_(True)
    x0 = torch.randint(0, MASK_ID, (4, 64), generator=torch.Generator().manual_seed(0))
    xt = torch.where(torch.rand(x0.shape, generator=torch.Generator().manual_seed(1)) < 0.5, MASK_ID, x0)
    inputs, layout, _ = dual_stream(x0, xt, 8, "inplace")
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    before = model.attention_transfer(inputs, layout).detach()
    for _ in range(40):
        optimizer.zero_grad()
        model.attention_transfer(inputs, layout).sum().backward()
        optimizer.step()
    after = model.attention_transfer(inputs, layout).detach()
    assert before.shape == (2,) and torch.all(after < 0.7 * before), (before, after)
    assert all(p.grad is None for n, p in model.named_parameters() if ".linear_attention." not in n)
