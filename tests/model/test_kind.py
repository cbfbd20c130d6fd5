"""The model kind (r2lm.kind, issue 31): one table of attention kinds, the properties every consumer reads instead of
the config's strings, and the block grid; then what a new attention kind takes. A sliding-window causal kind is
added here as one row of the table (it needs the predicate's window rule, r2lm.layout) and checked as every shipped
kind is: flex_attention == SDPA, values and gradients (invariant 9), and cache exactness (invariant 2) in the
forward, in generation and in verified decoding."""

import pytest
import torch

from r2lm import Layout, dual_stream, generate
from r2lm.diffusion import compute_loss
from r2lm.kind import ATTENTION, PREDICTIONS, Attention
from r2lm.ops.flex import block_sparse
from tests.helpers.decoding import left_padded
from tests.helpers.models import MASK_ID, peaky, tiny_r2lm, tiny_r2lm_config

KINDS = [(attention, prediction, hybrid) for attention in ("causal", "block_causal", "bidirectional")
         for prediction in PREDICTIONS for hybrid in (False, True) if not (hybrid and attention == "bidirectional")]


def _config(attention, prediction, hybrid, **overrides):
    return tiny_r2lm_config(attention=attention, prediction=prediction, hybrid_layers=[1] if hybrid else [],
                            hybrid_feature_dim=8, **overrides)


@pytest.mark.parametrize("attention,prediction,hybrid", KINDS)
def test_the_kind_says_what_the_config_strings_said(attention, prediction, hybrid):
    """The properties read where code compared attention / prediction strings before (issue 31's list)."""
    kind = _config(attention, prediction, hybrid).kind
    assert kind.attention is ATTENTION[attention] and kind.lead == (prediction == "shift") == kind.shift
    assert kind.exact_cache == (attention != "bidirectional")  # contexts: ExactCache / Recompute, else Canvas
    assert kind.chunked == (attention == "block_causal" or hybrid)  # the prompt on the block grid; prefix boundaries
    assert kind.plain_causal == (attention == "causal" and not hybrid)  # the prompt appended with the first window
    assert kind.ar == (attention == "causal" and prediction == "shift")  # next-token scoring, the ar objective
    assert kind.verifiable == (attention == "causal" and prediction == "shift" and not hybrid)
    assert kind.head(9) == 9 - (prediction == "shift")


@pytest.mark.parametrize("attention,prediction,hybrid", KINDS)
def test_the_grid_arithmetic_is_where_the_prompt_layouts_chunks_end(attention, prediction, hybrid):
    """grid_floor / grid_ceil (a prefix cache's reusable boundaries) against the chunks Layout.prompt gives a prompt:
    the deepest chunk start at or before n, the end of the chunk that holds token n - 1; n itself without chunks."""
    kind = _config(attention, prediction, hybrid, block_size=4).kind
    chunks = Layout.prompt(torch.ones(1, 40), kind).chunks.flatten().tolist()
    starts = [p for p in range(40) if p == 0 or chunks[p] != chunks[p - 1]]
    for n in range(1, 30):
        if not kind.chunked:
            assert kind.grid_floor(n) == kind.grid_ceil(n) == n and len(starts) == 1
            continue
        assert kind.grid_floor(n) == max(s for s in starts if s <= n), n
        assert kind.grid_ceil(n) == min(s for s in starts if s >= n), n


@pytest.mark.parametrize("prediction", list(PREDICTIONS))
def test_window_columns(prediction):
    """The canvas columns a block is read through: under shift the token before the block and the block but its last
    token (with a suffix, every suffix token within the block's width), under inplace the block (and suffix)."""
    kind = _config("causal", prediction, False).kind
    P, n, b = 5, 10, 4
    for suffix in (0, 3):
        for start in range(0, n, b):
            end = min(start + b, n)
            got = kind.window_columns(P, start, end, b, n, suffix)
            if kind.shift:
                assert got.start == P + start - 1
                assert got.stop == P + min(start + b - 1, n + suffix if suffix else end - 1)
            else:
                assert got == slice(P + start, P + min(start + b, n + suffix))


# ---------------------------------------------------------------------------------------------- a new kind

WINDOW = 5


@pytest.fixture
def sliding(monkeypatch):
    """A sliding-window causal attention kind: one row of r2lm.kind.ATTENTION. The config accepts any row's name."""
    monkeypatch.setitem(ATTENTION, "sliding_window", Attention("sliding_window", window=WINDOW))
    return dict(attention="sliding_window")


def test_a_sliding_window_kind_is_one_row_of_the_table(sliding):
    kind = tiny_r2lm_config(**sliding).kind
    assert kind.exact_cache and kind.plain_causal and kind.verifiable and not kind.chunked
    seen = Layout.span(torch.ones(1, 12)).dense_mask("sliding_window")[0]
    q, k = torch.arange(12)[:, None], torch.arange(12)[None]
    assert torch.equal(seen, (k <= q) & (q - k < WINDOW))
    with pytest.raises(ValueError, match="hybrid_layers read every committed block linearly"):
        tiny_r2lm_config(hybrid_layers=[1], hybrid_feature_dim=8, **sliding)


def test_the_window_changes_what_the_model_computes(sliding):
    """(So the tests below could fail: with the window ignored, its logits would be the causal model's.)"""
    ids = torch.randint(0, MASK_ID, (1, 16), generator=torch.Generator().manual_seed(0))
    windowed, causal = tiny_r2lm(**sliding), tiny_r2lm()
    with torch.no_grad():
        a, b = windowed(ids).logits, causal(ids).logits
    torch.testing.assert_close(a[:, :WINDOW], b[:, :WINDOW], atol=1e-5, rtol=1e-5)  # the first WINDOW see everything
    assert (a[:, WINDOW:] - b[:, WINDOW:]).abs().max() > 1e-3


@pytest.mark.parametrize("part", ["all", "own", "earlier"])
def test_sliding_window_tiles_are_the_dense_predicate(sliding, part):
    x0 = torch.randint(0, MASK_ID, (2, 40), generator=torch.Generator().manual_seed(0))
    _, layout, _ = dual_stream(x0, x0, 8, "shift")
    dense = layout.dense_mask("sliding_window", part)
    sparse = block_sparse(layout, "sliding_window", part, tile=16)
    t, size = sparse.tiles, -(-layout.length // 16) * 16
    rebuilt = torch.zeros(t.rows, size, size, dtype=torch.bool)
    for i, (r, qb, kb) in enumerate(zip(t.row.tolist(), t.q_block.tolist(), t.kv_block.tolist(), strict=True)):
        rebuilt[r, qb * 16 : (qb + 1) * 16, kb * 16 : (kb + 1) * 16] = t.mask(torch.tensor([i]))[0]
    assert torch.equal(rebuilt[:, : layout.length, : layout.length], dense.expand(t.rows, -1, -1))


def _grads(model, loss):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: g for (n, _), g in zip(named, grads, strict=True) if g is not None}


def test_sliding_window_flex_equals_sdpa(sliding):
    """Invariant 9 for the new kind: the block objective's loss and gradients, and a padded prompt + window."""
    model = tiny_r2lm(open_gates=True, sidecar_layers=[1, 3], **sliding)
    x0 = torch.randint(0, MASK_ID, (2, 40), generator=torch.Generator().manual_seed(3))
    padding = torch.ones_like(x0)
    padding[1, 30:] = 0
    mask = torch.ones(3, 21, dtype=torch.long)
    mask[1, :5], mask[2, :13] = 0, 0
    prompt = model.prompt_layout(mask)
    layout = Layout.cat(prompt, Layout.span(torch.ones(3, 8), start=mask.sum(1), noisy=True, chunk=1))
    ids = torch.randint(0, MASK_ID, (3, 29), generator=torch.Generator().manual_seed(2))
    out = {}
    for implementation in ("sdpa", "flex_attention"):
        model.set_attn_implementation(implementation)
        loss = compute_loss("block", model, x0, attention_mask=padding, generator=torch.Generator().manual_seed(4)).loss
        logits = model(ids, layout=layout).logits
        out[implementation] = (loss.detach(), logits.detach(), _grads(model, loss + logits.pow(2).mean()))
    (loss, logits, grads), (loss_ref, logits_ref, grads_ref) = out["flex_attention"], out["sdpa"]
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, logits_ref, atol=1e-5, rtol=1e-5)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=1e-5, rtol=1e-5, msg=name)


def test_sliding_window_prefill_commit_denoise_equal_the_full_forward(sliding):
    """Invariant 2 at the forward level: cached keys further back than the window are hidden, as in the layout."""
    model = tiny_r2lm(open_gates=True, sidecar_layers=[1, 3], **sliding)
    ids, mask = left_padded(length=11)
    first, second = torch.randint(0, MASK_ID, (3, 8)), torch.full((3, 8), MASK_ID)
    cache = model.new_cache(3, 64)
    with torch.no_grad():
        model.prefill(ids, cache, attention_mask=mask)
        model.commit(first, cache)
        cached = model.denoise(second, cache)
        ones, prompt = torch.ones_like(first), model.prompt_layout(mask)
        layout = Layout.cat(prompt, Layout.span(ones, start=mask.sum(1), chunk=1),
                            Layout.span(ones, start=mask.sum(1) + 8, noisy=True, chunk=2))
        full = model(torch.cat([ids, first, second], 1), layout=layout).logits[:, -8:]
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4])
def test_sliding_window_cached_generation_equals_recompute(sliding, block_size):
    """Invariant 2 in generation (left padding, fused commits, the prompt appended with the first window)."""
    model = peaky(sidecar_layers=[1, 3], **sliding)
    ids, mask = left_padded()
    cached = generate(model, ids, mask, max_new_tokens=16, block_size=block_size, threshold=0.5, eos_token_id=[])
    oracle = generate(model, ids, mask, max_new_tokens=16, block_size=block_size, threshold=0.5, eos_token_id=[],
                      use_cache=False)
    assert torch.equal(cached.sequences, oracle.sequences)


@pytest.mark.parametrize("draft", ["window", "lookup"])
def test_sliding_window_verified_decoding_is_greedy_ar(sliding, draft):
    """Invariant 8: verify=True reads drafts into the cache and keeps only the accepted columns valid; what it
    commits is the sliding-window model's own greedy AR decoding (the recompute oracle at block size 1)."""
    model = peaky(sidecar_layers=[], **sliding)
    ids, mask = left_padded()
    ar = generate(model, ids, mask, max_new_tokens=16, block_size=1, eos_token_id=[], use_cache=False)
    verified = generate(model, ids, mask, max_new_tokens=16, block_size=4, eos_token_id=[], verify=True,
                        verify_draft=draft)
    assert torch.equal(verified.sequences, ar.sequences)
