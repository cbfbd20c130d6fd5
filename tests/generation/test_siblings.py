"""Siblings (r2lm.generation.verify): a verification forward that also tries a drafter's next likeliest first
tokens, each a column of its own after the opener. Whatever it tries, the output is transformers' greedy output;
every committed column (an accepted sibling's moved into the draft's first column, in the cache too) is read as a
full recompute of the committed text reads it; the drafter drafts from the features of the committed text; the
mask lets a sibling see the opener and itself only; the policy tries siblings where they pay."""

import numpy as np
import pytest
import torch

from r2lm import generate
from r2lm.generation.costs import ScriptedCosts
from r2lm.generation.policy import Adaptive, Policy
from r2lm.generation.proposal import Proposal
from r2lm.layout import verify_layout
from tests.generation.test_drafter import trained
from tests.helpers.decoding import left_padded
from tests.helpers.models import MASK_ID, tiny_conversion, tiny_r2lm


class Siblings(Policy):
    """Every draft whole with every sibling beside it; notes the proposals it was shown and the siblings' outcomes."""

    def start(self, *args, **kwargs):
        super().start(*args, **kwargs)
        self.shown, self.hits = [], []

    def width(self, proposal):
        self.shown.append(proposal)
        return self.widths[-1]

    def siblings(self, proposal, width):
        return self.most_siblings

    def observe(self, proposal, width, agreed, remaining, siblings=0, hit=None):
        if siblings:
            self.hits += hit.tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(transformers model, its R2LM conversion, a drafter trained on the target's text: often wrong at its first
    guess where its second or third is right)."""
    hf, target = tiny_conversion(tmp_path_factory.mktemp("siblings"), "qwen3", sidecar_layers=[])
    return hf, target, trained(target)


def prompts(count: int):
    return [torch.randint(0, MASK_ID - 1, (1, 6), generator=torch.Generator().manual_seed(100 + seed))
            for seed in range(count)]


def test_siblings_never_change_the_output(setup):
    """A left-padded batch, several drafts, an EOS that stops a row early: transformers' greedy output, with
    siblings accepted at more than one rank."""
    hf, target, drafter = setup
    ids, mask = left_padded()
    hits = []
    for eos in (None, "row 0's sixth"):
        greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=23, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
        if eos is not None:
            eos = int(greedy[0, ids.shape[1] + 5])
            greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=23, do_sample=False, pad_token_id=0,
                                 eos_token_id=eos)
        policy = Siblings()
        out = generate(target, ids, mask, max_new_tokens=23, verify=True, drafter=drafter, eos_token_id=eos or [],
                       pad_token_id=0, verify_draft="drafter", verify_policy=policy)
        assert torch.equal(out.sequences, greedy[:, : out.sequences.shape[1]])
        hits += policy.hits
    for prompt in prompts(20):  # searched over prompts, within a bound (a trained drafter's guesses vary by CPU)
        policy = Siblings()
        out = generate(target, prompt, max_new_tokens=24, verify=True, drafter=drafter, verify_draft="lookup+drafter",
                       verify_policy=policy, eos_token_id=[])
        assert torch.equal(out.sequences, hf.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0,
                                                      eos_token_id=None))
        hits += policy.hits
        if {-1, 0, 1} <= set(hits):
            break
    assert {0, 1} <= set(hits) and -1 in hits, hits  # siblings right at the first and a later rank, and wrong


def test_every_committed_column_reads_what_a_full_recompute_reads(setup):
    """Each verification's committed columns give the logits a full forward over the committed text gives
    (transformers', no cache), also after a sibling's keys took the draft's first column's place; and every draft
    is what the drafter drafts from a fresh context of the committed text (its features moved with it)."""
    hf, target, drafter = setup
    layers = tuple(drafter.config.feature_layers)
    hits = 0
    for prompt in prompts(20):  # until 3 siblings were right (searched within a bound)
        steps, policy = [], Siblings()
        out = generate(target, prompt, max_new_tokens=24, verify=True, drafter=drafter, verify_draft="drafter",
                       verify_policy=policy, eos_token_id=[], step_callback=steps.append)
        text, start = out.sequences, prompt.shape[1]
        with torch.no_grad():
            full = hf(text).logits[0]
            captured = target.model(text, capture=layers).captured
        for info, shown in zip(steps, policy.shown, strict=True):
            at = start + int(info.start[0])  # committed tokens before the step
            for j in range(min(int(info.accepted.sum()) + 1, info.logits.shape[1])):
                torch.testing.assert_close(info.logits[0, j], full[at - 1 + j], atol=1e-4, rtol=1e-4)
            if shown.draft[0, 0] != MASK_ID:  # drafted after the committed text, from what the target read of it
                context = drafter.new_context(1, at + 2 * drafter.config.block_size)
                drafter.append(context, [h[:, : at - 1] for h in captured])
                want, p, siblings, q = drafter.draft(context, text[:, at - 1], confidence=True,
                                                     siblings=policy.most_siblings)
                assert np.array_equal(shown.draft[0], want[0, : shown.draft.shape[1]].numpy())
                assert np.array_equal(shown.siblings[0], siblings[0].numpy())
                np.testing.assert_allclose(shown.sibling_confidence[0], q[0].numpy(), atol=1e-5)
        hits += sum(h >= 0 for h in policy.hits)
        if hits >= 3:
            break
    assert hits >= 3, hits


def test_a_sibling_sees_the_opener_and_itself():
    """The mask of a forward of width 3 with 2 siblings, against the rule written out: trunk column j sees trunk
    columns 0 .. j; a sibling sees column 0 and itself; nothing else sees a sibling."""
    layout = verify_layout(3, [], siblings=2)
    seen = layout.dense_mask("causal")[0]
    want = torch.tensor([[1, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0],
                         [1, 1, 1, 0, 0],
                         [1, 0, 0, 1, 0],
                         [1, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(seen, want)
    assert layout.positions[0].tolist() == [0, 1, 2, 1, 1]
    with pytest.raises(ValueError, match="siblings stand in"):
        verify_layout(1, [], siblings=2)


def proposal_with_siblings(sure: float, sibling: float, k: int = 3) -> Proposal:
    return Proposal(np.array([[1, 2, 3, 4]]), np.array([[sure, sure, sure, sure]]), np.array([0]),
                    np.array([[5, 6, 7][:k]]), np.array([[sibling] * k]))


def taught(costs, first: float, sibling: float) -> Adaptive:
    """An adaptive policy whose estimates have seen a drafter's first guess right `first` of the time and each
    sibling `sibling` of the time, at the confidences of `proposal_with_siblings`."""
    policy = Adaptive(costs)
    policy.start(("drafter",), (1, 2, 3, 4), None, 99, siblings=3)
    rng = np.random.default_rng(0)
    for _ in range(400):
        shown = proposal_with_siblings(0.3, 0.2)
        right = rng.random() < first
        hit = int(rng.choice(3)) if not right and rng.random() < 3 * sibling / (1 - first) else -1
        policy.observe(shown, 2, np.array([int(right)]), np.array([100]), 3, np.array([hit]))
    return policy


def test_the_policy_tries_siblings_where_they_pay():
    """Where a wider forward costs what a narrow one does, siblings often right are tried beside the draft; where
    each column costs as much as an AR step, or the siblings are never right, none are."""
    flat = ScriptedCosts(lambda rows, width: 1.0 + 0.01 * width)
    policy = taught(flat, first=0.3, sibling=0.1)
    shown = proposal_with_siblings(0.3, 0.2)
    width = policy.width(shown)
    assert width >= 2 and policy.siblings(shown, width) == 3
    assert policy.siblings(proposal_with_siblings(0.3, 0.2), width) == 0  # another proposal: not what was decided
    never = taught(flat, first=0.3, sibling=0.0)
    width = never.width(shown)
    assert never.siblings(shown, width) == 0
    costly = taught(ScriptedCosts(lambda rows, width: float(width)), first=0.3, sibling=0.1)
    assert costly.width(shown) == 1 and costly.siblings(shown, 1) == 0


def test_verify_siblings_is_checked(setup):
    hf, target, drafter = setup
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="verify_siblings must be an int in"):
        generate(target, ids, max_new_tokens=4, verify=True, drafter=drafter, verify_siblings=-1)
    with pytest.raises(ValueError, match="has no drafter"):
        generate(target, ids, max_new_tokens=4, verify=True, verify_draft="lookup", verify_siblings=2)
    out = generate(target, ids, max_new_tokens=6, verify=True, drafter=drafter, verify_siblings=0, eos_token_id=[])
    assert torch.equal(out.sequences, hf.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                                  eos_token_id=None))


def test_block_hybrid_layers_refuse_branches():
    """A block-hybrid layer reads earlier chunks as one folded state, which would fold a sibling in for every later
    column: it refuses a layout with branches by name (verify=True refuses such models before any forward)."""
    model = tiny_r2lm(attention="block_causal", hybrid_layers=[1], hybrid_feature_dim=8)
    layout = verify_layout(3, [], siblings=2)
    with pytest.raises(ValueError, match="a layout with branches .* needs softmax layers"):
        model(torch.zeros(1, layout.length, dtype=torch.long), layout=layout)
