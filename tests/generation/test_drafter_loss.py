"""The drafting loss's options (r2lm.drafter_loss).

Replay of the drafter's own errors (`replay`): the first pass judges each block as decoding's verification would
(checked against the drafter's own decode-time draft), the replayed blocks open exactly where decoding would open the
next block, and the first pass leaves the loss of the blocks it does not move unchanged.

Conditional columns (`conditional`): the loss weighs each column by whether the guesses before it are right,
against a reimplementation of that rule over the blocks' logits, which are the decode path's."""

import pytest
import torch
import torch.nn.functional as F

from r2lm import drafter_loss, generate
from tests.generation.test_drafter import trained
from tests.helpers.models import MASK_ID, tiny_conversion

PROMPT = 6  # the trained drafter's text: 6 prompt tokens, then the target's greedy reply


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the target, a drafter trained a few dozen steps on its greedy text)"""
    _, target = tiny_conversion(tmp_path_factory.mktemp("drafter_loss"), "qwen3", sidecar_layers=[])
    return target, trained(target)


def greedy_text(models, rows: int = 4) -> torch.Tensor:
    """The target's greedy text after the first `rows` prompts of its drafter's training text
    (tests.generation.test_drafter.trained): drafts accepted whole, in part, not at all."""
    target, _ = models
    text = torch.randint(0, MASK_ID - 1, (16, PROMPT), generator=torch.Generator().manual_seed(2))[:rows]
    return generate(target, text, max_new_tokens=40, block_size=1, eos_token_id=[]).sequences


def batch_of(models, text: torch.Tensor):
    """(drafter, text, the target's features over it, valid, reply)"""
    target, drafter = models
    with torch.no_grad():
        captured = target.model(text, capture=tuple(drafter.config.feature_layers)).captured
    valid, reply = torch.ones_like(text), torch.arange(text.shape[1]).expand_as(text) >= PROMPT
    return drafter.train(), text, captured, valid, reply


@pytest.fixture(scope="module")
def setup(models):
    return batch_of(models, greedy_text(models))


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


def test_conditional_columns_count_where_the_guesses_before_them_are_right(models, monkeypatch):
    """Every reply anchor's block (as many blocks as anchors): the blocks' logits are the decode path's
    (Drafter.draft_logits from the same context and opener), and the loss is, recomputed block by block from them,
    the mean of column j's cross-entropy against the text's token weighted by decay**j, where every guess before
    column j is the text's token. Unconditional, the same blocks weigh every column. The text is the drafter's
    training text with every fifth reply token replaced by another token of the draft vocabulary: the drafter
    guesses wrong at the first column of some blocks and at a later one of others."""
    _, drafter = models
    text = greedy_text(models)
    changed = text[:, PROMPT + 2 :: 5]
    index = drafter.draft_index()
    text[:, PROMPT + 2 :: 5] = drafter.draft_ids[(index[changed] + 1) % len(drafter.draft_ids)]
    drafter, text, captured, valid, reply = batch_of(models, text)
    b, decay = drafter.config.block_size, 0.8
    anchors = list(range(PROMPT - 1, text.shape[1] - 1))  # every position whose next token is a reply token
    read, original = [], drafter_loss.Blocks
    monkeypatch.setattr(drafter_loss, "Blocks", lambda *fields: read.append(original(*fields)) or read[-1])
    losses = {}
    with torch.no_grad():
        for conditional in (True, False):
            losses[conditional] = drafter.loss(captured, text, valid, reply, blocks=len(anchors), decay=decay,
                                               generator=torch.Generator().manual_seed(0), conditional=conditional).loss
    blocks = read[0]
    assert blocks.used.all() and sorted(blocks.anchors[0].tolist()) == anchors
    totals = {True: [0.0, 0.0], False: [0.0, 0.0]}
    after_wrong = first_wrong = 0  # scored columns after a wrong guess; wrong guesses after right ones (column >= 1)
    for row in range(text.shape[0]):
        for n, anchor in enumerate(blocks.anchors[row].tolist()):
            logits = blocks.logits[row, n * b : (n + 1) * b]
            with torch.no_grad():
                context = drafter.new_context(1, anchor + 2 * b)
                drafter.append(context, [h[row : row + 1, :anchor] for h in captured])
                decoded = drafter.draft_logits(context, text[row : row + 1, anchor])[0]
            torch.testing.assert_close(logits, decoded.float(), rtol=1e-4, atol=1e-4)
            before_right = True
            for j in range(b):
                at = anchor + 1 + j
                label = index[text[row, at]] if at < text.shape[1] else -1
                if label < 0:  # past the text, or a token the draft vocabulary lacks: not scored, never right
                    before_right = False
                    continue
                ce = float(F.cross_entropy(logits[j], label))
                for conditional, total in totals.items():
                    w = decay**j * (before_right or not conditional)
                    total[0] += w * ce
                    total[1] += w
                right = bool(logits[j].argmax() == label)
                after_wrong += not before_right
                first_wrong += j > 0 and before_right and not right
                before_right = before_right and right
    assert after_wrong > 0 and first_wrong > 0  # the two cases where the weights differ
    for conditional, (weighted, weight) in totals.items():
        torch.testing.assert_close(float(losses[conditional]), weighted / weight, rtol=1e-5, atol=0)
    assert not torch.isclose(losses[True], losses[False])
