"""Replay of the drafter's own errors (r2lm.drafter_loss, `replay`): the first pass judges each block as decoding's
verification would (checked against the drafter's own decode-time draft), the replayed blocks open exactly where
decoding would open the next block, and the first pass leaves the loss of the blocks it does not move unchanged."""

import pytest
import torch

from r2lm import drafter_loss, generate
from tests.generation.test_drafter import trained
from tests.helpers.models import MASK_ID, tiny_conversion

PROMPT = 6  # the trained drafter's text: 6 prompt tokens, then the target's greedy reply


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(a drafter trained a few dozen steps, the target's greedy text, its features, valid, reply)"""
    _, target = tiny_conversion(tmp_path_factory.mktemp("replay"), "qwen3", sidecar_layers=[])
    drafter = trained(target)
    # the start of its training text (tests.generation.test_drafter.trained): drafts accepted whole, in part, not at all
    text = torch.randint(0, MASK_ID - 1, (16, PROMPT), generator=torch.Generator().manual_seed(2))[:4]
    text = generate(target, text, max_new_tokens=40, block_size=1, eos_token_id=[]).sequences
    with torch.no_grad():
        captured = target.model(text, capture=tuple(drafter.config.feature_layers)).captured
    valid, reply = torch.ones_like(text), torch.arange(text.shape[1]).expand_as(text) >= PROMPT
    return drafter.train(), text, captured, valid, reply


def loss(setup, replay, seed=0, spy=None):
    drafter, text, captured, valid, reply = setup
    drafter.zero_grad()
    out = drafter.loss(captured, text, valid, reply, blocks=8, generator=torch.Generator().manual_seed(seed),
                       replay=replay)
    out.loss.backward()
    grads = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
    return out, grads


def test_the_first_pass_judges_blocks_as_verification_would(setup, monkeypatch):
    """Each first-pass block's right leading guesses are those of the drafter's decode-time draft from the same
    context and opener, compared with the target's greedy text (here the text itself: the target's own reply)."""
    drafter, text, captured, _, _ = setup
    seen = []
    monkeypatch.setattr(drafter_loss, "replayed", lambda score, measured, *_: seen.append(measured) or score)
    loss(setup, replay=0.5)
    (measured,) = seen
    b = drafter.config.block_size
    # a guess whose two likeliest tokens are nearly tied may differ between two ways of computing it by rounding
    # alone (another CPU's kernels): such blocks are left out, the rest must agree exactly
    top2 = measured.logits.topk(2, -1).values
    clear = ((top2[..., 0] - top2[..., 1]) > 1e-3).view(*measured.anchors.shape, b).all(-1)
    checked = 0
    for row in range(text.shape[0]):
        for anchor, used, leading, sure in zip(measured.anchors[row].tolist(), measured.used[row].tolist(),
                                               measured.leading[row].tolist(), clear[row].tolist(), strict=True):
            if not used or not sure or anchor + b >= text.shape[1]:
                continue  # a block whose text ends early counts only the guesses it has
            with torch.no_grad():
                context = drafter.new_context(1, anchor + 2 * b)
                drafter.append(context, [h[row : row + 1, :anchor] for h in captured])
                draft = drafter.draft(context, text[row : row + 1, anchor])[0]
            right = (draft == text[row, anchor + 1 : anchor + 1 + b]).long()
            assert leading == int(right.cumprod(0).sum()), (row, anchor)
            checked += 1
    assert checked >= 10
    assert any(0 < x < b for x in measured.leading[measured.used].tolist())  # some blocks refused part-way


def test_replayed_blocks_open_where_decoding_opens_the_next_block(setup, monkeypatch):
    drafter, text, *_ = setup
    b, length = drafter.config.block_size, text.shape[1]
    calls = []
    original = drafter_loss.replayed
    monkeypatch.setattr(drafter_loss, "replayed",
                        lambda score, measured, allowed, b, k: calls.append((score, measured, allowed, k))
                        or original(score, measured, allowed, b, k))
    loss(setup, replay=0.5)
    ((score, measured, allowed, k),) = calls
    assert k == 4  # half of the 8 blocks
    raised = original(score, measured, allowed, b, k)
    for row in range(text.shape[0]):  # the brute-force rule: in the measured blocks' order, the first k that fit
        expected = []
        for anchor, used, leading in zip(measured.anchors[row].tolist(), measured.used[row].tolist(),
                                         measured.leading[row].tolist(), strict=True):
            after = anchor + min(leading + 1, b)
            if used and after < length and allowed[row, after] and len(expected) < k:
                expected.append(after)
        assert sorted(set(expected)) == (raised[row] >= 1).nonzero().flatten().tolist()
        chosen = raised[row].topk(8).indices.tolist()
        assert set(expected) <= set(chosen)  # the replayed blocks are read, the rest random as before
        moved = raised[row] != score[row]
        assert torch.equal(raised[row][moved], 1 + score[row][moved])


def test_the_first_pass_changes_nothing_it_does_not_move(setup):
    """replay > 0 with no block to move (k = 0) reads the same blocks over the same cache: the loss and the
    gradients are exactly replay=0's. Metrics stay the random anchors' at any replay share."""
    plain, plain_grads = loss(setup, replay=0.0)
    still, still_grads = loss(setup, replay=0.01)  # round(0.01 * 8) = 0 blocks moved
    assert torch.equal(plain.loss, still.loss)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, still_grads, strict=True))
    half, half_grads = loss(setup, replay=0.5)
    assert torch.equal(half.tau, plain.tau) and torch.equal(half.first_right, plain.first_right)
    assert not torch.equal(half.loss, plain.loss)
    assert all(torch.isfinite(g).all() for g in half_grads) and any(g.abs().sum() > 0 for g in half_grads)
