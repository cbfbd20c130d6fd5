"""How much each row drafts at each step of verified decoding, and from which source: never slower than AR.

A draft pays only where it is accepted often enough to cover what it costs: on a CPU a forward that verifies 7
draft tokens costs more than an AR step, several times more in a batch of 8 than alone, and a drafter's own forward
a fraction of one (eval/step_cost.py measures them; docs/results.md).
So `verify_policy="adaptive"` (the default) decides at run time, from two measurements:

- acceptance, per draft source: the share of submitted tokens accepted, pooled (a new source starts at an even
  chance and is known within a few steps; a drafter's siblings together an even chance), by the source's
  confidence in the token (lookup's: how long a suffix it matched) and its position in the draft
  (10 confidence buckets x the first, second, third and later tokens, each drawn towards the pooled rate: kept for
  the model and drafter across calls), and per row (this call's running rate, which scales the cells' estimate):
  q = estimated probability that a token is accepted, given that the ones before it were. A row submitting tokens with estimates q_1 .. q_k commits E(k) = 1 + sum_i prod_{j<=i} q_j tokens
  on average; a [MASK] (no draft) has q = 0, so a draft effectively stops where its confidence falls;
- cost (r2lm.generation.costs): C(R, w), the seconds of a forward over R rows that verifies w - 1 tokens of each,
  and D(R), what drafting adds to a step (the drafter's forward, and appending the step's column to its context),
  both timed on a scratch cache; and checked against the steps themselves (r2lm.generation.costs.StepClock):
  each forward width is priced at what its own steps took against its measured cost (a width can cost more than
  its neighbours' measured costs suggest: its products' orders are its own; one no step has timed, at AR steps'
  ratio), drafting at what steps with it took beyond their forward (the drafter's context caught up, the step's
  host work: more than the drafter's forward alone; docs/results.md, "Siblings"), and where steps without the
  drafter take more than DISAGREE times or less than 1 / DISAGREE of their price, the measurement itself is in
  doubt (it met a passing load) and the forwards are timed again, within a budget of the steps' own time
  (MeasuredCosts.remeasure: a measurement is many forwards, as slowed as the steps; what steps showed is
  kept, re-expressed against the new prices); a step in which the model's product tuner (r2lm.ops.linear) timed a
  shape class new to it, a row count reached as rows leave, is left out: its time is the tuning's;

Each step it takes the forward width w that spares most AR time per second. What a step spares is measured in
the AR decoding it replaces: an AR step over R rows costs C(R, 1) = A + B R (A the forward's fixed part, B each
row's: both from the measured C(1, 1) and C(R, 1)), so decoding the rest by AR steps takes A max_r m_r + B sum_r m_r
seconds, m_r the tokens row r has left (rows leave as they finish). A step of width w spares on average
A E[drop of max_r m_r] + B sum_r E_r(w), where the max drops by k only if every row commits at least k minus how
far it is behind the row with most left (rows independent: a product over rows). At batch 1 this is C(1, 1) E(w),
committed tokens; at batch 8 on a CPU, where A is most of a step, a draft only one row has barely shortens the
batch, and the policy drafts where the rows with most left have drafts worth verifying. w = 1 is a plain AR step,
and wins unless a wider forward promises MARGIN more (the estimates err; AR never loses). Each row submits its draft
up to that width (a row with a shorter draft submits fewer: the forward is one width for the batch), from the
source whose draft promises more (lookup or the drafter). Before paying for the drafter's forward it checks that
the drafts it expects from it (at the rows' running rates) spare more than D costs. The window source (R2LM's own
window) drafts inside a wider forward: it is paid for by that forward's extra cost, and used while it spares more
than AR steps would.

A source the estimates rule out is still tried now and then (a probe), or its estimate could never recover: every
n-th step, n chosen so that probing costs at most PROBE_BUDGET of an AR step's time (r2lm.generation.prices: what
the policy reads of the costs), the steps counted across calls (with the estimates), so that calls shorter than n
steps probe too.

Making and weighing drafts on the host is a cost too, paid every step: where drafting has not spared what it took,
the policy rests from it for a few steps at a time (r2lm.generation.hostwork).

What is committed never depends on these choices: every verification commits the target's own greedy tokens
(r2lm.generation.verify). `verify_policy="longest"` always submits the whole draft (the behaviour before this
policy), and a Policy subclass may decide otherwise (tests force AR steps, the longest drafts, or alternate them).
"""

from __future__ import annotations

import math
import time
import weakref
from abc import ABC, abstractmethod

import numpy as np

from r2lm.generation.acceptance import PRIOR, Acceptance
from r2lm.generation.costs import StepClock, StepCosts
from r2lm.generation.hostwork import HostWork
from r2lm.generation.prices import Pricing
from r2lm.generation.proposal import Proposal

ROW_DECAY = 0.8  # a row's running rate follows its own text quickly (code, then prose)
ROW_PRIOR = 2.0  # pseudo-tries of a row's rate at the source's rate
VERDICT_DRIFT = 1.25  # a kept verdict's probe interval is made again once prices may have moved by this factor
MARGIN = 1.05  # drafting (a wider forward, a drafter's forward) must promise this much more than not drafting
MAX_Q = 0.99


class Policy(ABC):
    """Decides each step's forward width and the rows' drafts, on the host (`Proposal.host`). `start` is called
    once per generate() call."""

    needs_costs = False  # whether `start` needs the measured costs of the call's forwards

    def start(self, sources: tuple[str, ...], widths: tuple[int, ...], costs: StepCosts | None, mask_id: int,
              model=None, key: tuple = (), siblings: int = 0) -> None:
        """`model` and `key` (the drafts' own: r2lm.generation.drafts.Drafts.key) name what may be learnt across
        calls; `siblings`: the most a forward may verify beside a draft (Proposal.siblings)."""
        self.sources, self.widths, self.costs, self.mask_id = sources, widths, costs, mask_id
        self.most_siblings = siblings

    def choose(self, candidates: list[Proposal]) -> Proposal:
        """One draft per row among several sources' (host; each [MASK] where it has none): by default the first
        that has one (lookup before the drafter)."""
        out = candidates[0]
        for other in candidates[1:]:
            out = out.where(out.draft[:, 0] == self.mask_id, other)
        return out

    def worth(self, source: str, free: Proposal | None, rows: int) -> bool:
        """Whether to pay for `source`'s drafting this step (the drafter's forward, the window's wider forward);
        `free`: the drafts at hand without it (host; None: none)."""
        return True

    @abstractmethod
    def width(self, proposal: Proposal) -> int:
        """The next forward's width (1 .. b: it verifies the first `width` draft tokens of each row and commits at
        most `width` tokens; 1 is an AR step)."""

    def siblings(self, proposal: Proposal, width: int) -> int:
        """How many of each row's siblings the next forward verifies beside its draft at `width` (>= 2: a sibling
        stands in for the draft's first token). By default none."""
        return 0

    def observe(self, proposal: Proposal, width: int, agreed: np.ndarray, remaining: np.ndarray, siblings: int = 0,
                hit: np.ndarray | None = None) -> None:
        """After verification, before the next draft is made: each row's accepted count `agreed` [R] of the draft it
        submitted at `width`, the tokens it has left to decode, `remaining` [R] (0 once it is done), with
        `siblings` verified beside the drafts, `hit` [R]: the rank of the sibling that was the target's token (-1:
        none)."""
        return  # by default nothing is learnt

    def took(self, seconds: float | None, columns: int, rows: int) -> None:
        """Once the next draft is made: the step's wall time `seconds` (from one host sync to the next, its drafting
        included; None for the first, which appends the prompt), a forward of `columns` columns over `rows` rows."""
        return  # by default nothing is timed

    def keep_rows(self, stay: np.ndarray) -> None:
        """Rows that finished leave."""
        return  # by default nothing is kept per row

    def rests(self, rows: int) -> bool:
        """Whether the next step of `rows` rows makes no draft on the host (an AR step without drafting's host work).
        By default never."""
        return False

    def hosted(self, seconds: float) -> None:
        """Making the next drafts on the host (the free sources', the choice between them and the drafter's, its
        forward where it ran) took `seconds`; `width` is asked about them next."""
        return  # by default nothing is timed


class Longest(Policy):
    """Every draft whole: the widest forward whenever some row has a draft (before run-time decisions existed)."""

    def width(self, proposal: Proposal) -> int:
        return self.widths[-1] if bool((proposal.draft != self.mask_id).any()) else 1


_ACCEPTANCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(drafts' key, source): Acceptance}


class Adaptive(Pricing, Policy):
    """Committed tokens per second, from measured acceptance and measured costs (the module docstring)."""

    def __init__(self, costs: StepCosts | None = None):
        self.scripted = costs  # costs said rather than measured (r2lm.generation.costs.ScriptedCosts)
        self.needs_costs = costs is None

    def start(self, sources, widths, costs, mask_id, model=None, key=(), siblings=0) -> None:
        super().start(sources, widths, self.scripted or costs, mask_id, model, key, siblings)
        kept = _ACCEPTANCE.setdefault(model, {}) if model is not None else {}
        self.estimates = {name: kept.setdefault((key, name), Acceptance()) for name in sources}
        # the siblings' own: a cell is (confidence, rank among the siblings), a token accepted where it is the
        # target's, whatever the draft's first token was; at first the K of them together an even chance (they are
        # disjoint events: an even chance each would promise K / 2 tokens a step)
        sibling_prior = (PRIOR[0], PRIOR[1] * max(siblings, 1))
        self.sibling_estimates = {name: kept.setdefault((key, name, "siblings"), Acceptance(sibling_prior))
                                  for name in sources}
        # what steps took against their prices (r2lm.generation.costs.StepClock), kept like the estimates
        self.clock = kept.setdefault((key, "clock"), StepClock(max(widths) + siblings))
        self.clock.fit(max(widths) + siblings)
        self.drafting = False  # whether the drafter's forward ran in the step now running (`worth` said so)
        self.drafted = False  # whether it ran in the step before
        self.decided: tuple | None = None  # (proposal, width, siblings): `width`'s choice, which `siblings` reads
        self.row_accepted = self.row_tried = None  # [R, sources] this call's running counts
        self.remaining = None  # [R] tokens each row has left (None before the first step: all rows alike)
        self.prices: dict = {}  # (costs, rows) -> Prices, read once: the policy decides every step
        self.clocked: dict = {}  # (costs, rows) -> (the clock's version, those Prices at what steps show)
        self.learnt, self.verdicts = [0] * len(sources), {}  # per source: observations that changed its estimates
        self.tuned = None if self.costs is None else self.costs.timings()  # products the tuners timed by the last step
        # (proposal, its q): the last estimate made, read again by choose, pays and width within a step (the
        # estimates move only in observe, between a step's verification and its next draft)
        self.known: tuple[Proposal, np.ndarray] | None = None
        self.estimated = None  # `sources_now()`
        self.host_work = kept.setdefault((key, "host work"), HostWork())  # what drafts made on the host spare
        self.host_work.start()

    # --------------------------------------------------------------------------------------------- estimates

    def _rows(self, rows: int) -> None:
        if self.row_accepted is None:
            self.row_accepted = np.zeros((rows, len(self.sources)))
            self.row_tried = np.zeros((rows, len(self.sources)))

    def sources_now(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The sources' estimates as arrays: [S] pooled rates, [S, BUCKETS, POSITIONS] their cells and their
        siblings' cells (made again once they learn: a step reads them several times)."""
        if self.estimated is None:
            drafts, siblings = ([kept[name] for name in self.sources] for kept in (self.estimates, self.sibling_estimates))
            self.estimated = (np.array([e.rate() for e in drafts]), np.stack([e.cells() for e in drafts]),
                              np.stack([e.cells() for e in siblings]))
        return self.estimated

    def row_rate(self, source: int) -> np.ndarray:
        """[R]: each row's running acceptance rate of a source, drawn towards the source's own rate."""
        return self.row_rates()[:, source]

    def row_rates(self) -> np.ndarray:
        """[R, S]: `row_rate` of every source."""
        return (self.row_accepted + ROW_PRIOR * self.sources_now()[0]) / (self.row_tried + ROW_PRIOR)

    def q(self, proposal: Proposal) -> np.ndarray:
        """[R, b]: each draft token's estimated acceptance given the ones before it (0 at [MASK]): its cell's
        estimate, scaled by the row's running rate against the source's."""
        if self.known is not None and self.known[0] is proposal:
            return self.known[1]
        self._rows(proposal.draft.shape[0])
        rate, cells, _ = self.sources_now()
        source = proposal.source
        bucket, position = Acceptance.cell(proposal.confidence, np.arange(proposal.draft.shape[1]))
        scale = self.row_rates()[np.arange(len(source)), source] / np.maximum(rate[source], 1e-6)
        q = np.minimum(cells[source[:, None], bucket, position] * scale[:, None], MAX_Q)
        q *= proposal.draft != self.mask_id
        self.known = proposal, q
        return q

    def sibling_q(self, proposal: Proposal) -> np.ndarray:
        """[R, K]: each sibling's estimated chance of being the target's token (0 at [MASK]); the events are
        disjoint from each other's and from the draft's first token's."""
        siblings = proposal.siblings.shape[1]
        if not siblings:
            return np.zeros(proposal.siblings.shape)
        bucket, position = Acceptance.cell(proposal.sibling_confidence, np.arange(siblings))
        q = np.minimum(self.sources_now()[2][proposal.source[:, None], bucket, position], MAX_Q)
        return q * (proposal.siblings != self.mask_id) * (proposal.draft[:, :1] != self.mask_id)

    @staticmethod
    def expected(q: np.ndarray) -> np.ndarray:
        """[R, b + 1]: tokens each row commits on average at width k + 1, i.e. submitting its first k tokens and
        committing at most k + 1 (k = 0 .. b)."""
        return np.concatenate([np.ones((q.shape[0], 1)), 1 + np.cumsum(np.cumprod(q, 1), 1)], 1)

    def saved(self, q: np.ndarray, sibling: np.ndarray | None = None) -> np.ndarray:
        """[b]: the seconds of AR decoding that a step of width w = 1 .. b spares the batch, on average (the module
        docstring): the per-forward part of an AR step times how far the row with most left advances, plus the
        per-row part times the tokens the rows commit. `sibling` [S, R]: S cases of the chance that a sibling
        verified beside the draft is the target's token (then the row commits 2 tokens: at widths >= 2 only), for
        [S, b] at once."""
        rows, b = q.shape
        price = self.price(rows)
        ar, per_row = price.ar, price.per_row
        # P(row r commits at least j tokens), j = 0 .. b: 1 up to j = 1, then P(its first j - 1 are accepted)
        at_least = np.ones((1 if sibling is None else len(sibling), rows, b + 1))
        at_least[:, :, 2:] = np.cumprod(q[:, : b - 1], 1)
        if sibling is not None and b > 1:  # the draft's first token or a sibling: disjoint events
            at_least[:, :, 2] = np.minimum(at_least[:, :, 2] + sibling, 1.0)
        # the most left falls by >= k iff every row commits >= k - its gap, how far it is behind the row with most
        # left (a forward commits at most its width, and k - gap <= k <= width: the width never cuts this)
        if self.remaining is None:  # (no gaps)
            lead = at_least[:, :, 1:].prod(1)
        else:
            at_least[:, np.arange(b + 1)[None, :] > self.remaining[:, None]] = 0  # never more than it has left
            gap = (self.remaining.max() - self.remaining).astype(np.int64)
            need = np.maximum(np.arange(1, b + 1)[None, :] - gap[:, None], 0)
            lead = at_least[:, np.arange(rows)[:, None], need].prod(1)
        out = (ar - per_row * rows) * np.cumsum(lead, -1) + per_row * np.cumsum(at_least[:, :, 1:].sum(1), -1)
        return out[0] if sibling is None else out

    def best(self, q: np.ndarray, extra: float = 0.0, sibling_q: np.ndarray | None = None) -> tuple[int, int, float]:
        """(width, siblings, AR seconds spared per second) maximising the rate, `extra` seconds paid on top of the
        forward, k siblings [R, k] of `sibling_q` verified beside drafts of width >= 2 for C(R, w + k); a width
        above 1 only where it beats an AR step by MARGIN (estimates err: the AR step is the safe choice)."""
        price = self.price(q.shape[0])
        widths = np.minimum(price.widths, q.shape[1])
        wide = price.widths >= 2
        # k = 0 .. K siblings, K the most before a [MASK] in every row (the siblings are in order)
        k = 0 if sibling_q is None or not wide.any() else int(np.cumprod(sibling_q.any(0)).sum())
        chances = np.zeros((k + 1, q.shape[0]))
        if k:
            chances[1:] = np.cumsum(sibling_q[:, :k], 1).T
        spared = self.saved(q, chances)[:, widths - 1]  # [k + 1, widths]
        rates = spared[0] / (price.verify + extra)
        best = int(np.argmax(rates))  # (the narrowest of equals)
        if best and price.widths[0] == 1 and rates[best] < MARGIN * rates[0]:
            best = 0
        choice = (int(price.widths[best]), 0, float(rates[best]))
        for siblings in range(1, k + 1):
            with_siblings = np.where(wide, spared[siblings] / (price.columns[price.widths + siblings - 1] + extra), 0)
            at = int(np.argmax(with_siblings))
            if with_siblings[at] > choice[2] and with_siblings[at] >= MARGIN * rates[0]:
                choice = (int(price.widths[at]), siblings, float(with_siblings[at]))
        return choice

    # --------------------------------------------------------------------------------------------- decisions

    def choose(self, candidates: list[Proposal]) -> Proposal:
        """Per row, the candidate whose draft promises more committed tokens at the widest forward (where only one
        has a draft, it: no estimate needed)."""
        drafted = np.stack([c.draft[:, 0] != self.mask_id for c in candidates])
        if (drafted.sum(0) < 2).all():
            return super().choose(candidates)
        out, q = candidates[0], self.q(candidates[0])
        value = self.expected(q)[:, -1]
        for other in candidates[1:]:
            theirs = self.q(other)
            mine = self.expected(theirs)[:, -1]
            out, q = out.where(mine > value, other), np.where((mine > value)[:, None], theirs, q)
            value = np.maximum(value, mine)
        self.known = out, q  # each row's estimates are its candidate's
        return out

    def worth(self, source: str, free: Proposal | None, rows: int) -> bool:
        self._rows(rows)
        index = self.sources.index(source)
        estimate = self.estimates[source]
        # against free drafts, at one row, a source pays at most what it pays against none (the row takes the likelier
        # draft: where that is the free one the forward only costs, where it is the source's the rate to beat is at
        # least AR's), so where it sat out the step before, a kept verdict under 1 against none stands for them too
        bound = free is not None and rows == 1 and estimate.idle > 0
        if free is None or bound:
            ratio, interval = self.verdict(source, index, rows)
        if free is not None and not (bound and ratio <= 1):
            ratio, interval = self.pays(source, index, free, rows), self.probe_interval(rows)
        use = ratio > 1 or estimate.idle >= interval
        estimate.idle = 0 if use else estimate.idle + 1
        self.drafting = use
        return use

    def verdict(self, source: str, index: int, rows: int) -> tuple[float, int]:
        """`pays` against no drafts, and the probe interval: kept while what decides them holds (the source's own
        estimates, the rows' gaps, prices that cannot have moved enough to change them), not made every step."""
        left = None if self.remaining is None else self.remaining.tolist()
        gaps = None if left is None else (tuple(max(left) - m for m in left), min(left) < self.widths[-1])
        key = (source, rows, self.costs, self.learnt[index], gaps)
        kept = self.verdicts.get(key)
        if kept is not None:  # prices that moved by a factor f move its ratio by at most f^2: kept while that cannot
            # flip it and its probe interval is off by less than VERDICT_DRIFT
            ratio, mark, interval = kept
            mark = self.clock.within(mark, min(abs(math.log(max(ratio, 1e-9))) / 2, math.log(VERDICT_DRIFT)))
            kept = None if mark is None else (ratio, mark, interval)
        if kept is None:
            kept = self.pays(source, index, None, rows), self.clock.mark(), self.probe_interval(rows)
        self.verdicts = {key: kept}
        return kept[0], kept[2]

    def pays(self, source: str, index: int, free: Proposal | None, rows: int) -> float:
        """How many times what it must beat the estimates expect `source`'s drafting to spare per second (above 1:
        it pays), against the drafts at hand without it and MARGIN (worth, less the probes)."""
        b = self.widths[-1]
        ours = np.broadcast_to(np.minimum(self.row_rate(index), MAX_Q)[:, None], (rows, b))
        without = np.zeros((rows, b)) if free is None else self.q(free)[:, :b]
        drafting = self.price(rows).draft
        if drafting > 0:  # a drafter: its forward, then each row takes the better draft (and its siblings)
            better = self.expected(ours)[:, -1] > self.expected(without)[:, -1]
            siblings = np.full((rows, self.most_siblings), min(self.sibling_estimates[source].rate(), MAX_Q))
            with_it = self.best(np.where(better[:, None], ours, without), extra=drafting,
                                sibling_q=siblings * better[:, None])[2]
        else:  # the window: a forward as wide as the block, every step
            with_it = float(self.saved(ours)[b - 1]) / self.price(rows).verify[-1]
        return with_it / (MARGIN * self.best(without)[2])

    def width(self, proposal: Proposal) -> int:
        self.decided = None
        start = time.perf_counter()
        width, siblings, rate = self.chosen(proposal)
        if self.host_work.making is not None:  # drafts made on the host: what the choice spares against what they took
            price = self.price(len(proposal.draft))
            spared = (rate - 1) * price.columns[width + siblings - 1] if width > 1 else 0.0
            self.host_work.weigh(len(proposal.draft), spared, price.draft, time.perf_counter() - start)
        return width

    def chosen(self, proposal: Proposal) -> tuple[int, int, float]:
        """`best`'s (width, siblings, rate) for a proposal: an AR step (rate 1) where no row has a draft."""
        if len(self.widths) == 1:
            return self.widths[0], 0, 1.0
        if (proposal.draft[:, 0] == self.mask_id).all():  # no row has a draft (most steps where drafting loses)
            return 1, 0, 1.0
        q = self.q(proposal)
        if not q.any():  # nothing to verify: an AR step, whatever the costs' noise
            return 1, 0, 1.0
        choice = self.best(q, sibling_q=self.sibling_q(proposal) if self.most_siblings else None)
        self.decided = (proposal, *choice[:2])
        return choice

    def hosted(self, seconds) -> None:
        self.host_work.hosted(seconds, self.drafting)

    def rests(self, rows: int) -> bool:
        # (costs said rather than measured are in no unit of time: never weighed against seconds)
        return self.costs is not None and self.scripted is None and self.host_work.rests(rows)

    def siblings(self, proposal: Proposal, width: int) -> int:
        """The siblings `width` chose with the width it returned for this proposal."""
        if self.decided is None or self.decided[0] is not proposal or self.decided[1] != width:
            return 0
        return self.decided[2]

    def took(self, seconds, columns, rows) -> None:
        # a step in which the model's tuner timed products (a row count new to it: rows left the batch) took what
        # that timing took, many forwards' worth: it says nothing of the forwards' prices
        timings = None if self.costs is None else self.costs.timings()
        tuned, self.tuned = timings != self.tuned, timings
        if seconds is not None and not tuned:
            self.timed(seconds, columns, rows)
        self.drafted, self.drafting = self.drafting, False

    def observe(self, proposal: Proposal, width: int, agreed: np.ndarray, remaining: np.ndarray, siblings: int = 0,
                hit: np.ndarray | None = None) -> None:
        self._rows(proposal.draft.shape[0])
        self.known = self.estimated = None  # the estimates move
        if siblings:
            self.observe_siblings(proposal, siblings, hit)
        self.remaining = remaining
        # a forward of width w compares w draft tokens with AR's (it commits at most w tokens: the w-th one's
        # acceptance adds none, but is seen)
        real = np.cumprod(proposal.draft[:, :width] != self.mask_id, 1)
        submitted = real.sum(1)  # each row's leading draft tokens inside the forward
        if not submitted.any():  # an AR step with nothing drafted: nothing to learn
            return
        tried = np.minimum(submitted, agreed + 1)  # tokens verification looked at: the accepted, the first refused
        positions = np.arange(width)
        looked = positions[None, :] < tried[:, None]
        accepted = positions[None, :] < agreed[:, None]
        drafted = submitted > 0
        for index in np.unique(proposal.source[drafted]).tolist():
            rows = (proposal.source == index) & drafted
            self.learnt[index] += 1
            seen = looked & rows[:, None]
            self.estimates[self.sources[index]].update(proposal.confidence[:, :width][seen], seen.nonzero()[1],
                                                       accepted[seen])
        drafted_by = (proposal.source[:, None] == np.arange(len(self.sources))) & drafted[:, None]  # [R, S]
        decay = np.where(drafted_by, ROW_DECAY, 1.0)
        self.row_accepted = self.row_accepted * decay + drafted_by * agreed[:, None]
        self.row_tried = self.row_tried * decay + drafted_by * tried[:, None]

    def observe_siblings(self, proposal: Proposal, siblings: int, hit: np.ndarray) -> None:
        """Every sibling verified is an observation at its rank: accepted where it was the target's token."""
        rank = np.broadcast_to(np.arange(siblings), (len(hit), siblings))
        offered = (proposal.siblings[:, :siblings] != self.mask_id) & (proposal.draft[:, :1] != self.mask_id)
        for index, name in enumerate(self.sources):
            seen = offered & (proposal.source == index)[:, None]
            if seen.any():
                self.learnt[index] += 1
                self.sibling_estimates[name].update(proposal.sibling_confidence[:, :siblings][seen], rank[seen],
                                                    (rank == hit[:, None])[seen])

    def keep_rows(self, stay: np.ndarray) -> None:
        self.known = None
        if self.row_accepted is not None:
            self.row_accepted, self.row_tried = self.row_accepted[stay], self.row_tried[stay]
        if self.remaining is not None:
            self.remaining = self.remaining[stay]


POLICIES = {"adaptive": Adaptive, "longest": Longest}


def policy_of(value) -> Policy:
    """`verify_policy`: a name in POLICIES, or a Policy (a new object per call: it keeps per-call state)."""
    if isinstance(value, Policy):
        return value
    if isinstance(value, str) and value in POLICIES:
        return POLICIES[value]()
    raise ValueError(f"verify_policy must be one of {tuple(POLICIES)} or an r2lm.generation.policy.Policy, got {value!r}")
