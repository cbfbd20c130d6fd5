"""Invariant 2 at the forward level: prefill + denoise (+ commit) equal the full forward over the same layout."""

import pytest
import torch

from r2lm import Layout, dual_stream
from tests.helpers.models import MASK_ID, tiny_r2lm

MODELS = {
    "r2lm": dict(attention="causal", sidecar_layers=[1, 3]),
    "block_causal": dict(attention="block_causal"),
    "block_causal+sidecar": dict(attention="block_causal", sidecar_layers=[0]),
    "r2lm+hybrid": dict(attention="causal", sidecar_layers=[1], hybrid_layers=[0, 2], hybrid_feature_dim=8),
    "block_causal+hybrid": dict(attention="block_causal", hybrid_layers=[1, 3], hybrid_feature_dim=8),
    "block_causal+untied hybrid": dict(attention="block_causal", hybrid_layers=[1, 3], hybrid_feature_dim=8,
                                       hybrid_tie_feature_maps=False),
}


def _prompt(batch=3, length=11, pad=(0, 4, 7)):
    ids = torch.randint(0, MASK_ID, (batch, length))
    mask = torch.ones_like(ids)
    for row, n in enumerate(pad[:batch]):
        mask[row, :n] = 0
    return ids, mask


def _window(batch, width=8, masked=(2, 3, 6)):
    window = torch.randint(0, MASK_ID, (batch, width))
    window[:, list(masked)] = MASK_ID
    return window


@pytest.mark.parametrize("name", MODELS)
def test_prefill_denoise_equals_full_forward(name):
    model = tiny_r2lm(open_gates=True, **MODELS[name])
    ids, mask = _prompt()
    window = _window(ids.shape[0])
    cache = model.new_cache(ids.shape[0], 64)
    with torch.no_grad():
        model.prefill(ids, cache, attention_mask=mask)
        cached = model.denoise(window, cache)
        prompt = model.prompt_layout(mask)  # one chunk, or block_causal's position grid
        window_layout = Layout.span(torch.ones_like(window), start=mask.sum(1), noisy=True, chunk=int(prompt.chunks.max()) + 1)
        layout = Layout.cat(prompt, window_layout)
        full = model(torch.cat([ids, window], 1), layout=layout).logits[:, ids.shape[1]:]
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


def _two_blocks(name):
    """A tiny model of MODELS[name], a left-padded prompt (ids, mask) of 3 rows, a first block to commit after it
    and a second window to read after that."""
    model = tiny_r2lm(open_gates=True, **MODELS[name])
    ids, mask = _prompt()
    return model, ids, mask, torch.randint(0, MASK_ID, (3, 8)), _window(3)


@pytest.mark.parametrize("name", MODELS)
def test_commit_then_next_window_equals_full_forward(name):
    """Two blocks: the second window reads a cache holding the prompt and the committed first block."""
    model, ids, mask, first, second = _two_blocks(name)
    cache = model.new_cache(3, 64)
    with torch.no_grad():
        model.prefill(ids, cache, attention_mask=mask)
        model.denoise(_window(3), cache)  # a denoise in between must leave no trace
        model.commit(first, cache)
        cached = model.denoise(second, cache)
        ones, prompt = torch.ones_like(first), model.prompt_layout(mask)
        after = int(prompt.chunks.max())
        layout = Layout.cat(
            prompt,
            Layout.span(ones, start=mask.sum(1), chunk=after + 1),
            Layout.span(ones, start=mask.sum(1) + 8, noisy=True, chunk=after + 2),
        )
        full = model(torch.cat([ids, first, second], 1), layout=layout).logits[:, -8:]
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


def test_denoise_writes_nothing():
    model = tiny_r2lm(open_gates=True, sidecar_layers=[1])
    ids, mask = _prompt()
    cache = model.new_cache(3, 64)
    with torch.no_grad():
        model.prefill(ids, cache, attention_mask=mask)
        before = ([k.clone() for k in cache.key], cache.valid.clone(), cache.next_position.clone(), cache.length)
        model.denoise(_window(3), cache)
    assert cache.length == before[3]
    assert torch.equal(cache.valid, before[1]) and torch.equal(cache.next_position, before[2])
    for k, k0 in zip(cache.key, before[0], strict=True):
        assert torch.equal(k[:, :, : cache.length], k0[:, :, : cache.length])


def test_prefill_keys_do_not_depend_on_sidecars():
    """Clean tokens never receive the sidecar: cached K/V equal those of the same model without sidecars."""
    with_sidecars = tiny_r2lm(open_gates=True, sidecar_layers=[0, 1, 2, 3])
    plain = tiny_r2lm(sidecar_layers=[])
    plain.load_state_dict(with_sidecars.state_dict(), strict=False)
    ids, mask = _prompt()
    caches = [m.new_cache(3, 32) for m in (with_sidecars, plain)]
    with torch.no_grad():
        for m, c in zip((with_sidecars, plain), caches, strict=True):
            m.prefill(ids, c, attention_mask=mask)
    for a, b in zip(caches[0].key, caches[1].key, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("prediction", ["shift", "inplace"])
@pytest.mark.parametrize("name", MODELS)
def test_dual_stream_window_equals_decoding(name, prediction):
    """Training layout [x_t ; x_0]: each noisy window's logits equal prefill of the clean prefix + denoise."""
    model = tiny_r2lm(open_gates=True, prediction=prediction, **MODELS[name])
    b = 8
    x0 = torch.randint(0, MASK_ID, (2, 4 * b - 3))  # last block partial
    xt = torch.where(torch.rand(x0.shape) < 0.5, torch.full_like(x0, MASK_ID), x0)
    inputs, layout, target = dual_stream(x0, xt, b, prediction)
    with torch.no_grad():
        logits = model(inputs, layout=layout).logits
    offset = 1 if prediction == "shift" else 0
    for k in range(1, 4):
        start = k * b - offset
        cols = (layout.chunks == k) & layout.noisy
        cache = model.new_cache(2, 64)
        with torch.no_grad():
            model.prefill(x0[:, :start], cache)  # block_causal: the prompt goes in block by block, like training
            window = inputs[:, cols]
            torch.testing.assert_close(model.denoise(window, cache), logits[:, cols], atol=1e-5, rtol=1e-5)
        assert torch.equal(target[cols], torch.arange(start, start + window.shape[1]) + offset)


@pytest.mark.parametrize("name", ["r2lm", "r2lm+hybrid"])
@pytest.mark.parametrize("keep", [torch.tensor([True, False, True]), torch.tensor([2, 0])])
def test_rows_that_leave_leave_the_others_as_they_were(name, keep):
    """keep_rows (rows a decoder finished leave the batch) moves the kept rows' keys in place: the next window read
    over the smaller cache gives the kept rows' logits of the same read over the whole batch (to float tolerance:
    a smaller batch may take other kernels)."""
    model, ids, mask, first, second = _two_blocks(name)
    cache = model.new_cache(3, 64)
    with torch.no_grad():
        model.prefill(ids, cache, attention_mask=mask)
        model.commit(first, cache)
        whole = model.denoise(second, cache)
        cache.keep_rows(keep)
        kept = model.denoise(second[keep], cache)
    assert cache.batch_size == kept.shape[0] == 2
    torch.testing.assert_close(kept, whole[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["r2lm", "r2lm+hybrid"])
def test_a_cache_that_grows_reads_as_before(name):
    """reserve (a verifier's cache starts small and grows as its rows drift apart): a cache just big enough for the
    prompt and a block grows when a forward needs more room, and the next read gives the logits of the same read
    over a cache that had the room from the start, its committed keys, padding and positions moved as they were."""
    model, ids, mask, first, second = _two_blocks(name)
    roomy, tight = model.new_cache(3, 64), model.new_cache(3, 19)
    with torch.no_grad():
        for cache in (roomy, tight):
            model.prefill(ids, cache, attention_mask=mask)
            assert not cache.reserve(8)  # room enough: nothing moves
            model.commit(first, cache)
        assert tight.max_length == 19 and tight.reserve(8) and tight.max_length == 38  # twice its length
        assert tight.reserve(60) and tight.max_length == 79  # or what is needed
        expected, got = model.denoise(second, roomy), model.denoise(second, tight)
    assert torch.equal(tight.valid[:, :19], roomy.valid[:, :19]) and not tight.valid[:, 19:].any()
    assert torch.equal(tight.next_position, roomy.next_position)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_relocate_moves_each_rows_column_into_place():
    """relocate (verification's accepted sibling): before `advance`, each row's scratch column source[r] replaces
    its scratch column `into` in every softmax layer's keys and values; committed columns and the other scratch
    columns stay as they were; a row whose source is `into` keeps its own."""
    model = tiny_r2lm()
    cache = model.new_cache(3, 16)
    cache.advance(4)  # 4 committed columns
    for t in (*cache.key, *cache.value):
        if t is not None:
            t.copy_(torch.randn(t.shape))
    before = [None if t is None else t.clone() for t in (*cache.key, *cache.value)]
    cache.relocate(1, torch.tensor([1, 3, 5]))
    for old, new in zip(before, (*cache.key, *cache.value), strict=True):
        if old is None:
            continue
        want = old.clone()
        want[1, :, 5], want[2, :, 5] = old[1, :, 7], old[2, :, 9]  # scratch column 1 = cache column 4 + 1
        assert torch.equal(new, want)
