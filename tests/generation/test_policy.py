"""The run-time policy of verify=True (r2lm.generation.policy): whatever it decides, the output is transformers'
greedy output; it takes AR steps where drafting costs more than it brings and whole drafts where a perfect drafter is
cheap; every length works with every draft source (issue 40 item 1: max_new_tokens=1 and block_size=1 crashed)."""

import math
import re
import time

import numpy as np
import pytest
import torch
from torch import nn

from r2lm import generate
from r2lm.drafter import Drafter, DrafterConfig
from r2lm.generation import window
from r2lm.generation.costs import REMEASURE_BUDGET, MeasuredCosts, ScriptedCosts, StepClock, interpolate
from r2lm.generation.costs import TRIALS as COST_TRIALS
from r2lm.generation.hostwork import REST, WEIGHED
from r2lm.generation.policy import MARGIN, Adaptive, Longest, Policy
from r2lm.generation.prices import PROBE_BUDGET
from r2lm.generation.proposal import Proposal
from r2lm.ops.linear import install
from tests.helpers.decoding import left_padded
from tests.helpers.models import MASK_ID, tiny_conversion, tiny_r2lm, tiny_tokenizer

SOURCES = ["window", "lookup", "drafter", "lookup+drafter"]


class AlwaysAR(Policy):
    def worth(self, source, free, rows):
        return False

    def width(self, proposal):
        return 1


class Alternating(Policy):
    """AR steps and whole drafts in turn, and a drafter or window paid for every other step."""

    def start(self, *args, **kwargs):
        super().start(*args, **kwargs)
        self.steps = self.asked = 0

    def worth(self, source, free, rows):
        self.asked += 1
        return self.asked % 2 == 1

    def width(self, proposal):
        self.steps += 1
        return self.widths[-1] if self.steps % 2 else 1


class Resting(Longest):
    """Whole drafts, and every other step none at all (as the measured policy does where drafting has not paid for
    its host work): the drafts made on the host are skipped, not only left unverified."""

    def start(self, *args, **kwargs):
        super().start(*args, **kwargs)
        self.asked = 0

    def rests(self, rows):
        self.asked += 1
        return self.asked % 2 == 0


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers model, its R2LM conversion without sidecars, an untrained drafter for it)."""
    hf, target = tiny_conversion(tmp_path_factory.mktemp("policy"), "qwen3", sidecar_layers=[])
    torch.manual_seed(1)
    return hf, target, Drafter(DrafterConfig.for_target(target.config, block_size=4)).eval()


def options_of(source, drafter):
    return dict(verify_draft=source, **({"drafter": drafter} if "drafter" in source else {}))


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("policy", [AlwaysAR, Longest, Alternating, Resting, Adaptive])
def test_no_policy_changes_the_output(converted, source, policy):
    """Forced choices (every step AR, every draft whole, the two alternating, every other step no draft made) and
    the measured policy: each gives
    transformers' greedy output, over a left-padded batch, with and without an EOS that stops a row early."""
    hf, target, drafter = converted
    ids, mask = left_padded()
    ids[:, -4:] = ids[:, 2:6]  # a repeated span: lookup has something to copy
    greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=19, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = generate(target, ids, mask, max_new_tokens=19, block_size=4, verify=True, eos_token_id=[], pad_token_id=0,
                   verify_policy=policy(), **options_of(source, drafter))
    assert torch.equal(out.sequences, greedy)
    eos = int(greedy[0, ids.shape[1] + 5])  # a token row 0 writes (its 6th)
    stopped = hf.generate(ids, attention_mask=mask, max_new_tokens=19, do_sample=False, pad_token_id=0, eos_token_id=eos)
    out = generate(target, ids, mask, max_new_tokens=19, block_size=4, verify=True, eos_token_id=eos, pad_token_id=0,
                   verify_policy=policy(), **options_of(source, drafter))
    assert torch.equal(out.sequences, stopped[:, : out.sequences.shape[1]])


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("policy", [AlwaysAR, Alternating, Adaptive])
def test_no_policy_changes_where_a_stop_string_stops(source, policy):
    tok = tiny_tokenizer()
    target = tiny_r2lm(vocab_size=len(tok) + 1, mask_token_id=len(tok), sidecar_layers=[])
    with torch.no_grad():
        target.lm_head.weight.mul_(30)
    drafter = Drafter(DrafterConfig.for_target(target.config, block_size=4)).eval()
    prompt = tok("the quick brown", return_tensors="pt").input_ids
    ar = generate(target, prompt, max_new_tokens=16, block_size=1, eos_token_id=[])
    stop = tok.decode(ar.sequences[0, prompt.shape[1]:])[4:7]
    want = generate(target, prompt, max_new_tokens=16, block_size=1, eos_token_id=[], tokenizer=tok, stop_strings=[stop])
    out = generate(target, prompt, max_new_tokens=16, block_size=4, verify=True, eos_token_id=[], tokenizer=tok,
                   stop_strings=[stop], verify_policy=policy(), **options_of(source, drafter))
    assert torch.equal(out.sequences, want.sequences)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("policy", [Longest, Adaptive])
def test_every_length_with_every_draft_source(converted, batch, source, policy):
    """max_new_tokens 1, 2, b - 1, b, b + 1 for drafts of 1, 2 and 4 (the drafter's own block is 4: shorter drafts
    cut it), and a prompt shorter than a block: AR's output, no crash."""
    hf, target, drafter = converted
    ids, mask = left_padded(batch=batch)
    for b in (1, 2, 4):
        for n in sorted({1, 2, max(b - 1, 1), b, b + 1}):
            want = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                               eos_token_id=None)
            out = generate(target, ids, mask, max_new_tokens=n, block_size=b, verify=True, eos_token_id=[],
                           pad_token_id=0, verify_policy=policy(), **options_of(source, drafter))
            assert torch.equal(out.sequences, want), (b, n)
    short = ids[:1, -1:]
    for n in (1, 3, 9):
        want = hf.generate(short, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
        out = generate(target, short, max_new_tokens=n, verify=True, eos_token_id=[], verify_policy=policy(),
                       **options_of(source, drafter))
        assert torch.equal(out.sequences, want), n


class OracleDrafter(Drafter):
    """A perfect drafter (a test oracle): it drafts the target's own greedy continuation, known beforehand, from the
    number of tokens its context says are committed, with full confidence."""

    def draft(self, context, openers, confidence=False, siblings=0):
        b = self.config.block_size
        at = context.kv.next_position[:, None] + 1 + torch.arange(b)  # the tokens after the opener
        ids = self.continuation.gather(1, at.clamp(max=self.continuation.shape[1] - 1))
        if not confidence:
            return ids
        if not siblings:
            return ids, torch.ones(ids.shape)
        others = (ids[:, :1] + 1 + torch.arange(siblings)) % MASK_ID  # never the target's: sure they are not
        return ids, torch.ones(ids.shape), others, torch.zeros(others.shape)


def widths_of(target, ids, n, **options):
    widths, accepted = [], []

    def note(info):
        widths.append(info.proposals.shape[1])
        accepted.append(info.accepted.sum(1).tolist())

    out = generate(target, ids, max_new_tokens=n, verify=True, eos_token_id=[], step_callback=note, **options)
    return out, widths, accepted


@pytest.mark.parametrize("source", [s for s in SOURCES if s != "window"])  # (the window's forwards: two shapes)
@pytest.mark.parametrize("policy", [AlwaysAR, Alternating])
def test_a_call_builds_only_the_forward_shapes_it_runs(converted, source, policy, monkeypatch):
    """A forward shape's masks are built on its first use: a call builds one per forward width its steps ran (after
    the first, which reads the prompt through the model's own forward), not one per width and sibling count it
    might have run (29 with a drafter at block 8 and 3 siblings)."""
    hf, target, drafter = converted
    built = []
    original = window._Shape.__init__

    def spy(self, model, cache, template, commit):
        built.append(template.length)
        original(self, model, cache, template, commit)

    monkeypatch.setattr(window._Shape, "__init__", spy)
    ids = left_padded(batch=1)[0]
    out, widths, _ = widths_of(target, ids, 12, block_size=4, verify_policy=policy(), **options_of(source, drafter))
    assert len(built) == len(set(widths[1:])), (source, widths, built)


def test_expensive_drafting_makes_every_step_an_ar_step(converted):
    """A scripted cost where each verified draft token costs 10 AR steps and a drafter forward 100: every step is a
    plain AR step (one column), for the oracle drafter and for lookup, and no probe is due within the call."""
    hf, target, drafter = converted
    ids = left_padded(batch=1)[0]
    greedy = hf.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    oracle = OracleDrafter(drafter.config).eval()
    oracle.continuation = greedy
    costly = ScriptedCosts(verify=lambda rows, width: 1.0 + 10 * (width - 1), draft=lambda rows: 100.0)
    for options in (dict(verify_draft="drafter", drafter=oracle), dict(verify_draft="lookup+drafter", drafter=oracle),
                    dict(verify_draft="lookup"), dict(verify_draft="window")):
        out, widths, _ = widths_of(target, ids, 24, block_size=4, verify_policy=Adaptive(costly), **options)
        assert torch.equal(out.sequences, greedy)
        assert widths == [1] * 24 and out.nfe == 24, (options["verify_draft"], widths)


def test_a_ruled_out_drafter_is_probed_across_short_calls(converted):
    """A drafter the estimates rule out is still tried every n-th step (n: PROBE_BUDGET of the AR time pays for a
    probe), the steps counted across calls like the estimates: calls shorter than n probe it too (before, each
    call counted from 0, so a drafter ruled out in calls of fewer than n steps was never tried again)."""
    _, target, drafter = converted

    class Counted(Adaptive):
        asked = 0

        def worth(self, source, free, rows):
            Counted.asked += 1
            return super().worth(source, free, rows)

    class Counting(Drafter):
        drafts = 0

        def draft(self, context, openers, confidence=False, siblings=0):
            Counting.drafts += 1
            return super().draft(context, openers, confidence, siblings)

    counting = Counting(drafter.config).eval()
    counting.load_state_dict(drafter.state_dict())
    # a forward of width 4 costs 2.5 AR steps and drafting 0.5: at an even chance of acceptance (the prior) the
    # drafter does not pay, and a probe costs 2 AR steps more than an AR step: one every ceil(2 / PROBE_BUDGET) + 1
    # (without siblings, whose columns would make the widest forward wider)
    costs = ScriptedCosts(verify=lambda rows, width: 1.0 + 0.5 * (width - 1), draft=lambda rows: 0.5)
    every = math.ceil(2 / PROBE_BUDGET) + 1
    ids = left_padded(batch=1)[0]
    for _ in range(math.ceil(2.5 * every / 10)):  # calls of 10 tokens, 2.5 intervals in all
        generate(target, ids, max_new_tokens=10, verify=True, drafter=counting, verify_draft="drafter", block_size=4,
                 verify_siblings=0, verify_policy=Counted(costs), eos_token_id=[])
    assert Counted.asked >= 2 * every and Counting.drafts == Counted.asked // every >= 2


def test_a_step_is_learnt_before_the_next_draft_is_chosen_and_timed_after_it(converted):
    """Each step's outcome reaches the estimates (`observe`) before the next draft is chosen (`worth`, `choose`:
    they read the latest estimates), and the step's time (`took`) is taken once that draft is made (a drafter's
    forward is the step's), before the next width; the last step makes no draft."""
    _, target, drafter = converted
    calls = []

    class Logged(Adaptive):
        pass

    for name in ("observe", "worth", "choose", "took", "width"):
        def logged(self, *args, _name=name, **kwargs):
            calls.append(_name)
            return getattr(Adaptive, _name)(self, *args, **kwargs)
        setattr(Logged, name, logged)
    ids = left_padded(batch=1)[0]
    ids[:, -4:] = ids[:, 2:6].clone()  # lookup has something to copy
    generate(target, ids, max_new_tokens=12, verify=True, drafter=drafter, block_size=4, verify_policy=Logged(),
             eos_token_id=[])
    steps = " ".join(calls)
    assert re.fullmatch(r"(choose )?width( observe worth( choose)? took width)+ observe took", steps), steps


def test_a_perfect_cheap_drafter_drafts_the_whole_block(converted):
    """The oracle drafter under a scripted cost where width is nearly free: after the first forward (which appends
    the prompt and has no draft yet) every forward verifies the whole block and accepts all of it, the last one only
    the tokens left (23 after the first: five blocks of 4, then 3)."""
    hf, target, drafter = converted
    ids = left_padded(batch=1)[0]
    greedy = hf.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    oracle = OracleDrafter(drafter.config).eval()
    oracle.continuation = greedy
    cheap = ScriptedCosts(verify=lambda rows, width: 1.0 + 0.01 * (width - 1), draft=lambda rows: 0.05)
    out, widths, accepted = widths_of(target, ids, 24, drafter=oracle, verify_draft="drafter", block_size=4,
                                      verify_policy=Adaptive(cheap))
    assert torch.equal(out.sequences, greedy)
    assert widths == [1, 4, 4, 4, 4, 4, 3]
    assert [a[0] for a in accepted[1:-1]] == [4] * (len(accepted) - 2)  # (the last one may be cut by max_new_tokens)
    assert out.nfe == 1 + -(-23 // 4)


def test_the_policy_drafts_where_acceptance_pays_and_stops_where_confidence_falls():
    """The arithmetic behind the choices, on scripted costs: the width maximising expected committed tokens per
    second, a draft cut where its estimated acceptance falls, a costly drafter run only where it pays."""
    policy = Adaptive(ScriptedCosts(verify=lambda rows, width: 1.0 + 0.1 * (width - 1), draft=lambda rows: 0.5))
    policy.start(("lookup", "drafter"), (1, 2, 3, 4), None, mask_id=99)
    sure, unsure = 0.95, 0.05
    for _ in range(50):  # what was seen: confident drafter tokens accepted, unconfident ones refused
        seen = Proposal(np.array([[1, 2, 3, 4]]), np.array([[sure, sure, unsure, unsure]]), np.array([1]))
        policy.observe(seen, 4, np.array([2]), np.array([100]))
    confident = Proposal(np.array([[1, 2, 3, 4]]), np.array([[sure] * 4]), np.array([1]))
    falling = Proposal(np.array([[1, 2, 3, 4]]), np.array([[sure, sure, unsure, unsure]]), np.array([1]))
    assert policy.width(confident) == 4
    assert policy.width(falling) == 3  # the third token is worth little: committing 3 at most costs less
    assert policy.width(Proposal(np.array([[99] * 4]), np.zeros((1, 4)), np.array([0]))) == 1  # no draft: AR
    assert policy.worth("drafter", None, 1)  # its tokens are mostly accepted: it pays for its forward
    policy.costs = ScriptedCosts(verify=lambda rows, width: 1.0 + 0.1 * (width - 1), draft=lambda rows: 50.0)
    assert not policy.worth("drafter", None, 1)  # a forward of 50 AR steps never pays


def test_drafting_rests_where_it_spares_less_than_its_host_work():
    """Making drafts on the host takes seconds of its own. Under measured costs (given to `start`: seconds), once
    WEIGHED steps' drafts were not worth verifying (a wider forward costs 3 AR steps, lookup's unconfident drafts
    an even chance), the host work they took was spent for nothing: REST steps of every REST + 1 then make no
    draft. Sure drafts under cheap widths spare far more than their host work: every step makes them. Costs said
    rather than measured (Adaptive(costs)) are in no unit of time, and never weighed against seconds."""
    costly = ScriptedCosts(verify=lambda rows, width: 0.05 * (1 + 2 * (width - 1)))
    cheap = ScriptedCosts(verify=lambda rows, width: 0.05 * (1 + 0.01 * (width - 1)))
    unsure = Proposal(np.array([[1, 2, 3, 4]]), np.full((1, 4), 0.01), np.array([0]))
    sure = Proposal(np.array([[1, 2, 3, 4]]), np.ones((1, 4)), np.array([0]))

    def rested(policy, proposal, steps):
        out = []
        for _ in range(steps):
            out.append(policy.rests(1))
            if not out[-1]:  # the drafts made on the host (1 ms), then their width chosen
                policy.hosted(1e-3)
                policy.width(proposal)
        return out

    steps = WEIGHED + 3 * (REST + 1)
    policy = Adaptive()
    policy.start(("lookup",), (1, 2, 3, 4), costly, 99)
    assert rested(policy, unsure, steps) == [False] * WEIGHED + ([True] * REST + [False]) * 3
    policy = Adaptive()
    policy.start(("lookup",), (1, 2, 3, 4), cheap, 99)
    for _ in range(20):  # lookup's sure drafts were accepted whole
        policy.observe(sure, 4, np.array([4]), np.array([100]))
    assert policy.width(sure) == 4 and not any(rested(policy, sure, steps))
    said = Adaptive(costly)
    said.start(("lookup",), (1, 2, 3, 4), None, 99)
    assert not any(rested(said, unsure, steps))


def test_at_one_row_a_drafter_pays_no_more_against_free_drafts_than_against_none():
    """What lets `worth` keep its verdict against no drafts where free drafts are at hand, at one row: whatever the
    estimates, confidences, siblings, tokens left and costs, the drafter pays against free drafts at most what it
    pays against none, or less than 1 (where the row keeps the free draft, the drafter's forward only costs). Not in
    a batch, where a drafter can pay for the row the free drafts leave behind. At one row and at two, `worth`
    answers as a verdict against the free drafts would (it makes none where the bound settles it)."""
    rng = np.random.default_rng(0)
    b = 8
    for trial in range(600):
        rows = 1 + trial % 2
        columns = np.concatenate([[1.0], 1.0 + np.cumsum(rng.uniform(-0.05, 0.4, b + 3))])
        drafting = rng.uniform(0.01, 1.0)
        policy = Adaptive(ScriptedCosts(verify=lambda r, width, c=columns: c[width - 1] * (1 + 0.1 * r),
                                        draft=lambda r, d=drafting: d))
        policy.start(("lookup", "ngram", "drafter"), tuple(range(1, b + 1)), None, mask_id=99,
                     siblings=int(rng.integers(0, 4)))

        def drafts(length):
            return np.where(np.arange(b)[None] < length[:, None], np.arange(1, b + 1)[None], 99)

        for _ in range(int(rng.integers(1, 40))):  # what each source's drafts were seen to be worth
            length = rng.integers(1, b + 1, rows)
            policy.observe(Proposal(drafts(length), rng.uniform(0, 1, (rows, b)), rng.integers(0, 3, rows)),
                           int(rng.integers(1, b + 1)), rng.integers(0, length + 1), rng.integers(1, 100, rows))
        free = Proposal(drafts(rng.integers(0, b + 1, rows)), rng.uniform(0, 1, (rows, b)), rng.integers(0, 2, rows))
        against_none, against_free = policy.pays("drafter", 2, None, rows), policy.pays("drafter", 2, free, rows)
        if rows == 1:
            assert against_free <= max(against_none, 1 / MARGIN) * (1 + 1e-12)
        policy.estimates["drafter"].idle = idle = int(rng.integers(0, 3))
        assert policy.worth("drafter", free, rows) == (against_free > 1 or idle >= policy.probe_interval(rows))
    # a batch the bound does not hold for: tied rows, a sure free draft for one, none for the other; the drafter's
    # for the second let the batch take the first's too, so it pays against the free drafts and not against none
    policy = Adaptive(ScriptedCosts(verify=lambda r, width: 1.0 + 0.05 * (width - 1), draft=lambda r: 0.5))
    policy.start(("lookup", "drafter"), (1, 2, 3, 4), None, mask_id=99)
    sure, none, left = np.array([1, 2, 3, 4]), np.array([99] * 4), np.array([100, 100])
    for _ in range(30):  # lookup's drafts accepted whole, the drafter's first token one time in four
        policy.observe(Proposal(np.stack([sure, sure]), np.ones((2, 4)), np.array([0, 0])), 4, np.array([4, 4]), left)
        policy.observe(Proposal(np.stack([sure, sure]), np.full((2, 4), 0.5), np.array([1, 1])), 4, np.array([1, 1]),
                       left)
    free = Proposal(np.stack([sure, none]), np.array([[1.0] * 4, [0.0] * 4]), np.array([0, 0]))
    assert policy.pays("drafter", 1, None, 2) < 1 < policy.pays("drafter", 1, free, 2)
    policy.estimates["drafter"].idle = 1
    assert policy.worth("drafter", free, 2)


def test_a_batch_drafts_for_the_row_with_most_left():
    """Where a forward costs the same whatever its rows, only the row with most left decides how soon the batch
    ends: a sure draft is verified when that row (or every row tied with it) has one, not when only a row ahead of
    it does; where each row costs its own share, the rows' own tokens count too."""
    flat = ScriptedCosts(verify=lambda rows, width: 1.0 + 0.1 * (width - 1))
    policy = Adaptive(flat)
    policy.start(("lookup",), (1, 2, 3, 4), None, mask_id=99)
    for _ in range(50):  # lookup's drafts have been accepted whole
        policy.observe(Proposal(np.array([[1, 2, 3, 4]]), np.ones((1, 4)), np.array([0])), 4, np.array([4]),
                       np.array([100]))
    sure, none = [1, 2, 3, 4], [99] * 4

    def width(drafts, remaining):
        policy.row_accepted = policy.row_tried = None  # (a new batch: no running rates yet)
        policy.remaining = None if remaining is None else np.array(remaining)
        return policy.width(Proposal(np.array(drafts), (np.array(drafts) != 99).astype(float), np.zeros(len(drafts), int)))

    assert width([sure, sure], None) == 4  # every row has it
    assert width([sure, none], None) == 1  # one row cannot end the batch sooner
    assert width([sure, none], [40, 20]) == 4  # the row with most left has it: the batch ends sooner
    assert width([none, sure], [40, 20]) == 1
    assert width([sure, none], [40, 38]) == 3  # the other row is 2 behind it: 3 tokens shorten the batch
    assert width([sure], [2]) == 2  # no wider than what is left
    per_row = ScriptedCosts(verify=lambda rows, width: rows * (1.0 + 0.1 * (width - 1)))
    policy.costs = per_row
    assert width([sure, none], None) == 4  # each row pays its own share: row 0's tokens pay for its columns


def test_steps_that_take_longer_than_priced_make_drafting_dearer():
    """The prices are forwards timed on a scratch cache, and a step is more (the drafter's context caught up, the
    step's host work). Steps whose drafting took 4 times its price make the policy count drafting at what it took,
    and a drafter it found worth its forward it no longer does; steps that take what they are priced at change
    nothing. (Costs given to `start` are measured seconds; costs given to Adaptive(...) are said, and no step's
    wall time is weighed against them.)"""
    forward, drafting = (lambda rows, width: 1.0 + 0.02 * (width - 1)), (lambda rows: 0.3)
    shown = Proposal(np.array([[1, 2, 3, 4]]), np.full((1, 4), 0.5), np.array([0]))

    def decisions(extra: float, policy=None):
        if policy is None:
            policy = Adaptive()
            policy.start(("drafter",), (1, 2, 3, 4), ScriptedCosts(forward, drafting), 99)
        used = []
        for _ in range(30):  # each step: decide on the drafter, verify its draft at width 2, take the step's time
            policy.observe(shown, 2, np.array([1]), np.array([100]))
            used.append(policy.worth("drafter", None, 1))
            policy.took(forward(1, 2) + (drafting(1) * extra if used[-1] else 0.0), 2, 1)
        return used

    assert all(decisions(extra=1.0))
    slow = decisions(extra=4.0)
    assert slow[0] and not any(slow[-10:])
    said = Adaptive(ScriptedCosts(forward, drafting))
    said.start(("drafter",), (1, 2, 3, 4), None, 99)
    assert all(decisions(extra=4.0, policy=said))


def test_a_width_whose_steps_cost_more_than_priced_is_left_for_another():
    """A forward width can cost more than its measured neighbours suggest (its products' orders are its own) or
    than one measurement said: its steps' own times price it. Width 3 priced at its neighbours' line but taking
    three times that: the policy turns to width 2 (the draft's first token) within a few steps, and keeps it."""
    forward = lambda rows, width: 1.0 + 0.02 * (width - 1)  # noqa: E731
    took = lambda width: 3 * forward(1, width) if width == 3 else forward(1, width)  # noqa: E731
    policy = Adaptive()
    policy.start(("lookup",), (1, 2, 3), ScriptedCosts(forward), 99)
    sure = Proposal(np.array([[1, 2, 99]]), np.full((1, 3), 0.9), np.array([0]))  # two tokens, always accepted
    chosen = []
    for _ in range(20):
        chosen.append(policy.width(sure))
        policy.observe(sure, chosen[-1], np.array([chosen[-1] - 1]), np.array([100]))
        policy.took(took(chosen[-1]), chosen[-1], 1)
    assert chosen[0] == 3 and chosen.count(3) <= 4 and set(chosen[-10:]) == {2}


def slowed_forwards(slowed: dict):
    """Forwards that sleep 8 ms per column and a fixed 4 ms, three times as long while a load lasts
    (`slowed[width]`: calls of that width still slowed; "any": of any width)."""
    def forward(rows, width):
        def run():
            load = slowed.get(width, 0) > 0 or slowed.get("any", 0) > 0
            time.sleep(0.004 * (1 + 2 * width) * (3 if load else 1))
            for key in (width, "any"):
                slowed[key] = slowed.get(key, 0) - 1
        return run
    return forward


def test_a_measurement_that_met_a_passing_load_is_measured_again():
    """A cost table timed while another process held the core would misprice every step for the whole process.
    Steps far faster than their prices make the policy time the forwards again, once, when they have taken long
    enough that the measurement is a small share of their time (REMEASURE_BUDGET); a table whose wider forward
    came out cheaper than a narrower one is timed again at once; steps that stay slower than their forwards after
    a new measurement agreed with the old one (a fixed cost beside the forward) do not make it measure on."""
    calls = 3 * (1 + COST_TRIALS)  # a measurement at one row: widths 1, 2, 4, each run once untimed, then timed
    slowed = {"any": calls}
    costs = MeasuredCosts(slowed_forwards(slowed), [1, 2, 4], None, torch.device("cpu"))
    costs.measure(1)
    assert costs.verify(1, 1) >= 0.036  # the whole first measurement met the load
    policy = Adaptive()
    policy.start(("lookup",), (1, 2, 3, 4), costs, 99)
    for _ in range(12):  # AR steps, at what they take without the load: too few to pay for a measurement
        policy.took(0.012, 1, 1)
    assert costs.remeasures == 0
    for _ in range(5000):  # enough that a measurement is within REMEASURE_BUDGET of what they took
        policy.took(0.012, 1, 1)
    assert costs.remeasures == 1 and costs.verify(1, 1) < 0.024 and not costs.settled
    assert costs.remeasuring <= REMEASURE_BUDGET * policy.clock.seconds
    assert 0.5 < policy.clock.forward < 2 and policy.price(1).ar < 0.024  # priced at the new measurement

    slowed = {2: 1 + COST_TRIALS}  # only width 2's forwards met the load: 20 ms x 3 > 36 ms / 0.8
    implausible = MeasuredCosts(slowed_forwards(slowed), [1, 2, 4], None, torch.device("cpu"))
    implausible.measure(1)
    table = implausible.verify_table[1]
    assert table[1] < table[2] < table[4] and table[2] < 0.036

    steady = MeasuredCosts(slowed_forwards({}), [1, 2, 4], None, torch.device("cpu"))
    steady.measure(1)
    policy = Adaptive()
    policy.start(("lookup",), (1, 2, 3, 4), steady, 99)
    for _ in range(3000):  # every step three times its forward
        policy.took(3 * steady.verify(1, 1), 1, 1)
    assert steady.remeasures == 1 and steady.settled


def test_a_step_in_which_the_tuner_timed_products_does_not_price_the_forwards():
    """Rows that leave a batch bring row counts new to the model's r2lm.ops.linear tuner, which times their product
    orders inside the steps that first use them (every order in turn: such a step takes many forwards' time). Those
    steps say what the tuning took, not what a forward costs: they move no price and have nothing measured again (a
    new measurement, tens of seconds at batch 8, inside a user's call). The same slow steps without tuning do."""
    layer = nn.Linear(64, 64)
    install(layer)
    costs = MeasuredCosts(slowed_forwards({}), [1, 2, 4], None, torch.device("cpu"), models=(layer,))
    costs.measure(1)
    policy = Adaptive()
    policy.start(("lookup",), (1, 2, 3, 4), costs, 99)
    slow = 10 * costs.verify(1, 1)
    for rows in range(1, 13):  # each step, the tuner times a class it has not seen: a row count new to it
        with torch.no_grad():
            layer(torch.randn(rows, 64))
        policy.took(slow, 1, 1)
    assert costs.remeasures == 0 and policy.clock.forward == 1.0 and np.isnan(policy.clock.columns[1])
    for _ in range(1000):  # steps as slow, with no tuning in them: the prices are in doubt (once steps have taken
        policy.took(slow, 1, 1)  # long enough to pay for measuring)
    # (at least once: whether a sleep-timed measurement agrees with the last one closely enough to settle depends on
    # the machine's load, not on what is tested here)
    assert costs.remeasures >= 1


def test_a_new_measurement_keeps_what_steps_showed():
    """Forwards measured again re-express what steps showed against the new prices instead of forgetting it: a
    width whose steps took twice its old price, now measured at that, is at its price; drafting whose steps took 3
    times its price (host work beside the drafter's forward, which no measurement of the forward sees), measured
    the same again, still costs 3 times it; a width no step timed is at AR steps' ratio (1 here: none was timed)."""
    clock = StepClock(4)
    for _ in range(40):
        clock.forward_step(2.0, 1.0, 2)  # width 2: 2 s where 1 s was priced
        clock.drafting_step(1.0 * 2.0 + 3 * 0.5, 1.0, 2, 0.5)  # its forward, then drafting at 3x its 0.5 s
    assert clock.factors()[2] == pytest.approx(2.0, rel=1e-3) and clock.drafting == pytest.approx(3.0, rel=1e-3)
    clock.rescale(np.array([1.0, 0.5, 1.0, 1.0]), 1.0)  # widths 1 .. 4: width 2 now priced at 2 s, drafting as was
    assert clock.factors().tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0, 1.0], rel=1e-3)
    assert clock.drafting == pytest.approx(3.0, rel=1e-3) and clock.forward == 1.0


def test_a_width_no_step_has_timed_is_priced_at_ar_steps_ratio():
    """The policy weighs each width against an AR step: where AR steps take 1.3 times their price, a width no step
    has timed is taken at 1.3 times its own (at 1, it would look 1.3 times cheaper than measured), until its own
    steps show what it takes."""
    clock = StepClock(4)
    for _ in range(40):
        clock.forward_step(1.3, 1.0, 1)  # AR steps: 1.3 s where 1 s was priced
    assert clock.factors()[1:].tolist() == pytest.approx([1.3] * 4, rel=1e-3)
    for _ in range(40):
        clock.forward_step(2.0, 2.0, 3)  # width 3 takes its price
    assert clock.factors()[[1, 2, 3, 4]].tolist() == pytest.approx([1.3, 1.3, 1.0, 1.3], rel=1e-3)


def test_the_clock_tells_whether_prices_moved_without_reading_them():
    """A policy keeps a verdict while the prices cannot have moved enough to flip it (StepClock.within), reading
    the clock's travel most steps: between any two moments every factor a price is multiplied by (each width's,
    drafting's) moved by at most the travel in between (|log| of the ratio), whatever steps, widths untimed until
    then and new measurements came in between; and `within` answers as the factors themselves do (checked against
    them, every pair of moments)."""
    rng = np.random.default_rng(0)
    clock = StepClock(5)
    seen = [clock.mark()]
    for step in range(300):
        columns = int(rng.integers(1, 6))
        if step % 97 == 96:
            clock.rescale(rng.uniform(0.5, 2.0, 5), float(rng.uniform(0.5, 2.0)))
        elif rng.random() < 0.3:
            clock.drafting_step(float(rng.uniform(1.0, 3.0)), 1.0, columns, 0.5)
        else:
            clock.forward_step(float(rng.uniform(0.5, 2.0)), 1.0, columns)
        seen.append(clock.mark())
    now = clock.prices()
    for i, (travel, prices) in enumerate(seen):
        for later, moved in seen[i + 1:]:
            assert np.abs(np.log(moved / prices)).max() <= later - travel + 1e-9
        for band in (0.01, 0.1, 0.5):
            assert (clock.within((travel, prices), band) is None) == (np.abs(np.log(now / prices)).max() >= band)


def test_cost_tables_interpolate_between_measured_shapes():
    table = {1: 1.0, 4: 2.5}
    assert interpolate(table, 1) == 1.0 and interpolate(table, 2) == 1.5 and interpolate(table, 6) == 3.5
    assert interpolate({3: 2.0}, 7) == 2.0


def test_measured_costs_are_kept_per_model(converted):
    """The first call at a batch size times its forwards (on a scratch cache: the call's output is the same), the
    next calls reuse the table."""
    from r2lm.generation.costs import measured_tables

    hf, target, _ = converted
    ids = left_padded(batch=1)[0]
    generate(target, ids, max_new_tokens=3, block_size=4, verify=True, verify_draft="lookup", eos_token_id=[])
    tables = measured_tables(target)
    key = next(k for k in tables if k[:2] == ("LookupDrafts", 4))
    assert set(tables[key]["verify"]["1"]) == {"1", "2", "3", "4"} and all(s > 0 for s in tables[key]["verify"]["1"].values())
    before = dict(tables[key]["verify"]["1"])
    generate(target, ids, max_new_tokens=3, block_size=4, verify=True, verify_draft="lookup", eos_token_id=[])
    assert measured_tables(target)[key]["verify"]["1"] == before


def test_measuring_settles_only_the_product_orders_its_forwards_use():
    """Before timing a shape, its forward runs until one call times no product (every order it uses decided): a
    class its forwards never use, left undecided by other work, must not hold each shape to SETTLE forwards."""
    model = tiny_r2lm().eval()
    tuner = install(model)
    with torch.no_grad():
        tuner(torch.ones(3, 7), torch.ones(5, 7))  # a class of another model's: undecided, never used below
        added = []

        def forward(rows, width):
            def run():
                before = tuner.timings()
                model(torch.zeros(rows, width, dtype=torch.long))
                added.append(tuner.timings() - before)
            return run

        MeasuredCosts(forward, [1, 2], None, torch.device("cpu"), (model,)).time_forwards(1)  # one measurement
    assert tuner.undecided() == 1
    # each width: forwards that time products until one times none; then the timed forwards, which time none
    assert added.count(0) == 2 + 2 * COST_TRIALS and added[-2 * COST_TRIALS - 1:] == [0] * (2 * COST_TRIALS + 1)


def test_verify_policy_is_checked(converted):
    _, target, _ = converted
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="verify_policy must be one of"):
        generate(target, ids, max_new_tokens=4, verify=True, verify_policy="fastest")
    with pytest.raises(ValueError, match="pass verify=True"):
        generate(target, ids, max_new_tokens=4, verify_policy="longest")
