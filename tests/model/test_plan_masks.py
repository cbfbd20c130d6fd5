"""The plans the drafter's training batch and the decode loop's window reader run (r2lm.plan) see exactly whom their
layouts' docstrings say, against brute-force masks written from those words, pair by pair, for several shapes."""

import pytest
import torch

import r2lm.drafter_loss
from r2lm.drafter import Drafter, DrafterConfig
from r2lm.generation.window import WindowReader
from tests.helpers.decoding import left_padded
from tests.helpers.models import MASK_ID, tiny_r2lm


def drafter_oracle(valid: torch.Tensor, anchors: torch.Tensor, block_size: int, causal: bool) -> torch.Tensor:
    """r2lm.layout.anchored_blocks in words: a block sees the real context columns before its anchor and the columns
    of its own block (those at or before a query's position under causal attention, all of them otherwise), never
    another block's. bool [B, 1, n * b, L + n * b], True = attend."""
    (batch, length), count, b = valid.shape, anchors.shape[1], block_size
    mask = torch.zeros(batch, 1, count * b, length + count * b, dtype=torch.bool)
    for r in range(batch):
        for w in range(count):
            for j in range(b):
                query = w * b + j
                for p in range(length):
                    mask[r, 0, query, p] = bool(valid[r, p]) and p < int(anchors[r, w])
                for k in range(b):
                    mask[r, 0, query, length + w * b + k] = k <= j or not causal
    return mask


@pytest.mark.parametrize("in_block", ["bidirectional", "causal"])
@pytest.mark.parametrize("batch,length,blocks,block_size", [(1, 5, 2, 3), (3, 9, 4, 4), (2, 7, 7, 2)])
def test_the_drafter_training_batch_sees_what_its_layout_says(in_block, batch, length, blocks, block_size,
                                                              monkeypatch):
    """Through Drafter.loss itself: the anchors it draws and the plan its blocks run with are recorded."""
    target = tiny_r2lm(sidecar_layers=[])
    drafter = Drafter(DrafterConfig.for_target(target.config, block_size=block_size, in_block=in_block, sidecar=True))
    drafter.bind(target)
    g = torch.Generator().manual_seed(batch * length)
    ids = torch.randint(0, MASK_ID - 1, (batch, length), generator=g)
    lengths = torch.randint(2, length + 1, (batch,), generator=g)
    valid = torch.arange(length)[None] < lengths[:, None]  # right padding
    with torch.no_grad():
        captured = target.model(ids, capture=tuple(drafter.config.feature_layers)).captured
    seen = {}

    def anchored_blocks(valid, anchors, block_size):
        seen["anchors"] = anchors
        return real_blocks(valid, anchors, block_size)

    def hidden(h, plan, cache, norm=True):
        seen["plan"], seen["cached"] = plan, cache.length
        return real_hidden(h, plan, cache, norm)

    real_blocks, real_hidden = r2lm.drafter_loss.anchored_blocks, drafter.hidden
    monkeypatch.setattr(r2lm.drafter_loss, "anchored_blocks", anchored_blocks)
    monkeypatch.setattr(drafter, "hidden", hidden)
    drafter.loss(captured, ids, valid, valid, blocks=blocks, generator=g)
    plan, anchors, count = seen["plan"], seen["anchors"], seen["anchors"].shape[1]
    assert plan.mask.dtype == torch.bool
    assert torch.equal(plan.mask, drafter_oracle(valid, anchors, block_size, in_block == "causal"))
    assert seen["cached"] == length and plan.keys == length + count * block_size
    assert torch.equal(plan.columns, torch.arange(length, length + count * block_size))
    assert torch.equal(plan.windows, torch.arange(count * block_size).view(count, block_size))  # one per block


def window_oracle(cached: torch.Tensor, width: int, commit: int, causal: bool) -> torch.Tensor:
    """r2lm.generation.window.window_layout in words, over a cache: every query sees the cache's real columns; the
    `commit` leading clean columns see each other (causally, or all of them under block_causal); the window after
    them sees those clean columns and its own (causally, or all of them). bool [B, 1, T, C + T]."""
    batch, length = cached.shape
    mask = torch.zeros(batch, 1, width, length + width, dtype=torch.bool)
    for r in range(batch):
        for i in range(width):
            for c in range(length):
                mask[r, 0, i, c] = bool(cached[r, c])
            for k in range(width):
                same = (i < commit) == (k < commit)
                mask[r, 0, i, length + k] = (same and (k <= i or not causal)) or (i >= commit > k)
    return mask


@pytest.mark.parametrize("attention", ["causal", "block_causal"])
def test_the_window_readers_plans_see_what_their_layouts_say(attention):
    """Forward after forward (the cache growing by the committed columns), the plan's kept mask is the oracle's."""
    model = tiny_r2lm(attention=attention, sidecar_layers=[1])
    ids, mask = left_padded()
    cache = model.new_cache(ids.shape[0], 64)
    model.prefill(ids, cache, attention_mask=mask)
    reader, plans = WindowReader(model, cache), []

    def run(ids, plan, cache, keep, head, capture):
        plans.append((plan, cache.valid[:, : cache.length].clone()))
        return real_run(ids, plan, cache, keep, head, capture)

    real_run, reader._run = reader._run, run
    for width, commit in [(4, 0), (6, 3), (1, 1), (5, 5), (8, 2)]:
        reader.read(torch.full((ids.shape[0], width), MASK_ID), commit, keep=slice(0, width))
        plan, cached = plans[-1]
        want = window_oracle(cached, width, commit, attention == "causal")
        assert torch.equal(plan.mask == 0, want), (width, commit)
        assert plan.keys == cached.shape[1] + width and plan.commit == commit
        assert torch.equal(plan.columns, torch.arange(cached.shape[1], cached.shape[1] + width))
