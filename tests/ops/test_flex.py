"""Invariant 9: block-sparse attention from the Layout's predicate (flex_attention) equals SDPA over the dense mask,
and the chunked (linear-time) block-hybrid form equals the dense one; values and gradients, fp32."""

import math

import pytest
import torch
import torch.nn.functional as F

from r2lm import Layout, dual_stream
from r2lm.diffusion import compute_loss
from r2lm.layers.hybrid import HybridParts
from r2lm.layout import verify_layout
from r2lm.ops.flex import block_sparse, flex_attention, torch_flex_attention
from tests.helpers.models import MASK_ID, tiny_r2lm

MODELS = {
    "r2lm": dict(attention="causal", sidecar_layers=[1, 3]),
    "block_causal": dict(attention="block_causal"),
    "r2lm+hybrid": dict(attention="causal", sidecar_layers=[1], hybrid_layers=[0, 2], hybrid_feature_dim=8),
    "block_causal+untied hybrid": dict(attention="block_causal", hybrid_layers=[1, 3], hybrid_feature_dim=8,
                                       hybrid_tie_feature_maps=False),
}


def _layouts(model):
    """(name, input_ids, layout): the training layouts and padded prompt grids a full forward sees."""
    x0 = torch.randint(0, MASK_ID, (2, 40), generator=torch.Generator().manual_seed(0))
    xt = torch.where(torch.rand(x0.shape, generator=torch.Generator().manual_seed(1)) < 0.5, MASK_ID, x0)
    for prediction in ("shift", "inplace"):
        ids, layout, _ = dual_stream(x0, xt, model.config.block_size, prediction)
        yield f"dual stream {prediction}", ids, layout
    mask = torch.ones(3, 21, dtype=torch.long)
    mask[1, :5], mask[2, :13] = 0, 0
    prompt = model.prompt_layout(mask)  # per-row chunks on each row's position grid, left padding
    window = Layout.span(torch.ones(3, 8), start=mask.sum(1), noisy=True, chunk=int(prompt.chunks.max()) + 1)
    ids = torch.randint(0, MASK_ID, (3, 29), generator=torch.Generator().manual_seed(2))
    yield "padded prompt + window", ids, Layout.cat(prompt, window)
    yield "padded span", ids[:, :21], Layout.span(mask)
    if not model.config.hybrid_layers:  # (block-hybrid layers refuse branches)
        siblings = verify_layout(8, [], siblings=3)  # verification's draft and 3 siblings, each on a branch of its own
        yield "draft + siblings", ids[:1, : siblings.length], siblings


def _with(model, implementation):
    model.set_attn_implementation(implementation)
    return model


def _grads(model, loss):
    """{name: gradient} of the parameters the loss depends on (sidecars see no window in a prompt layout)."""
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad], strict=True)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return {n: g for n, g in zip(names, grads, strict=True) if g is not None}


def _assert_same_grads(got, expected):
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------------- the tiles


@pytest.mark.parametrize("kind", ["causal", "block_causal", "bidirectional"])
@pytest.mark.parametrize("part", ["all", "own", "earlier"])
def test_tiles_are_the_dense_predicate(kind, part):
    """Every visible pair is in a listed tile with its mask; empty tiles hold none; full tiles are full."""
    model = tiny_r2lm(attention="block_causal")
    for name, _, layout in _layouts(model):
        dense = layout.dense_mask(kind, part)
        for tile in (16, 32):
            sparse = block_sparse(layout, kind, part, tile=tile)
            t, n = sparse.tiles, math.ceil(layout.length / tile)
            rebuilt = torch.zeros(t.rows, n * tile, n * tile, dtype=torch.bool)
            for i, (r, qb, kb) in enumerate(zip(t.row.tolist(), t.q_block.tolist(), t.kv_block.tolist(), strict=True)):
                rebuilt[r, qb * tile : (qb + 1) * tile, kb * tile : (kb + 1) * tile] = t.mask(torch.tensor([i]))[0]
            T = layout.length
            assert torch.equal(rebuilt[:, :T, :T], dense.expand(t.rows, -1, -1)), (name, tile)
            assert torch.equal(sparse.block_mask.to_dense().bool()[:, 0], sparse.any_), name


def test_a_forward_builds_the_block_mask_once_and_its_layers_share_it():
    model = _with(tiny_r2lm(**MODELS["r2lm"]), "flex_attention")
    _, ids, layout = next(_layouts(model))
    plan = model.model.plan(layout)
    assert plan.mask is None and plan.block_mask is block_sparse(layout, model.config.attention)
    assert model.model.plan(layout).block_mask is plan.block_mask
    dense = _with(model, "sdpa").model.plan(layout)
    assert dense.block_mask is None and dense.mask.shape[-1] == layout.length


def test_attn_implementation_is_chosen_the_transformers_way(tmp_path):
    tiny_r2lm().save_pretrained(tmp_path)
    from r2lm import R2LMForDiffusionLM

    flex = R2LMForDiffusionLM.from_pretrained(tmp_path, attn_implementation="flex_attention")
    sdpa = R2LMForDiffusionLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    default = R2LMForDiffusionLM.from_pretrained(tmp_path)
    assert flex.config._attn_implementation == "flex_attention"
    assert sdpa.config._attn_implementation == "sdpa"
    assert default.config._attn_implementation == ("flex_attention" if torch.cuda.is_available() else "sdpa")


# ---------------------------------------------------------------------------------------------- attention


def test_torch_flex_kernel_equals_sdpa_with_gqa_and_padding():
    """torch's compiled flex_attention (CPU: inference only) on the layout's BlockMask: GQA through enable_gqa
    (query head h reads key head h // 2), padding queries that see only themselves. One compiled shape."""
    model = tiny_r2lm(attention="block_causal")
    _, _, layout = list(_layouts(model))[2]  # padded prompt + window: per-row tiles
    sparse = block_sparse(layout, "block_causal")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, layout.length, 16, generator=g) for h in (4, 2, 2))
    dense = layout.dense_mask("block_causal")[:, None]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(torch_flex_attention(q, k, v, sparse, 0.25), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(flex_attention(q, k, v, sparse, 0.25), expected, atol=1e-6, rtol=1e-5)

    # A query block with no tile at all (an empty row, which the Layout never makes): flex gives zeros, not NaN.
    from torch.nn.attention.flex_attention import BlockMask

    bm = sparse.block_mask
    counts = [bm.kv_num_blocks.clone(), bm.full_kv_num_blocks.clone()]
    for c in counts:
        c[:, :, 0] = 0
    empty = BlockMask.from_kv_blocks(counts[0], bm.kv_indices, counts[1], bm.full_kv_indices, BLOCK_SIZE=bm.BLOCK_SIZE,
                                     mask_mod=bm.mask_mod, seq_lengths=bm.seq_lengths)
    sparse.__dict__["block_mask"] = empty  # the cached property, replaced for this check
    out = torch_flex_attention(q, k, v, sparse, 0.25)
    assert torch.equal(out[:, :, : bm.BLOCK_SIZE[0]], torch.zeros_like(out[:, :, : bm.BLOCK_SIZE[0]]))
    torch.testing.assert_close(out[:, :, bm.BLOCK_SIZE[0] :], expected[:, :, bm.BLOCK_SIZE[0] :], atol=1e-6, rtol=1e-5)


def test_packed_attention_gradients_equal_sdpa():
    model = tiny_r2lm(attention="causal")
    for name, _, layout in _layouts(model):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(layout.valid_mask(2).shape[0] if layout.rows == 1 else layout.rows, h, layout.length, 16,
                               generator=g).requires_grad_() for h in (4, 2, 2))
        for tile in (16, 128):
            sparse = block_sparse(layout, "causal", tile=tile)
            out = flex_attention(q, k, v, sparse, 0.3)
            expected = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense_mask("causal")[:, None],
                                                      scale=0.3, enable_gqa=True)
            torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5, msg=name)
            weight = torch.randn(out.shape, generator=g)
            got = torch.autograd.grad((out * weight).sum(), (q, k, v))
            want = torch.autograd.grad((expected * weight).sum(), (q, k, v))
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("name", MODELS)
def test_flex_equals_sdpa_for_the_block_objective(name):
    model = tiny_r2lm(open_gates=True, **MODELS[name])
    x0 = torch.randint(0, MASK_ID, (2, 40), generator=torch.Generator().manual_seed(3))
    padding = torch.ones_like(x0)
    padding[1, 30:] = 0
    losses, grads = {}, {}
    for implementation in ("sdpa", "flex_attention"):
        _with(model, implementation)
        out = compute_loss("block", model, x0, attention_mask=padding, generator=torch.Generator().manual_seed(4),
                           complementary=True)
        losses[implementation], grads[implementation] = out.loss.detach(), _grads(model, out.loss)
    torch.testing.assert_close(losses["flex_attention"], losses["sdpa"], atol=1e-5, rtol=1e-5)
    _assert_same_grads(grads["flex_attention"], grads["sdpa"])


def test_flex_equals_sdpa_for_mdlm_on_a_padded_bidirectional_batch():
    model = tiny_r2lm(attention="bidirectional", prediction="inplace")
    x0 = torch.randint(0, MASK_ID, (3, 24), generator=torch.Generator().manual_seed(5))
    padding = torch.ones_like(x0)
    padding[1, :7], padding[2, :15] = 0, 0  # left padding: the layout has invalid columns
    losses, grads = {}, {}
    for implementation in ("sdpa", "flex_attention"):
        _with(model, implementation)
        out = compute_loss("mdlm", model, x0, attention_mask=padding, generator=torch.Generator().manual_seed(6))
        losses[implementation], grads[implementation] = out.loss.detach(), _grads(model, out.loss)
    torch.testing.assert_close(losses["flex_attention"], losses["sdpa"], atol=1e-5, rtol=1e-5)
    _assert_same_grads(grads["flex_attention"], grads["sdpa"])


@pytest.mark.parametrize("name", MODELS)
def test_flex_equals_sdpa_on_padded_prompt_layouts(name):
    model = tiny_r2lm(open_gates=True, **MODELS[name])
    for layout_name, ids, layout in list(_layouts(model))[2:]:
        logits, grads = {}, {}
        for implementation in ("sdpa", "flex_attention"):
            out = _with(model, implementation)(ids, layout=layout).logits
            logits[implementation] = out.detach()
            grads[implementation] = _grads(model, out.pow(2).mean())
        torch.testing.assert_close(logits["flex_attention"], logits["sdpa"], atol=1e-5, rtol=1e-5, msg=layout_name)
        _assert_same_grads(grads["flex_attention"], grads["sdpa"])


def test_attention_transfer_runs_on_flex_and_the_chunked_form():
    model = tiny_r2lm(open_gates=True, attention="block_causal", hybrid_layers=[0, 1, 2, 3], hybrid_feature_dim=8)
    _, ids, layout = next(_layouts(model))
    mse, grads = {}, {}
    for implementation in ("sdpa", "flex_attention"):
        per_layer = _with(model, implementation).attention_transfer(ids, layout)
        mse[implementation], grads[implementation] = per_layer.detach(), _grads(model, per_layer.sum())
    assert mse["sdpa"].shape == (4,) and torch.all(mse["sdpa"] > 0)
    torch.testing.assert_close(mse["flex_attention"], mse["sdpa"], atol=1e-6, rtol=1e-5)
    _assert_same_grads(grads["flex_attention"], grads["sdpa"])


# ---------------------------------------------------------------------------------------------- block-hybrid


@pytest.mark.parametrize("kind", ["causal", "block_causal"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_chunked_hybrid_equals_dense(kind, tied):
    """The prefix-sum form computes exactly the dense function (own-chunk softmax shifted by its row maximum, plus
    the linear part over earlier clean keys, one normaliser): outputs and gradients, inputs and parameters."""
    model = tiny_r2lm(open_gates=True, attention=kind, hybrid_layers=[0], hybrid_feature_dim=8,
                      hybrid_tie_feature_maps=tied)
    hybrid = model.model.layers[0].self_attn.linear_attention
    params = list(hybrid.parameters())
    for name, _, layout in _layouts(model):
        batch = 2 if layout.rows == 1 else layout.rows
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(batch, h, layout.length, 16, generator=g).requires_grad_() for h in (4, 2, 2))
        own, earlier = layout.mask_parts(kind)
        dense, _ = hybrid(q, k, v, 0.25, (own[:, None], earlier[:, None]), layout.valid)
        chunked, _ = hybrid(q, k, v, 0.25, HybridParts.of(layout, kind, model.config.block_size), layout.valid)
        torch.testing.assert_close(chunked, dense, atol=1e-6, rtol=1e-5, msg=name)
        weight = torch.randn(dense.shape, generator=g)
        want = torch.autograd.grad((dense * weight).sum(), (q, k, v, *params))
        got = torch.autograd.grad((chunked * weight).sum(), (q, k, v, *params))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_chunked_hybrid_grows_linearly_with_the_length():
    """What the chunked form computes on (own-chunk tiles, chunk slots) grows like T, not T^2."""
    model = tiny_r2lm(hybrid_layers=[0], hybrid_feature_dim=8)
    sizes = []
    for length in (256, 1024):
        x0 = torch.zeros(1, length, dtype=torch.long)
        _, layout, _ = dual_stream(x0, x0, model.config.block_size, "shift")
        parts = HybridParts.of(layout, "causal", model.config.block_size)
        sizes.append((len(parts.own.row) * parts.own.size**2, parts.groups.columns.numel()))
    assert sizes[1][0] <= 4.2 * sizes[0][0] and sizes[1][1] <= 4.2 * sizes[0][1], sizes
